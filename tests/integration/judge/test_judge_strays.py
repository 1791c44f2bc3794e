"""Turns the judge read but never started are not lost to a hold: Redis failing between the
read and the start (here the dedupe lookup, as in a failover) leaves them pending on the worker,
which takes them back at its next sweep (seconds), not after claim_idle_ms (an hour here), and
not never, as when they stayed held."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from clawrl.judge.service import running

from .helpers import judge_settings, make_turn, pending, put_turns, said, wait_samples

pytestmark = pytest.mark.integration


async def test_turns_read_when_redis_failed_before_judging_are_judged_soon(
    redis: Redis, redis_url: str
) -> None:
    settings = judge_settings(
        redis_url,
        judging={"reward_fn": "tests.integration.judge.plugins:by_response"},
        workers={"claim_idle_ms": 3_600_000, "retry_initial_s": 0.1},
    )
    async with running(settings, serve=False) as service:
        [worker] = service.workers
        store, judged, failures = worker.store, worker.store.judged, []

        async def fails_once(turn_ids):  # the connection drops right after the read
            if not failures:
                failures.append(turn_ids)
                raise RedisConnectionError("Connection closed by server.")
            return await judged(turn_ids)

        store.judged = fails_once
        await put_turns(redis, settings, [make_turn("k", 0, response="+1", next_state=said("ok"))])
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=15)
        assert failures == [["k:0"]]
    assert (sample.sample_id, sample.reward) == ("k:0", 1.0)
    assert await pending(redis, settings) == 0
