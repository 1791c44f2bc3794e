"""The judge workers on a real Redis with reward plug-ins (no engine): samples flow from
clawrl:turns to clawrl:samples exactly as the contract says, redeliveries are not trained
twice, malformed turns are dead-lettered with the reason, the session rule holds, and the
export holds every judgement."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import MaskReason, SampleMode
from clawrl.common.records import encode_entry
from clawrl.judge.audit import export
from clawrl.judge.service import running

from .helpers import (
    consumed,
    eventually,
    judge_settings,
    make_turn,
    pending,
    put_turns,
    said,
    samples,
    wait_samples,
)

pytestmark = pytest.mark.integration

ENDS_WITH = "clawrl.judge.reward_examples:ends_with_word"
ARITHMETIC = "clawrl.judge.reward_examples:arithmetic_confirmed"
BANANA = {"reward_fn": ENDS_WITH, "reward_fn_args": {"word": "banana"}}


@pytest.fixture
def url(redis_url: str) -> str:
    return redis_url


async def test_rl_reward_fn_samples_are_exact_copies_of_their_turns(redis: Redis, url) -> None:
    settings = judge_settings(url, judging={"mode": "rl", **BANANA})
    turns = [
        make_turn(
            "s1", 0, response="I like banana", next_state=[{"role": "user", "content": "ok"}]
        ),
        make_turn("s1", 1, response="Apples.", next_state=[{"role": "user", "content": "hm"}]),
        make_turn("s1", 2, response="BANANA!"),  # no next state: a reward_fn still judges it
        make_turn("s1", 3, response="", response_ids=[]),
    ]
    turns[0].tenant = "alice"  # the others have none ("")
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = await wait_samples(redis, settings, 4)
        await asyncio.sleep(0.2)
        assert await pending(redis, settings) == 0
    by_id = {s.sample_id: s for s in found}
    assert sorted(by_id) == ["s1:0", "s1:1", "s1:2", "s1:3"]
    for turn in turns:
        sample = by_id[turn.turn_id]
        assert sample.session_id == turn.session_id and sample.turn_index == turn.turn_index
        assert list(sample.prompt_ids) == list(turn.prompt_ids)
        assert list(sample.response_ids) == list(turn.response_ids)
        assert list(sample.old_logprobs) == list(turn.response_logprobs)
        assert sample.policy_version == 3 and sample.weight_version == "3"
        assert sample.temperature == pytest.approx(0.7) and sample.top_p == pytest.approx(0.9)
        assert sample.model == "smollm2-tiny" and sample.tenant == turn.tenant
        assert sample.mode == SampleMode.SAMPLE_MODE_BINARY_RL
        assert sample.turn_finalized_at == turn.finalized_at
        assert sample.created_at.seconds > 0
        assert not sample.has_teacher and not sample.teacher_logprobs
    assert [by_id[f"s1:{i}"].reward for i in range(3)] == [1.0, -1.0, 1.0]
    for i in range(3):
        assert list(by_id[f"s1:{i}"].loss_mask) == [1.0, 1.0, 1.0]
        assert by_id[f"s1:{i}"].mask_reason == MaskReason.MASK_REASON_UNSPECIFIED
        assert by_id[f"s1:{i}"].reward_source == f"reward_fn:{ENDS_WITH}"
    assert by_id["s1:3"].mask_reason == MaskReason.MASK_REASON_EMPTY_RESPONSE


async def test_a_turn_generated_across_a_weight_sync_is_masked_as_mixed(redis: Redis, url) -> None:
    """The gateway records the version it admitted the request under; a sync that retracted
    the generation makes it older than the engine's version at the end: masked, not trained.
    Equal versions, or a record without the field (an older gateway), are trained."""
    settings = judge_settings(url, judging={"mode": "rl", **BANANA})
    reply = [{"role": "user", "content": "ok"}]
    turns = [make_turn("m", i, response="I like banana", next_state=reply) for i in range(3)]
    turns[0].admitted_policy_version = 2  # policy_version is 3: tokens of v2 and v3
    turns[1].admitted_policy_version = 3
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = {s.sample_id: s for s in await wait_samples(redis, settings, 3)}
    assert found["m:0"].mask_reason == MaskReason.MASK_REASON_MIXED_POLICY
    assert list(found["m:0"].loss_mask) == [0.0, 0.0, 0.0]
    for trained in ("m:1", "m:2"):
        assert found[trained].mask_reason == MaskReason.MASK_REASON_UNSPECIFIED
        assert list(found[trained].loss_mask) == [1.0, 1.0, 1.0]


async def test_a_turn_of_unknown_weights_is_masked(redis: Redis, url) -> None:
    """A turn the gateway marked unknown_weights (the engine reported weights of no known
    version, e.g. restarted on its base model) is never trained as a version."""
    settings = judge_settings(url, judging={"mode": "rl", **BANANA})
    reply = [{"role": "user", "content": "ok"}]
    turns = [make_turn("u", i, response="I like banana", next_state=reply) for i in range(2)]
    turns[0].unknown_weights = True
    turns[0].weight_version = "default"
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = {s.sample_id: s for s in await wait_samples(redis, settings, 2)}
    assert found["u:0"].mask_reason == MaskReason.MASK_REASON_UNKNOWN_VERSION
    assert list(found["u:0"].loss_mask) == [0.0, 0.0, 0.0]
    assert found["u:1"].mask_reason == MaskReason.MASK_REASON_UNSPECIFIED


async def test_redelivered_turn_yields_no_second_sample(redis: Redis, url) -> None:
    settings = judge_settings(
        url, judging={"reward_fn": ENDS_WITH, "reward_fn_args": {"word": "x"}}
    )
    turn = make_turn("dup", 0, next_state=[{"role": "user", "content": "thanks"}])
    await put_turns(redis, settings, [turn])
    async with running(settings, serve=False):
        assert len(await wait_samples(redis, settings, 1)) == 1
        # The same turn again (a gateway retry, or a redelivery after a crash).
        await put_turns(redis, settings, [turn, turn])
        # Both read and acknowledged: a sample is committed with its ack, so none can follow.
        assert await eventually(consumed(redis, settings))
    assert [s.sample_id for s in await samples(redis, settings)] == ["dup:0"]


async def test_malformed_turns_are_dead_lettered_with_their_reason(redis: Redis, url) -> None:
    settings = judge_settings(
        url, judging={"reward_fn": ENDS_WITH, "reward_fn_args": {"word": "x"}}
    )
    stream = settings.redis.turns_stream
    await redis.xadd(stream, {"id": "junk:0", "type": "clawrl.v1.Turn", "data": b"\xff\xff\xff"})
    await redis.xadd(stream, {"id": "odd:0", "type": "clawrl.v1.Sample", "data": b""})
    bad = make_turn("bad", 0, next_state=[{"role": "user", "content": "x"}])
    del bad.response_logprobs[-1]
    broken_state = make_turn("bad", 1)
    broken_state.next_state_messages_json.append("{not json")
    for turn in (bad, broken_state):
        await redis.xadd(stream, encode_entry(turn))
    good = make_turn("good", 0, response="banana")
    await put_turns(redis, settings, [good])
    async with running(settings, serve=False):
        assert [s.sample_id for s in await wait_samples(redis, settings, 1)] == ["good:0"]
        assert await eventually(consumed(redis, settings))
    dead = await redis.xrange(settings.redis.deadletter_stream)
    reasons = {f[b"id"].decode(): f[b"reason"].decode() for _, f in dead}
    assert set(reasons) == {"junk:0", "odd:0", "bad:0", "bad:1"}
    assert "undecodable" in reasons["junk:0"]
    assert "expected a clawrl.v1.Turn" in reasons["odd:0"]
    assert "3 response ids but 2 log-probs" in reasons["bad:0"]
    assert "not valid JSON" in reasons["bad:1"]
    assert all(f[b"source_stream"].decode() == stream for _, f in dead)


async def test_legacy_next_state_and_the_arithmetic_reward(redis: Redis, url) -> None:
    settings = judge_settings(url, judging={"reward_fn": ARITHMETIC})
    turns = [
        make_turn("a", 0, response="2+3 = 5", next_state=[{"role": "user", "content": "Yes, 5."}]),
        make_turn(
            "a",
            1,
            response="It is 6",
            next_state=[{"role": "user", "content": "No: 5"}],
            legacy_next_state=True,
        ),
    ]
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = {s.sample_id: s for s in await wait_samples(redis, settings, 2)}
        # No number in the reply: the plug-in cannot tell -> neutral; the session already
        # has effective samples, so it is not promoted.
        late = make_turn("a", 2, response="Five", next_state=[{"role": "user", "content": "5"}])
        await put_turns(redis, settings, [late])
        found = {s.sample_id: s for s in await wait_samples(redis, settings, 3)}
    assert found["a:0"].reward == 1.0 and found["a:1"].reward == -1.0
    assert found["a:2"].reward == 0.0
    assert found["a:2"].mask_reason == MaskReason.MASK_REASON_NEUTRAL_SCORE
    assert not found["a:2"].promoted and set(found["a:2"].loss_mask) == {0.0}


async def test_first_neutral_turn_of_a_session_without_signal_is_promoted(
    redis: Redis, url
) -> None:
    settings = judge_settings(url, judging={"reward_fn": ARITHMETIC}, workers={"workers": 2})
    # Session p: three neutral turns with a next state -> exactly one is promoted.
    # Session q: neutral turns without a next state are never promoted.
    turns = [
        make_turn("p", i, response="no number", next_state=[{"role": "user", "content": "5"}])
        for i in range(3)
    ] + [make_turn("q", i, response="no number") for i in range(2)]
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = {s.sample_id: s for s in await wait_samples(redis, settings, 5)}
    promoted = [s for s in found.values() if s.promoted]
    assert [s.session_id for s in promoted] == ["p"]
    assert list(promoted[0].loss_mask) == [1.0, 1.0, 1.0] and promoted[0].reward == 0.0
    assert promoted[0].mask_reason == MaskReason.MASK_REASON_UNSPECIFIED
    others = [s for s in found.values() if not s.promoted]
    assert len(others) == 4 and all(set(s.loss_mask) == {0.0} for s in others)
    assert {s.mask_reason for s in others if s.session_id == "q"} == {
        MaskReason.MASK_REASON_NO_NEXT_STATE
    }


async def test_two_callers_sharing_a_session_id_are_promoted_apart(redis: Redis, url) -> None:
    """Sessions are scoped per caller: two API keys that both send `X-Session-Id: main` hold two
    session states (two epochs in their turn ids). One caller's turn must not use up the other's
    promotion, as it did when the judge keyed it on the shared client session id."""
    settings = judge_settings(url, judging={"reward_fn": ARITHMETIC})
    turns = []
    for epoch in ("e1", "e2"):
        turn = make_turn(
            "main", 0, response="no number", next_state=[{"role": "user", "content": "5"}]
        )
        turn.turn_id = f"main:{epoch}:0"
        turns.append(turn)
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False):
        found = await wait_samples(redis, settings, 2)
    assert sorted(s.sample_id for s in found if s.promoted) == ["main:e1:0", "main:e2:0"]


async def test_promotion_can_be_switched_off(redis: Redis, url) -> None:
    settings = judge_settings(
        url, judging={"reward_fn": ARITHMETIC, "promote_first_in_session": False}
    )
    turn = make_turn("off", 0, response="none", next_state=[{"role": "user", "content": "5"}])
    await put_turns(redis, settings, [turn])
    async with running(settings, serve=False):
        (sample,) = await wait_samples(redis, settings, 1)
    assert not sample.promoted and sample.mask_reason == MaskReason.MASK_REASON_NEUTRAL_SCORE


async def test_export_holds_every_judgement(redis: Redis, url, tmp_path) -> None:
    settings = judge_settings(url, judging={"reward_fn": ARITHMETIC})
    turns = [
        make_turn("e", 0, response="5", next_state=[{"role": "user", "content": "right, 5"}]),
        make_turn("f", 0, response="no idea", next_state=said("7")),
    ]
    bad = make_turn("e", 2)
    bad.messages_json = "[broken"
    await put_turns(redis, settings, turns)
    await redis.xadd(settings.redis.turns_stream, encode_entry(bad))
    async with running(settings, serve=False):
        await wait_samples(redis, settings, 2)

        async def audited() -> bool:  # the dead-lettered turn's record comes after its ack
            return await redis.xlen(settings.audit.stream) >= 3

        assert await eventually(audited)
    out = io.BytesIO()
    assert await export(redis, settings.audit.stream, out) == 3
    records = {r["turn_id"]: r for r in map(orjson.loads, out.getvalue().splitlines())}
    assert records["e:0"]["outcome"] == "published" and records["e:0"]["score"] == 1.0
    assert records["e:0"]["response"] == "5"
    assert records["e:0"]["next_state"] == [{"role": "user", "content": "right, 5"}]
    assert records["e:0"]["reward_source"] == f"reward_fn:{ARITHMETIC}"
    assert records["f:0"]["outcome"] == "promoted" and records["f:0"]["promoted"] is True
    assert records["e:2"]["outcome"] == "dead_letter"
    assert "messages_json" in records["e:2"]["dead_letter"]
    # The same through the command line.
    target = tmp_path / "judgements.jsonl"
    cli = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "clawrl.judge.main", "export", "-o", str(target),
         "--redis-url", url],
        env={**os.environ, "CLAWRL_AUDIT__STREAM": settings.audit.stream},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "exported 3 judgements" in cli.stderr
    assert target.read_bytes() == out.getvalue()


async def test_retention_trims_only_what_every_group_acknowledged(redis: Redis, url) -> None:
    settings = judge_settings(url, judging=BANANA, retention={"interval_s": 0.1, "keep_s": 0})
    stream = settings.redis.turns_stream
    await put_turns(redis, settings, [make_turn(f"r{i}", 0) for i in range(150)])
    # Another consumer group that has read nothing: its entries must stay.
    await redis.xgroup_create(stream, "auditors", id="0")
    async with running(settings, serve=False):
        await wait_samples(redis, settings, 150)
        await asyncio.sleep(0.5)
        assert await redis.xlen(stream) == 150
        await redis.xgroup_destroy(stream, "auditors")
        for _ in range(50):
            if await redis.xlen(stream) < 150:
                break
            await asyncio.sleep(0.1)
    # Approximate trimming drops whole stream nodes (100 entries by default).
    assert await redis.xlen(stream) <= 50
    # Samples no group has read yet are kept; once the trainers acknowledged them they go.
    assert len(await samples(redis, settings)) == 150
    sstream = settings.redis.samples_stream
    await redis.xgroup_create(sstream, "trainers", id="0")
    read = await redis.xreadgroup("trainers", "t1", {sstream: ">"}, count=1000)
    await redis.xack(sstream, "trainers", *[eid for eid, _ in read[0][1]])
    async with running(settings, serve=False):
        for _ in range(50):
            if await redis.xlen(sstream) < 150:
                break
            await asyncio.sleep(0.1)
    assert await redis.xlen(sstream) <= 50
