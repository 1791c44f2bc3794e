"""The launcher on a real Redis: one sync per announced version, newest first; retries, then
gives up until a newer version; metrics from the results the syncs publish."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from clawrl.common.versions import VersionReady, announce
from clawrl.trainer.weight_sync.job import SyncResult, publish
from clawrl.trainer.weight_sync.launcher import SyncWatcher
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

pytestmark = pytest.mark.integration


class ScriptedSyncs:
    """Stands where the job process would: publishes a result like the job and returns its exit
    code; `gate` lets a test hold a sync 'running'."""

    def __init__(self, settings, redis, codes=None):
        self.settings, self.redis = settings, redis
        self.codes = codes or {}
        self.launched: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, ready: VersionReady) -> int:
        self.launched.append(ready.version)
        await self.gate.wait()
        code = self.codes.get(ready.version, 0)
        outcome = "ok" if code == 0 else "failed"
        await publish(self.redis, self.settings,
                      SyncResult(ready.version, outcome, pause_s=0.2, load_s=0.1))  # fmt: skip
        return code


@pytest.fixture
async def setup(redis_url):
    tag = uuid.uuid4().hex[:8]
    settings = WeightSyncSettings(
        redis={"url": redis_url, "versions_stream": f"test:{tag}:versions"},
        sync={"results_stream": f"test:{tag}:syncs"},
        launcher={"max_attempts": 2, "retry_backoff_s": 0.05},
    )
    redis = Redis.from_url(redis_url)
    yield settings, redis
    await redis.aclose()


async def say(redis, settings, version: int) -> None:
    ready = VersionReady(version, f"/ckpt/v{version}", version * 10, time.time())
    await announce(redis, settings.redis.versions_stream, ready)


async def until(predicate, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def watching(settings, redis, syncs, metrics=None):
    watcher = SyncWatcher(settings, redis, syncs, metrics or WeightSyncMetrics(), block_ms=50)
    return watcher, asyncio.create_task(watcher.run_forever())


async def test_newest_version_wins_over_those_announced_during_a_sync(setup):
    settings, redis = setup
    syncs = ScriptedSyncs(settings, redis)
    metrics = WeightSyncMetrics()
    await say(redis, settings, 1)
    syncs.gate.clear()
    watcher, task = await watching(settings, redis, syncs, metrics)
    try:
        await until(lambda: syncs.launched == [1])
        for version in (2, 3, 4):  # while v1 syncs
            await say(redis, settings, version)
        await asyncio.sleep(0.2)
        syncs.gate.set()
        await until(lambda: watcher.served == 4)
        assert syncs.launched == [1, 4]
        value = metrics.registry.get_sample_value
        assert value("clawrl_weight_sync_syncs_total", {"outcome": "ok"}) == 2
        assert value("clawrl_weight_sync_pause_duration_seconds_count") == 2
        assert value("clawrl_weight_sync_policy_version") == 4
        assert value("clawrl_weight_sync_announced_version") == 4
    finally:
        task.cancel()


async def test_a_failing_version_is_retried_then_abandoned_until_a_newer_one(setup):
    settings, redis = setup
    syncs = ScriptedSyncs(settings, redis, codes={1: 1})
    metrics = WeightSyncMetrics()
    await say(redis, settings, 1)
    watcher, task = await watching(settings, redis, syncs, metrics)
    try:
        await until(lambda: watcher.given_up == 1)
        assert syncs.launched == [1, 1] and watcher.served == 0
        await say(redis, settings, 2)
        await until(lambda: watcher.served == 2)
        assert syncs.launched == [1, 1, 2]
        value = metrics.registry.get_sample_value
        assert value("clawrl_weight_sync_syncs_total", {"outcome": "failed"}) == 2
    finally:
        task.cancel()


async def test_a_restarted_launcher_syncs_the_newest_version_once(setup):
    # The engines may have restarted on their initial weights: the newest version is synced
    # again (the job itself skips it when every engine already serves it), older ones never.
    settings, redis = setup
    for version in (4, 5):
        await say(redis, settings, version)
    await publish(redis, settings, SyncResult(5, "ok", pause_s=0.1, load_s=0.1))
    syncs = ScriptedSyncs(settings, redis)
    watcher, task = await watching(settings, redis, syncs)
    try:
        await until(lambda: syncs.launched == [5])
        await asyncio.sleep(0.3)
        assert syncs.launched == [5] and watcher.served == 5
        await say(redis, settings, 6)
        await until(lambda: syncs.launched == [5, 6])
    finally:
        task.cancel()
