"""Episode outcomes end to end: an agent's episode played with the official openai client
through a real gateway (CPU engine, smollm2-tiny) with X-Episode: true, its outcome POSTed to
/v1/outcomes with httpx, and the real judge (in this process, PRM votes from a scripted judge
API) merging it into each turn's sample by OpenClaw-RL's formula (2 * outcome - 1) +
prm_step_coef * PRM score. Turns wait for the outcome (a chat turn beside them does not); an
episode with no outcome in time is masked and counted, and its outcome posted afterwards is
late (audited); another caller cannot post a session's outcome; a second, different outcome is
refused; bad input gets a clear 400."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import orjson
import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import MaskReason
from clawrl.common.records import Sample
from clawrl.judge.service import running
from tests.integration.feedback.test_feedback import (
    audits,
    close,
    from_now,
    judge_for,
    sample_of,
)
from tests.integration.gateway.helpers import GatewayHandle
from tests.integration.judge.scripted_judge import scripted_judge

from .conftest import ALICE, BOB, TINY, Names

pytestmark = pytest.mark.integration

TASK = [{"role": "user", "content": "Create notes.txt, then show what is in it."}]
# What the sandbox said after each turn: the next states. The PRM votes -1 after ENOENT.
OBSERVATIONS = ["$ touch notes.txt\n(exit 0)", "cat: nope.txt: ENOENT, no such file"]


def prm(kind: str, prompt: str) -> str:
    return "It failed. \\boxed{-1}" if "ENOENT" in prompt else "It worked. \\boxed{1}"


async def play(gateway: GatewayHandle, session: str, turns: int, key: str = ALICE) -> list[str]:
    """`turns` main turns of one episode, each observation the next request's last message, as
    an agent runner makes them: the turn ids, the last one still pending."""
    client = AsyncOpenAI(
        base_url=gateway.base_url, api_key=key, max_retries=0, timeout=60,
        default_headers={"X-Session-Id": session, "X-Episode": "true"},
    )  # fmt: skip
    messages, ids = list(TASK), []
    for i in range(turns):
        raw = await client.chat.completions.with_raw_response.create(
            model=TINY, messages=messages, max_tokens=4
        )
        reply = raw.parse().choices[0].message.content
        ids.append(raw.headers["x-turn-id"])
        messages += [{"role": "assistant", "content": reply}]
        if i < turns - 1:
            messages += [{"role": "user", "content": OBSERVATIONS[i]}]
    await client.close()
    return ids


async def post_outcome(
    gateway: GatewayHandle, body: object, key: str | None = ALICE
) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{gateway.base_url}/outcomes", content=content, headers=headers)


def episode() -> str:
    return f"ep-{uuid.uuid4().hex[:10]}"


async def not_published(redis: Redis, stream: str, turn_id: str) -> bool:
    try:
        await sample_of(redis, stream, turn_id, timeout_s=1.0)
    except AssertionError:
        return True
    return False


async def test_an_episodes_turns_carry_the_outcome_and_their_prm_scores(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    won, lost, chat = episode(), episode(), episode()
    async with scripted_judge(prm) as votes:
        settings = judge_for(
            redis_url, names, votes.url,
            workers={"key_prefix": f"{names.judge_prefix}-ep"},
            episodes={"prm_step_coef": 0.5, "poll_interval_s": 0.1},
        )  # fmt: skip
        samples = settings.redis.samples_stream
        await from_now(redis, settings)
        async with running(settings, serve=False) as service:
            won_ids = await play(gateway, won, 3)
            lost_ids = await play(gateway, lost, 3)
            # A chat session beside them: its turn is judged at once, as before.
            chat_ids = await play_chat(gateway, chat)
            chat_sample = await sample_of(redis, samples, chat_ids[0])
            # The episodes' finalised turns wait for their outcome.
            assert await not_published(redis, samples, won_ids[0])
            reply = await post_outcome(gateway, {"session_id": won, "outcome": 1,
                                                 "task_id": "notes", "detail": "3/3"})  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert reply.json() == {
                "object": "episode.outcome", "session_id": won, "status": "accepted",
                "outcome": 1.0, "task_id": "notes", "turns": 3,
                "created": reply.json()["created"],
            }  # fmt: skip
            won_samples = [await sample_of(redis, samples, t) for t in won_ids]
            assert (await post_outcome(gateway, {"session_id": lost, "outcome": 0})).is_success
            lost_samples = [await sample_of(redis, samples, t) for t in lost_ids]
            merged = service.metrics.episode_turns.labels("merged")._value.get()
    # PRM: +1 after the first observation, -1 after the error; the last turn has no next state
    # (the outcome closed the session), so no PRM score: 0.  coef 0.5:
    assert [s.reward for s in won_samples] == [1.0 + 0.5, 1.0 - 0.5, 1.0]
    assert [s.reward for s in lost_samples] == [-1.0 + 0.5, -1.0 - 0.5, -1.0]
    for s in [*won_samples, *lost_samples]:
        assert s.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED and set(s.loss_mask) == {1}
    assert [s.step_score for s in won_samples] == [1.0, -1.0, 0.0]
    assert [s.outcome for s in won_samples] == [1.0] * 3
    assert [s.task_id for s in won_samples] == ["notes"] * 3
    assert [s.reward_source for s in won_samples] == ["outcome+prm", "outcome+prm", "outcome"]
    assert [s.turn_index for s in won_samples] == [0, 1, 2]
    assert merged == 6
    # The chat turn: its PRM score alone, no outcome.
    assert chat_sample.reward == 1.0 and not chat_sample.HasField("outcome")
    assert gateway.metric("clawrl_gateway_outcomes_total", result="accepted") >= 2


async def play_chat(gateway: GatewayHandle, session: str) -> list[str]:
    """Two turns of a chat session (no X-Episode): the first is finalised by the second."""
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=ALICE, max_retries=0, timeout=60,
                         default_headers={"X-Session-Id": session})  # fmt: skip
    messages, ids = list(TASK), []
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model=TINY, messages=messages, max_tokens=4
        )
        ids.append(raw.headers["x-turn-id"])
        reply = raw.parse().choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    await client.close()
    return ids


async def test_a_missing_outcome_masks_the_episode_and_a_late_one_is_audited(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    sid = episode()
    async with scripted_judge(prm) as votes:
        settings = judge_for(
            redis_url, names, votes.url,
            workers={"key_prefix": f"{names.judge_prefix}-miss"},
            audit={"stream": f"{names.audit}-miss"},
            episodes={"outcome_timeout_s": 1.0, "poll_interval_s": 0.1},
        )  # fmt: skip
        await from_now(redis, settings)
        async with running(settings, serve=False) as service:
            ids = await play(gateway, sid, 2)
            await close(gateway, sid)  # the runner died: the session ends, no outcome comes
            masked: list[Sample] = [
                await sample_of(redis, settings.redis.samples_stream, t, 30) for t in ids
            ]
            expired = service.metrics.episode_turns.labels("no_outcome")._value.get()
        assert not votes.requests  # no PRM vote is spent on turns that cannot train
    for s in masked:
        assert s.mask_reason == MaskReason.MASK_REASON_NO_OUTCOME and set(s.loss_mask) == {0}
        assert s.reward == 0.0 and not s.HasField("outcome")
    assert expired == 2
    ((outcome, record),) = await audits(redis, settings.audit.stream, ids[0])
    assert outcome == "published" and record["episode"]["expired"] is True
    assert record["mask_reason"] == "MASK_REASON_NO_OUTCOME"
    # The outcome the runner posts afterwards is late: kept, audited, never merged.
    before = gateway.metric("clawrl_gateway_outcomes_total", result="late")
    body = {"session_id": sid, "outcome": 1}
    reply = await post_outcome(gateway, body)
    assert reply.status_code == 200 and reply.json()["status"] == "late", reply.text
    assert (await post_outcome(gateway, body)).json() == reply.json()  # a retry: audited once
    assert gateway.metric("clawrl_gateway_outcomes_total", result="late") == before + 1
    late = [r for o, r in await audits(redis, names.audit, f"{sid}:{ids[0].split(':')[1]}")]
    assert [r["late_outcome"]["outcome"] for r in late] == [1.0]


async def test_only_the_sessions_caller_may_post_its_outcome(gateway: GatewayHandle) -> None:
    sid = episode()
    await play(gateway, sid, 1, key=ALICE)
    foreign = await post_outcome(gateway, {"session_id": sid, "outcome": 1}, key=BOB)
    unknown = await post_outcome(gateway, {"session_id": episode(), "outcome": 1}, key=BOB)
    assert foreign.status_code == unknown.status_code == 404
    error = foreign.json()["error"]
    assert error["code"] == unknown.json()["error"]["code"] == "session_not_found"
    assert error["type"] == "invalid_request_error"
    anonymous = await post_outcome(gateway, {"session_id": sid, "outcome": 1}, key=None)
    assert anonymous.status_code == 401
    # The owner still can, once; another outcome for the same episode is refused.
    first = await post_outcome(gateway, {"session_id": sid, "outcome": 0.5})
    assert first.status_code == 200 and first.json()["status"] == "accepted", first.text
    assert (await post_outcome(gateway, {"session_id": sid, "outcome": 0.5})).json() == first.json()
    other = await post_outcome(gateway, {"session_id": sid, "outcome": 1})
    assert other.status_code == 409 and other.json()["error"]["code"] == "outcome_already_set"


async def test_a_chat_session_is_no_episode(gateway: GatewayHandle) -> None:
    sid = episode()
    await play_chat(gateway, sid)
    reply = await post_outcome(gateway, {"session_id": sid, "outcome": 1})
    assert reply.status_code == 409, reply.text
    error = reply.json()["error"]
    assert error["code"] == "not_an_episode" and "X-Episode: true" in error["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        ({"session_id": "s", "outcome": 2}, "outcome must be a number between 0 and 1"),
        ({"session_id": "s", "outcome": "success"}, "outcome must be a number between 0 and 1"),
        ({"session_id": "s"}, "'outcome' is a required property"),
        ({"outcome": 1}, "name the episode's session"),
        ({"session_id": "s", "outcome": 1, "score": 1}, "score"),
    ],
)
async def test_bad_input_is_a_clear_400(gateway: GatewayHandle, body, message: str) -> None:
    reply = await post_outcome(gateway, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error


async def test_episodes_wait_without_taking_the_judges_concurrency(
    redis: Redis, redis_url: str, gateway: GatewayHandle, names: Names
) -> None:
    """With workers.concurrency 1, two episodes waiting for their outcomes do not stop a chat
    turn from being judged."""
    waiting = [episode(), episode()]
    async with scripted_judge(prm) as votes:
        settings = judge_for(
            redis_url, names, votes.url,
            workers={"key_prefix": f"{names.judge_prefix}-conc", "concurrency": 1},
            episodes={"poll_interval_s": 0.1},
        )  # fmt: skip
        await from_now(redis, settings)
        async with running(settings, serve=False) as service:
            for sid in waiting:
                await play(gateway, sid, 2)
            chat_ids = await play_chat(gateway, episode())
            sample = await sample_of(redis, settings.redis.samples_stream, chat_ids[0], 30)
            assert sample.reward == 1.0
            await asyncio.sleep(0.2)
            assert service.metrics.outcome_waiting._value.get() == 2
            for sid in waiting:
                assert (await post_outcome(gateway, {"session_id": sid, "outcome": 1})).is_success
