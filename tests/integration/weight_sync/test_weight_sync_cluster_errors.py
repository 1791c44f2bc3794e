"""A Redis Cluster client rebuilding its slot map after a failover (no reachable node, slots
not covered) raises RedisClusterException, which is no RedisError. The weight-sync side treats
it as Redis away a moment, as it treats a RedisError: the launcher's adapter reconciliation
counts the failed pass and tries again (before, its loop died and engines that restarted were
never given their adapters back), a sync keeps renewing its lock, and recording the served
version logs instead of failing a sync whose engines already load the new weights."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import RedisClusterException

from clawrl.common.served import read_served
from clawrl.trainer.weight_sync.job import keep_lock
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.reconcile import reconcile_forever
from clawrl.trainer.weight_sync.replicas import record_served
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

pytestmark = pytest.mark.integration

SLOTS_MOVING = RedisClusterException("All slots are not covered after query all startup_nodes.")


def failing(method, times: int):
    """`method`, raising SLOTS_MOVING on its first `times` calls; the calls it saw."""
    calls = []

    async def call(*args, **kwargs):
        calls.append(args)
        if len(calls) <= times:
            raise SLOTS_MOVING
        return await method(*args, **kwargs)

    return call, calls


async def until(condition) -> None:
    """Wait (up to 20 s: a loaded host) for `condition()`."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.02)


async def test_the_adapter_reconciliation_outlives_a_slot_map_rebuild(redis_url: str) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = WeightSyncSettings(
        redis={"url": redis_url},
        sync={"lock_key": f"test:{tag}:lock", "served_key": f"test:{tag}:serving"},
        launcher={"reconcile_interval_s": 0.02},
    )
    metrics = WeightSyncMetrics()
    async with Redis.from_url(redis_url) as redis:
        redis.exists, calls = failing(redis.exists, times=2)
        task = asyncio.create_task(reconcile_forever(settings, redis, metrics))
        try:
            await until(lambda: len(calls) >= 4 or task.done())  # 2 failed passes, 2 empty
            assert not task.done(), task.exception()
            assert len(calls) >= 4
        finally:
            task.cancel()
    failed = metrics.adapter_reloads.labels(outcome="failed")._value.get()
    assert failed == 2


async def test_a_sync_keeps_renewing_its_lock_through_a_slot_map_rebuild(redis_url: str) -> None:
    async with Redis.from_url(redis_url) as redis:
        lock = Lock(redis, f"test:{uuid.uuid4().hex[:8]}:lock", timeout=30)
        assert await lock.acquire(blocking=False)
        lock.extend, calls = failing(lock.extend, times=1)
        task = asyncio.create_task(keep_lock(lock, ttl_s=1.5))  # renews every 0.5 s
        try:
            await until(lambda: len(calls) >= 3 or task.done())  # a failed renewal, 2 renewed
            assert not task.done(), task.exception()
            assert len(calls) >= 3
        finally:
            task.cancel()
            await lock.release()


async def test_recording_the_served_version_logs_a_slot_map_rebuild(redis_url, caplog) -> None:
    key = f"test:{uuid.uuid4().hex[:8]}:serving"
    async with Redis.from_url(redis_url) as redis:
        redis.hset, _ = failing(redis.hset, times=1)
        await record_served(redis, key, 4, "policy-v4", "/ckpt/v4")  # did not raise
        assert await read_served(redis, key) is None
        await record_served(redis, key, 5, "policy-v5", "/ckpt/v5")
        assert (await read_served(redis, key)).version == 5
    assert "cannot record the served version" in caplog.text
