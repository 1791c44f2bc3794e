"""POST /v1/feedback end to end: turns made with the official openai client through a real
gateway (CPU engine, smollm2-tiny), feedback POSTed with httpx, and the real judge (in this
process, votes from a scripted judge API) merging it: override and weighted as configured, a
comment as the opd hint (teacher: the CPU engine), late feedback audited and counted (after the
sample was published, and while the turn was being judged), another caller's rating refused
with the 404 of an unknown id, a retried POST stored once, bad input refused with a clear 400."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from clawrl.common.feedback import feedback_key
from clawrl.common.proto.records_pb2 import MaskReason, SampleMode
from clawrl.common.records import Sample, decode_entry
from clawrl.judge.service import running
from tests.integration.feedback import plugins  # the module the judge imports by name
from tests.integration.gateway.helpers import GatewayHandle
from tests.integration.judge.helpers import judge_settings
from tests.integration.judge.scripted_judge import openai_backend, scripted_judge

from .conftest import ALICE, BOB, SHARDS, TINY, Names, in_shard

pytestmark = pytest.mark.integration

PRM_YES = "The reply was fine. \\boxed{1}"


def judge_for(redis_url: str, names: Names, judge_url: str, **sections) -> object:
    """A judge on the gateway's turns; `sections` override (feedback={...}, workers={...})."""
    base = {
        "redis": {"turns_stream": names.turns, "stream_shards": SHARDS.count},
        "workers": {"key_prefix": names.judge_prefix, "group": f"g-{uuid.uuid4().hex[:8]}"},
        "audit": {"stream": names.audit},
        "judging": {"mode": "rl", "promote_first_in_session": False},
        "backend": openai_backend(judge_url),
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    base["feedback"] = {
        "key_prefix": names.feedback_prefix,
        "judge_key_prefix": base["workers"]["key_prefix"],
        "audit_stream": base["audit"]["stream"],
        **base.get("feedback", {}),
    }
    return judge_settings(redis_url, **base)


async def from_now(redis: Redis, settings) -> None:
    """The judge's group starts at the streams' ends: turns of other tests are not its."""
    for stream in SHARDS.names(settings.redis.turns_stream):
        await redis.xgroup_create(stream, settings.workers.group, id="$", mkstream=True)


def judge_metric(service, use: str) -> float:
    return service.metrics.registry.get_sample_value("clawrl_judge_feedback_total", {"use": use})


QUESTION = [{"role": "user", "content": "What is 2+3?"}]
REPLIES: dict[str, list[dict[str, str]]] = {}  # session -> its conversation so far


async def chat(gateway: GatewayHandle, session: str, key: str = ALICE) -> tuple[str, str]:
    """One main turn through the official client: (response id, turn id). A session's later
    turns extend its conversation (its reply, then the user's next message), as a client's do:
    a repeated first request would be a retry of the pending turn, not its next state."""
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0)
    history = REPLIES.get(session)
    messages = [*history, {"role": "user", "content": "Thanks. And 3+4?"}] if history else QUESTION
    raw = await client.chat.completions.with_raw_response.create(
        model=TINY, messages=messages, max_tokens=4, extra_headers={"X-Session-Id": session}
    )
    await client.close()
    reply = raw.parse()
    REPLIES[session] = [
        *messages,
        {"role": "assistant", "content": reply.choices[0].message.content},
    ]
    return reply.id, raw.headers["x-turn-id"]


async def close(gateway: GatewayHandle, session: str, key: str = ALICE) -> None:
    """X-Session-Done on a side turn: the pending turn goes to the judge with no next state."""
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(
            f"{gateway.base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "bye"}], "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": session,
                     "X-Turn-Type": "side", "X-Session-Done": "true"},
        )  # fmt: skip
    assert reply.status_code == 200, reply.text


async def feedback(
    gateway: GatewayHandle, body: object, key: str | None = ALICE, **headers: str
) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{gateway.base_url}/feedback", content=content,
                               headers={"Content-Type": "application/json", **headers})  # fmt: skip


async def sample_of(redis: Redis, stream: str, turn_id: str, timeout_s: float = 30) -> Sample:
    """The turn's sample on its shard of the samples stream `stream`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for _, fields in await redis.xrange(in_shard(stream, turn_id)):
            sample = decode_entry(fields, Sample)
            if sample.sample_id == turn_id:
                return sample
        assert time.monotonic() < deadline, f"no sample of {turn_id} on {stream}"
        await asyncio.sleep(0.05)


async def audits(redis: Redis, stream: str, turn_id: str) -> list[tuple[str, dict]]:
    """(outcome, record) of every audit entry of a turn (on its shard of `stream`)."""
    found = []
    for _, fields in await redis.xrange(in_shard(stream, turn_id)):
        if fields[b"id"].decode() == turn_id:
            found.append((fields[b"outcome"].decode(), orjson.loads(fields[b"data"])))
    return found


async def stored(redis: Redis, names: Names, turn_id: str) -> dict[bytes, bytes]:
    """The turn's feedback hash."""
    return await redis.hgetall(feedback_key(in_shard(names.feedback_prefix, turn_id), turn_id))


def session(shard: int | None = None) -> str:
    """A new session id (in `shard` when given)."""
    while True:
        sid = f"fb-{uuid.uuid4().hex[:10]}"
        if shard is None or SHARDS.of(sid) == shard:
            return sid


async def test_explicit_feedback_overrides_the_judge(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    rated, by_session = session(1), session(0)  # a response id is looked up in every shard
    response_id, turn_id = await chat(gateway, rated)
    _, other_turn = await chat(gateway, by_session)
    reply = await feedback(gateway, {"response_id": response_id, "reward": -0.5,
                                     "comment": "Too terse."})  # fmt: skip
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "feedback" and body["status"] == "accepted"
    assert body["turn_id"] == turn_id and body["reward"] == -0.5
    # By session id: its latest turn.
    reply = await feedback(gateway, {"session_id": by_session, "thumbs": "down"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["turn_id"] == other_turn
    async with scripted_judge(lambda kind, prompt: PRM_YES) as votes:
        settings = judge_for(redis_url, names, votes.url)
        await from_now(redis, settings)
        async with running(settings, serve=False) as service:
            await close(gateway, rated)
            await close(gateway, by_session)
            first = await sample_of(redis, settings.redis.samples_stream, turn_id)
            second = await sample_of(redis, settings.redis.samples_stream, other_turn)
            used = judge_metric(service, "reward_override")
        assert not votes.requests  # override: the PRM is not asked at all
    assert (first.reward, first.reward_source) == (-0.5, "feedback")
    assert first.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED and set(first.loss_mask) == {1}
    assert (second.reward, second.reward_source) == (-1.0, "feedback")
    assert used == 2
    ((outcome, record),) = await audits(redis, settings.audit.stream, turn_id)
    assert outcome == "published" and record["feedback"]["used"] == ["reward_override"]
    assert [e["comment"] for e in record["feedback"]["entries"]] == ["Too terse."]


async def test_weighted_feedback_is_combined_with_the_prm(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    sid = session()
    response_id, turn_id = await chat(gateway, sid)
    # Two feedbacks: the latest reward wins (thumbs up, then an explicit -1).
    assert (await feedback(gateway, {"response_id": response_id, "thumbs": "up"})).is_success
    assert (await feedback(gateway, {"response_id": response_id, "reward": -1})).is_success
    async with scripted_judge(lambda kind, prompt: PRM_YES) as votes:
        settings = judge_for(
            redis_url,
            names,
            votes.url,
            workers={"key_prefix": f"{names.judge_prefix}-w"},
            audit={"stream": f"{names.audit}-w"},
            feedback={"combine": "weighted", "weight": 0.25},
        )
        await from_now(redis, settings)
        async with running(settings, serve=False):
            await chat(gateway, sid)  # the next state, for the PRM to judge the turn by
            sample = await sample_of(redis, settings.redis.samples_stream, turn_id)
            await close(gateway, sid)
    # 0.25 * -1 (explicit) + 0.75 * +1 (the PRM's majority of 3 votes)
    assert sample.reward == pytest.approx(0.5)
    assert sample.reward_source == "prm+feedback" and list(sample.votes) == [1, 1, 1]


async def test_a_comment_is_the_opd_hint(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names, engine_factory
) -> None:
    sid = session()
    hint = "Answer with the number only."
    response_id, turn_id = await chat(gateway, sid)
    assert (await feedback(gateway, {"response_id": response_id, "comment": hint})).is_success
    async with scripted_judge(lambda kind, prompt: "\\boxed{-1}") as votes:
        settings = judge_for(
            redis_url,
            names,
            votes.url,
            backend=openai_backend(votes.url, engine_url=engine_factory(TINY)),
            judging={"mode": "opd"},
            model={"path": TINY},
            workers={"key_prefix": f"{names.judge_prefix}-opd"},
        )
        await from_now(redis, settings)
        async with running(settings, serve=False):
            # Finalised with no next state: without the comment, opd would mask it.
            await close(gateway, sid)
            sample = await sample_of(redis, settings.redis.samples_stream, turn_id, 60)
        assert not votes.requests  # the comment is the hint: no hint votes
    assert sample.mode == SampleMode.SAMPLE_MODE_OPD and sample.hint == hint
    assert sample.has_teacher and len(sample.teacher_logprobs) == len(sample.response_ids) > 0
    assert sample.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED


async def test_late_feedback_is_audited_and_counted(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    sid = session()
    response_id, turn_id = await chat(gateway, sid)
    async with scripted_judge(lambda kind, prompt: PRM_YES) as votes:
        settings = judge_for(redis_url, names, votes.url)
        await from_now(redis, settings)
        async with running(settings, serve=False):
            await chat(gateway, sid)
            sample = await sample_of(redis, settings.redis.samples_stream, turn_id)
            await close(gateway, sid)
    assert sample.reward == 1.0 and sample.reward_source == "prm"
    before = gateway.metric("clawrl_gateway_feedback_total", outcome="late")
    body = {"response_id": response_id, "thumbs": "down", "comment": "Wrong."}
    reply = await feedback(gateway, body)
    assert reply.status_code == 200 and reply.json()["status"] == "late", reply.text
    again = await feedback(gateway, body)  # a retry: the same answer, audited once
    assert again.json() == reply.json()
    assert gateway.metric("clawrl_gateway_feedback_total", outcome="late") == before + 1
    published, late = await audits(redis, names.audit, turn_id)
    assert published[0] == "published"
    outcome, record = late
    assert outcome == "late_feedback" and record["turn_id"] == turn_id
    assert record["sample_entry"] and record["late_feedback"][0]["comment"] == "Wrong."
    entries = await stored(redis, names, turn_id)
    assert [k.decode()[:2] for k in entries] == ["l:"]  # kept, as late


async def test_feedback_arriving_while_the_turn_is_judged_is_audited_as_late(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    sid = session()
    response_id, turn_id = await chat(gateway, sid)
    plugins.started.clear()
    plugins.release.clear()
    settings = judge_for(
        redis_url,
        names,
        "http://127.0.0.1:9/v1",
        judging={"reward_fn": "tests.integration.feedback.plugins:held"},
        workers={"key_prefix": f"{names.judge_prefix}-held"},
        audit={"stream": f"{names.audit}-held"},
    )
    await from_now(redis, settings)
    async with running(settings, serve=False) as service:
        await close(gateway, sid)
        await asyncio.wait_for(plugins.started.wait(), 30)  # feedback already read: none
        reply = await feedback(gateway, {"response_id": response_id, "reward": -1})
        # The gateway of this test watches another judge's markers: accepted, to be merged.
        assert reply.json()["status"] == "accepted", reply.text
        plugins.release.set()
        sample = await sample_of(redis, settings.redis.samples_stream, turn_id)
        await asyncio.sleep(0.1)
        late = judge_metric(service, "late")
    assert sample.reward == 1.0  # the judgement it arrived during did not merge it ...
    assert late == 1  # ... so it was counted
    outcomes = dict(await audits(redis, settings.audit.stream, turn_id))
    assert outcomes["late_feedback"]["late_feedback"][0]["reward"] == -1
    entries = await stored(redis, names, turn_id)
    assert [k.decode()[:2] for k in entries] == ["l:"]


async def test_responses_and_messages_ids_are_ratable(gateway: GatewayHandle) -> None:
    """A turn made through /v1/responses or /v1/messages is rated by the id that API gave."""
    import anthropic

    openai = AsyncOpenAI(base_url=gateway.base_url, api_key=ALICE, max_retries=0)
    response = await openai.responses.create(
        model=TINY, input="What is 2+3?", max_output_tokens=4,
        extra_headers={"X-Session-Id": session()},
    )  # fmt: skip
    await openai.close()
    claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=BOB, max_retries=0)
    message = await claude.messages.create(
        model=TINY, max_tokens=4, messages=[{"role": "user", "content": "What is 2+3?"}],
        extra_headers={"X-Session-Id": session()},
    )  # fmt: skip
    await claude.close()
    for rated, key in ((response.id, ALICE), (message.id, BOB)):
        reply = await feedback(gateway, {"response_id": rated, "thumbs": "up"}, key=key)
        assert reply.status_code == 200 and reply.json()["status"] == "accepted", reply.text
    # x-api-key names the caller as Bearer does: Bob's message is not Alice's to rate.
    foreign = await feedback(gateway, {"response_id": message.id, "reward": 1}, key=None,
                             **{"x-api-key": ALICE})  # fmt: skip
    assert foreign.status_code == 404


async def test_another_callers_turn_is_not_found(gateway: GatewayHandle) -> None:
    sid = session()
    response_id, _ = await chat(gateway, sid, key=ALICE)
    foreign = await feedback(gateway, {"response_id": response_id, "reward": 1}, key=BOB)
    unknown = await feedback(gateway, {"response_id": "chatcmpl-nosuchid", "reward": 1}, key=BOB)
    assert foreign.status_code == unknown.status_code == 404
    error = foreign.json()["error"]
    assert error["code"] == unknown.json()["error"]["code"] == "turn_not_found"
    # The same words either way: nothing tells an existing id from a made-up one.
    assert error["message"].replace(response_id, "X") == unknown.json()["error"]["message"].replace(
        "chatcmpl-nosuchid", "X"
    )
    by_session = await feedback(gateway, {"session_id": sid, "reward": 1}, key=BOB)
    assert by_session.status_code == 404
    past_the_end = await feedback(gateway, {"session_id": sid, "turn_index": 5, "reward": 1})
    assert past_the_end.status_code == 404
    anonymous = await feedback(gateway, {"response_id": response_id, "reward": 1}, key=None)
    assert anonymous.status_code == 401
    # The owner still can.
    assert (await feedback(gateway, {"session_id": sid, "turn_index": 0, "reward": 1})).is_success


async def test_a_retried_post_is_stored_once(
    redis: Redis, gateway: GatewayHandle, names: Names
) -> None:
    response_id, turn_id = await chat(gateway, session())
    body = {"response_id": response_id, "reward": 0.25}
    first = await feedback(gateway, body, **{"Idempotency-Key": "rating-1"})
    retry = await feedback(gateway, body, **{"Idempotency-Key": "rating-1"})
    assert first.status_code == retry.status_code == 200
    assert first.json() == retry.json() and first.json()["id"] == "rating-1"
    reused = await feedback(gateway, {**body, "reward": 1}, **{"Idempotency-Key": "rating-1"})
    assert reused.status_code == 409 and reused.json()["error"]["param"] == "feedback_id"
    # No id: the content names it, so the same POST twice is one feedback too.
    plain = {"response_id": response_id, "thumbs": "up"}
    assert (await feedback(gateway, plain)).json() == (await feedback(gateway, plain)).json()
    entries = await stored(redis, names, turn_id)
    assert len(entries) == 2
    assert gateway.metric("clawrl_gateway_feedback_total", outcome="duplicate") >= 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        ({"response_id": "x", "reward": 2}, "reward must be a number between -1 and 1"),
        ({"response_id": "x", "reward": "good"}, "reward"),
        ({"response_id": "x", "thumbs": "sideways"}, "thumbs must be 'up' or 'down'"),
        ({"response_id": "x"}, "give at least one of 'reward'"),
        ({"response_id": "x", "session_id": "s", "reward": 1}, "exactly one of 'response_id'"),
        ({"reward": 1}, "exactly one of 'response_id'"),
        ({"response_id": "x", "rating": 5}, "rating"),
        ({"response_id": "x", "reward": -1, "thumbs": "up"}, "contradicts"),
    ],
)
async def test_bad_input_is_a_clear_400(gateway: GatewayHandle, body, message: str) -> None:
    reply = await feedback(gateway, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
