"""Redelivery bounds on a real Redis: a turn that always fails is dead-lettered after
`max_deliveries`, whatever its stream id (ids are ordered as numbers, not strings)."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from clawrl.common.records import encode_entry
from clawrl.judge.service import running

from .helpers import judge_settings, make_turn, pending

pytestmark = pytest.mark.integration


async def test_turns_that_always_fail_are_dead_lettered_past_id_1_9(
    redis: Redis, redis_url: str
) -> None:
    settings = judge_settings(
        redis_url,
        judging={"reward_fn": "tests.integration.judge.plugins:fails"},
        workers={"max_deliveries": 2, "claim_idle_ms": 100},
    )
    # Twelve ids in one millisecond: 1-10 and 1-11 sort before 1-9 as strings.
    for i in range(12):
        entry = encode_entry(make_turn(f"poison{i}", 0))
        await redis.xadd(settings.redis.turns_stream, entry, id=f"1-{i}")
    async with running(settings, serve=False) as service:
        for _ in range(200):
            if await redis.xlen(settings.redis.deadletter_stream) == 12:
                break
            await asyncio.sleep(0.05)
        failed = service.metrics.turns.labels("failed")._value.get()
    dead = await redis.xrange(settings.redis.deadletter_stream)
    assert {f[b"source_entry"].decode() for _, f in dead} == {f"1-{i}" for i in range(12)}
    assert all(b"plug-in bug" in fields[b"reason"] for _, fields in dead)
    assert failed == 12  # each failed once, then was dead-lettered on its second delivery
    assert await pending(redis, settings) == 0
