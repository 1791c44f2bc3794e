"""Waiting for an episode's outcome on a real Redis: the judge's OutcomeWaiter against the
gateway's own store script (clawrl.gateway.outcomes.STORE). An outcome stored before or during
the wait is found; none in time expires the episode (every turn of it, atomically against the
gateway, whose outcome then is late and audited); the wait counts from the episode's latest
turn; an unreadable outcome fails the turn as malformed."""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.episodes import EpisodeSettings, Outcome, outcome_key
from clawrl.common.redis_client import Script
from clawrl.gateway.outcomes import STORE
from clawrl.judge.episodes import OutcomeWaiter
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.turns import MalformedTurn

pytestmark = pytest.mark.integration


def waiter(redis: Redis, timeout_s: float = 30.0) -> tuple[OutcomeWaiter, str]:
    prefix = f"t-{uuid.uuid4().hex[:8]}:outcome"
    settings = EpisodeSettings(outcome_timeout_s=timeout_s, poll_interval_s=0.05)
    return OutcomeWaiter(redis, prefix, settings, JudgeMetrics()), prefix


async def store(redis: Redis, prefix: str, state: str, outcome: Outcome, audit: str) -> str:
    """What POST /v1/outcomes does with an outcome: its status (accepted, late, duplicate-...)."""
    status, _ = await Script(redis, STORE)(
        keys=[outcome_key(prefix, state), audit],
        args=[outcome.to_json(), 3600, 1000, b'{"session_state":"' + state.encode() + b'"', state],
    )
    return status.decode()


async def test_an_outcome_before_or_during_the_wait_is_found(redis: Redis) -> None:
    outcomes, prefix = waiter(redis)
    runner = asyncio.create_task(outcomes.run(asyncio.Event()))
    try:
        assert await store(redis, prefix, "s1:e", Outcome(1.0, "t"), "audit") == "accepted"
        early = await asyncio.wait_for(outcomes.wait("s1:e"), 5)
        assert early.outcome == Outcome(1.0, "t")
        later = asyncio.create_task(outcomes.wait("s2:e"))
        second = asyncio.create_task(outcomes.wait("s2:e"))  # another turn of the episode
        await asyncio.sleep(0.3)
        assert not later.done()
        assert await store(redis, prefix, "s2:e", Outcome(0.0, "", "no file"), "audit") == (
            "accepted"
        )
        for turn in (later, second):
            got = await asyncio.wait_for(turn, 5)
            assert got.outcome.content() == (0.0, "", "no file") and got.waited_s >= 0.3
    finally:
        runner.cancel()
    assert outcomes.metrics.outcome_waiting._value.get() == 0


async def test_no_outcome_in_time_expires_the_episode_and_a_later_one_is_late(
    redis: Redis,
) -> None:
    outcomes, prefix = waiter(redis, timeout_s=0.5)
    audit = f"{prefix}:audit"
    runner = asyncio.create_task(outcomes.run(asyncio.Event()))
    try:
        got = await asyncio.wait_for(outcomes.wait("s3:e"), 10)
        assert got.outcome is None and got.waited_s >= 0.5
        # A turn of the same episode that comes later finds it expired at once.
        again = await asyncio.wait_for(outcomes.wait("s3:e"), 2)
        assert again.outcome is None and again.waited_s < 0.5
    finally:
        runner.cancel()
    state = await redis.hget(outcome_key(prefix, "s3:e"), "state")
    assert state == b"expired"
    late = Outcome(1.0, "t", "passed")
    assert await store(redis, prefix, "s3:e", late, audit) == "late"
    assert await store(redis, prefix, "s3:e", late, audit) == "duplicate-late"  # audited once
    ((_, fields),) = await redis.xrange(audit)
    assert fields[b"id"] == b"s3:e" and fields[b"outcome"] == b"late_outcome"
    record = orjson.loads(fields[b"data"])
    assert record["session_state"] == "s3:e" and record["late_outcome"]["outcome"] == 1.0


async def test_the_wait_counts_from_the_episodes_latest_turn(redis: Redis) -> None:
    outcomes, _ = waiter(redis, timeout_s=1.0)
    runner = asyncio.create_task(outcomes.run(asyncio.Event()))
    try:
        started = time.monotonic()
        first = asyncio.create_task(outcomes.wait("s4:e"))
        await asyncio.sleep(0.6)
        second = asyncio.create_task(outcomes.wait("s4:e"))  # the episode made another turn
        got = await asyncio.wait_for(first, 10)
        assert got.outcome is None
        # Expired 1 s after the second turn began waiting, not 1 s after the first.
        assert time.monotonic() - started >= 1.5
        assert (await asyncio.wait_for(second, 2)).outcome is None
    finally:
        runner.cancel()


async def test_an_unreadable_outcome_fails_the_turn_as_malformed(redis: Redis) -> None:
    outcomes, prefix = waiter(redis)
    await redis.hset(outcome_key(prefix, "s5:e"), "state", b'{"task_id": "no outcome field"}')
    runner = asyncio.create_task(outcomes.run(asyncio.Event()))
    try:
        with pytest.raises(MalformedTurn, match="the episode's outcome is unreadable"):
            await asyncio.wait_for(outcomes.wait("s5:e"), 5)
    finally:
        runner.cancel()
