"""A worker's loop against errors it does not expect. A Redis Cluster client rebuilding its slot
map after a failover raises RedisClusterException, which is no RedisError: the worker's loop
died on it and its shard went unread while the judge looked healthy (71 of 237 turns never
judged in one failover run). Now it is retried like any Redis outage; and a worker that dies of
anything else stops the judge (counted, logged, exit code 1) so that it is restarted."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from clawrl.common.streams import GroupConsumer
from clawrl.judge.service import running

from .helpers import judge_settings, make_turn, put_turns, said, wait_samples

pytestmark = pytest.mark.integration

BY_RESPONSE = {"reward_fn": "tests.integration.judge.plugins:by_response"}


async def test_a_cluster_rebuilding_its_slot_map_is_waited_out(
    redis: Redis, redis_url: str
) -> None:
    settings = judge_settings(redis_url, judging=BY_RESPONSE, workers={"retry_initial_s": 0.1})
    async with running(settings, serve=False) as service:
        [worker] = service.workers
        read, failures = worker.consumer.read, []

        async def uncovered_once(count, block_ms=1000):
            if not failures:
                failures.append(count)
                raise SlotNotCoveredError("All slots are not covered after query all nodes.")
            return await read(count, block_ms)

        worker.consumer.read = uncovered_once
        await put_turns(redis, settings, [make_turn("k", 0, response="+1", next_state=said("ok"))])
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=15)
        assert len(failures) == 1 and not service.stop.is_set() and service.failed is None
        assert service.metrics.errors.labels("redis")._value.get() == 1
    assert sample.sample_id == "k:0"


async def test_a_worker_dying_of_an_unexpected_error_stops_the_judge(
    redis: Redis, redis_url: str
) -> None:
    settings = judge_settings(redis_url, judging=BY_RESPONSE)
    async with running(settings, serve=False) as service:
        [worker] = service.workers

        async def broken(count, block_ms=1000):
            raise ValueError("a bug in the read path")

        worker.consumer.read = broken
        await asyncio.wait_for(service.stop.wait(), 10)
        assert isinstance(service.failed, ValueError)
        assert service.metrics.errors.labels("worker")._value.get() == 1


async def test_a_group_that_cannot_be_created_at_start_is_retried(
    redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the cluster client's first connection timed out in XGROUP CREATE, at the
    worker's start: that killed the worker (now: the judge). It is an outage like any other."""
    settings = judge_settings(redis_url, judging=BY_RESPONSE, workers={"retry_initial_s": 0.1})
    await put_turns(redis, settings, [make_turn("k", 0, response="+1", next_state=said("ok"))])
    create, failures = GroupConsumer.ensure_group, []

    async def unreachable_once(consumer):
        if not failures:
            failures.append(consumer.consumer)
            raise RedisClusterException("Redis Cluster cannot be connected: Timeout connecting")
        return await create(consumer)

    monkeypatch.setattr(GroupConsumer, "ensure_group", unreachable_once)
    async with running(settings, serve=False) as service:
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=15)
        assert len(failures) == 1 and service.failed is None
    assert sample.sample_id == "k:0"
