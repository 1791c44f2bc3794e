"""The launcher on a real Redis with tenants' versions (per-tenant mode): it follows the tenants'
stream beside the shared one, collapses a burst to the newest version per tenant, lets tenants
take turns (one announcing again waits behind the others), records each result's tenant in the
metrics, and gives up on one tenant without holding up the others. In shared mode it follows the
shared policy alone, whatever an earlier per-tenant run left in Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from clawrl.common.served import write_served_tenant
from clawrl.common.tenants import TenantSettings, tenant_adapter, tenant_versions_stream
from clawrl.common.versions import VersionReady, announce
from clawrl.trainer.weight_sync.job import SyncResult, publish
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics

from .test_weight_sync_launcher import say, setup, until, watching  # noqa: F401 (a fixture)


@pytest.fixture
def per_tenant(setup):  # noqa: F811
    settings, redis = setup
    return settings.model_copy(update={"tenants": TenantSettings(mode="per_tenant")}), redis


async def say_tenant(redis, settings, tenant: str, version: int) -> None:
    ready = VersionReady(version, f"/ckpt/tenant-{tenant}/v{version}", version, time.time(),
                         tenant_adapter(tenant, version), tenant)  # fmt: skip
    await announce(redis, tenant_versions_stream(settings.redis.versions_stream), ready)


class TenantSyncs:
    """Stands where the job process would: publishes a result with the tenant, as the job does;
    `gate` holds a sync 'running', `on_launch` runs when a given (tenant, version) starts."""

    def __init__(self, settings, redis, failing: set[str] = frozenset()):
        self.settings, self.redis, self.failing = settings, redis, failing
        self.launched: list[tuple[str, int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.on_launch: dict[tuple[str, int], object] = {}

    async def __call__(self, ready: VersionReady) -> int:
        key = (ready.tenant, ready.version)
        self.launched.append(key)
        if key in self.on_launch:
            await self.on_launch[key]()
        await self.gate.wait()
        code = 1 if ready.tenant in self.failing else 0
        result = SyncResult(ready.version, "failed" if code else "ok", adapter=ready.adapter,
                            tenant=ready.tenant)  # fmt: skip
        await publish(self.redis, self.settings, result)
        return code


async def test_tenants_take_turns_and_each_burst_collapses_to_its_newest(per_tenant):
    settings, redis = per_tenant
    syncs = TenantSyncs(settings, redis)
    metrics = WeightSyncMetrics()
    await say(redis, settings, 1)
    for tenant, version in (("alice", 1), ("alice", 2), ("bob", 1)):
        await say_tenant(redis, settings, tenant, version)
    syncs.gate.clear()
    syncs.on_launch[("alice", 3)] = lambda: say_tenant(redis, settings, "alice", 4)
    watcher, task = await watching(settings, redis, syncs, metrics)
    try:
        await until(lambda: syncs.launched == [("", 1)])
        for tenant, version in (("alice", 3), ("bob", 2), ("carol", 1)):
            await say_tenant(redis, settings, tenant, version)
        await asyncio.sleep(0.2)  # read while the shared sync runs
        syncs.gate.set()
        await until(lambda: len(syncs.launched) == 5)
        await asyncio.sleep(0.3)
        # alice's v4, announced while her v3 synced, waits behind bob and carol.
        assert syncs.launched == [("", 1), ("alice", 3), ("bob", 2), ("carol", 1), ("alice", 4)]
        assert (watcher.served, watcher.tenant_served) == (1, {"alice": 4, "bob": 2, "carol": 1})
    finally:
        task.cancel()
    sample = metrics.registry.get_sample_value
    assert (
        sample("clawrl_weight_sync_tenant_syncs_total", {"tenant": "alice", "outcome": "ok"}) == 2
    )
    assert sample("clawrl_weight_sync_tenant_version", {"tenant": "alice"}) == 4
    assert sample("clawrl_weight_sync_policy_version") == 1  # the shared version alone
    assert sample("clawrl_weight_sync_syncs_total", {"outcome": "ok"}) == 5


async def test_a_tenant_given_up_holds_up_nobody_else(per_tenant):
    settings, redis = per_tenant
    syncs = TenantSyncs(settings, redis, failing={"alice"})
    metrics = WeightSyncMetrics()
    await say_tenant(redis, settings, "alice", 1)
    await say_tenant(redis, settings, "bob", 1)
    watcher, task = await watching(settings, redis, syncs, metrics)
    try:
        await until(
            lambda: watcher.tenant_given_up == {"alice": 1} and "bob" in watcher.tenant_served
        )
        # max_attempts = 2 (the fixture): alice twice, then bob.
        assert syncs.launched == [("alice", 1), ("alice", 1), ("bob", 1)]
        # An older or equal announcement of alice is not tried again; a newer one is.
        await say_tenant(redis, settings, "alice", 1)
        await asyncio.sleep(0.3)
        assert len(syncs.launched) == 3
        syncs.failing = set()
        await say_tenant(redis, settings, "alice", 2)
        await until(lambda: watcher.tenant_served.get("alice") == 2)
    finally:
        task.cancel()
    sample = metrics.registry.get_sample_value
    assert (
        sample("clawrl_weight_sync_tenant_syncs_total", {"tenant": "alice", "outcome": "failed"})
        == 2
    )


async def test_shared_mode_follows_the_shared_policy_alone(setup):  # noqa: F811
    settings, redis = setup
    assert settings.tenants.mode == "shared"
    # Left by an earlier per-tenant run on the same Redis: an announcement and a served adapter.
    await say_tenant(redis, settings, "alice", 1)
    await write_served_tenant(redis, settings.sync.served_key, "alice", 1,
                              tenant_adapter("alice", 1), "/ckpt/tenant-alice/v1")  # fmt: skip
    await say(redis, settings, 1)
    syncs = TenantSyncs(settings, redis)
    fast = settings.model_copy(
        update={"launcher": settings.launcher.model_copy(update={"reconcile_interval_s": 0.05})}
    )
    watcher, task = await watching(fast, redis, syncs)
    try:
        await until(lambda: watcher.served == 1)
        await asyncio.sleep(0.5)  # several convergence checks
    finally:
        task.cancel()
    assert syncs.launched == [("", 1)]
    assert watcher.tenant_served == {}
