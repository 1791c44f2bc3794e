"""Running gateways unroute a released or de-selected tenant (issue 30). `clawrl-trainer tenants
reset|remove` makes the trainer drop the tenant's adapter, delete its served record and announce
the release (with its version floor) on the tenants' versions stream; before this, a gateway
already running kept serving the tenant from the old adapter, every turn of it was dropped as
`tenant_reset`, and it never trained again until the gateways restarted.

In-process (real Redis, real GatewayControl servers over real gates, a scripted SGLang LoRA
engine): the launcher unroutes the released tenant from every gateway, deletes a served record a
racing sync wrote back, unloads the released adapters once idle, never syncs a version below the
floor (announced before the release), syncs the new adapter after it; a tenant taken out of
`allow` is unrouted by the convergence check. End to end (real gateway and launcher processes, the
CPU engine): after the release the running gateways serve the tenant the shared policy, and its
next turn records the shared version."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid

import httpx
import pytest
import redis
from aiohttp import web
from redis.asyncio import Redis

from clawrl.common.records import Turn, decode_entry
from clawrl.common.served import delete_served_tenant, read_served_tenants, write_served_tenant
from clawrl.common.tenants import TenantSettings, tenant_versions_stream
from clawrl.common.versions import TenantReleased, VersionReady, announce
from clawrl.gateway.control import PauseGate, start_control_server
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.conftest import wait_until
from tests.scripted_engine import scripted_engine

from .conftest import start_launcher, start_replicas, stop_launcher
from .test_lora_sync import LORA_FLAGS, loaded, tiny_adapter
from .test_lora_unload_wait import LoraEngine
from .test_tenant_launcher import TenantSyncs
from .test_weight_sync_job import results
from .test_weight_sync_launcher import until, watching

pytestmark = pytest.mark.integration

MODEL = "smollm2-tiny"


async def release(redis: Redis, settings, tenant: str, floor: int, action: str = "reset"):
    """What the trainer does when it applies `clawrl-trainer tenants reset|remove`
    (Trainer._release): delete the served record, announce the release."""
    await delete_served_tenant(redis, settings.sync.served_key, tenant)
    stream = tenant_versions_stream(settings.redis.versions_stream)
    await announce(redis, stream, TenantReleased(tenant, floor, action, time.time()))


async def say_tenant(redis: Redis, settings, tenant: str, version: int) -> None:
    name = f"tenant-{tenant}-v{version}"
    ready = VersionReady(version, f"/ckpt/{name}", version, time.time(), name, tenant)
    await announce(redis, tenant_versions_stream(settings.redis.versions_stream), ready)


async def stopped(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Gates:
    """Two gateways' gates behind real GatewayControl servers; one scripted LoRA engine."""

    def __init__(self, routes: dict[str, tuple[int, str]], held: dict[str, str]):
        shared = {"hold_timeout_s": 5, "retry_after_s": 1, "policy_version": 4}
        self.gates = [PauseGate(GatewayMetrics(), adapter="policy-v4", **shared) for _ in "ab"]
        for gate in self.gates:
            gate.tenant_adapters.update(routes)
        self.engine = LoraEngine(held)
        self.servers: list = []
        self.ports: list[int] = []

    async def __aenter__(self):
        for gate in self.gates:
            server, port = await start_control_server(
                gate, host="127.0.0.1", port=0, token=None, gateway_id="g", drain_timeout_s=5
            )
            self.servers.append(server)
            self.ports.append(port)
        routes = self.engine.routes()

        async def ok(request):
            return web.json_response({"success": True})

        routes["/continue_generation"] = ok
        self._engine = scripted_engine(routes)
        self.url = await self._engine.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self._engine.__aexit__(*exc)
        for server in self.servers:
            await server.stop(None)

    def settings(self, redis_url: str, **tenants) -> WeightSyncSettings:
        tag = uuid.uuid4().hex[:8]
        return WeightSyncSettings(
            gateways={"addresses": [f"127.0.0.1:{port}" for port in self.ports]},
            engines={"urls": [self.url]},
            redis={"url": redis_url, "versions_stream": f"test:{tag}:versions"},
            sync={"lock_key": f"test:{tag}:lock", "results_stream": f"test:{tag}:syncs",
                  "served_key": f"test:{tag}:serving", "unload_wait_s": 5},
            launcher={"max_attempts": 2, "retry_backoff_s": 0.05, "reconcile_interval_s": 0.05},
            tenants=TenantSettings(mode="per_tenant", **tenants),
        )  # fmt: skip

    def routed(self) -> list[dict[str, str]]:
        return [{t: a for t, (_, a) in gate.tenant_adapters.items()} for gate in self.gates]


def unroutes(metrics: WeightSyncMetrics, tenant: str, outcome: str = "ok") -> float | None:
    return metrics.registry.get_sample_value(
        "clawrl_weight_sync_tenant_unroutes_total", {"tenant": tenant, "outcome": outcome}
    )


async def test_the_launcher_unroutes_a_released_tenant_from_every_gateway(redis_url):
    routes = {"alice": (2, "tenant-alice-v2"), "bob": (1, "tenant-bob-v1")}
    held = {"tenant-alice-v1": "/ckpt/a1", "tenant-alice-v2": "/ckpt/a2", "tenant-bob-v1": "/b1"}
    async with Gates(routes, held) as replicas:
        settings = replicas.settings(redis_url)
        client = Redis.from_url(redis_url)
        key = settings.sync.served_key
        await write_served_tenant(client, key, "bob", 1, "tenant-bob-v1", "/b1")
        # alice's versions, then her reset: v2 (announced, not synced yet) must never be.
        await say_tenant(client, settings, "alice", 1)
        await say_tenant(client, settings, "alice", 2)
        await release(client, settings, "alice", 3)
        # A sync of her v2 that raced the reset wrote her served record back.
        await write_served_tenant(client, key, "alice", 2, "tenant-alice-v2", "/ckpt/a2")
        syncs, metrics = TenantSyncs(settings, client), WeightSyncMetrics()
        watcher, task = await watching(settings, client, syncs, metrics)
        try:
            await until(lambda: replicas.routed() == [{"bob": "tenant-bob-v1"}] * 2)
            await until(lambda: "tenant-alice-v2" not in replicas.engine.held)
            # Her released adapters are unloaded; bob's stays; her served record is gone.
            assert replicas.engine.held == {"tenant-bob-v1": "/b1"}
            assert set(await read_served_tenants(client, key)) == {"bob"}
            assert syncs.launched == []
            # Her new adapter (at the floor) is synced as any other version.
            await say_tenant(client, settings, "alice", 3)
            await until(lambda: syncs.launched == [("alice", 3)])
            assert watcher.unrouter.floors == {"alice": 3}
        finally:
            await stopped(task)
        await client.aclose()
    for gate in replicas.gates:  # the shared policy serves her again
        async with gate.admit("alice") as admission:
            assert (admission.policy_version, admission.adapter) == (4, "policy-v4")
    assert unroutes(metrics, "alice") == 2 and unroutes(metrics, "alice", "failed") is None
    sample = metrics.registry.get_sample_value
    assert sample("clawrl_weight_sync_adapters_unloaded_total") == 2


async def test_a_released_tenant_read_again_leaves_its_new_adapter_routed(redis_url):
    # A restarted launcher reads the stream from its start: the old release must not unroute
    # the adapter the tenant got since.
    routes = {"alice": (3, "tenant-alice-v3")}
    async with Gates(routes, {"tenant-alice-v3": "/ckpt/a3"}) as replicas:
        settings = replicas.settings(redis_url)
        client = Redis.from_url(redis_url)
        await say_tenant(client, settings, "alice", 2)
        await release(client, settings, "alice", 3)
        await say_tenant(client, settings, "alice", 3)
        await write_served_tenant(client, settings.sync.served_key, "alice", 3, "tenant-alice-v3",
                                  "/ckpt/a3")  # fmt: skip
        syncs, metrics = TenantSyncs(settings, client), WeightSyncMetrics()
        _, task = await watching(settings, client, syncs, metrics)
        try:
            await until(lambda: syncs.launched == [("alice", 3)])
            await asyncio.sleep(0.3)  # several convergence checks
        finally:
            await stopped(task)
        await client.aclose()
    assert replicas.routed() == [{"alice": "tenant-alice-v3"}] * 2
    assert replicas.engine.held == {"tenant-alice-v3": "/ckpt/a3"}
    assert unroutes(metrics, "alice") is None


async def test_a_tenant_taken_out_of_allow_is_unrouted_by_the_convergence_check(redis_url):
    routes = {"alice": (1, "tenant-alice-v1"), "carol": (2, "tenant-carol-v2")}
    held = {"tenant-alice-v1": "/a1", "tenant-carol-v2": "/c2"}
    async with Gates(routes, held) as replicas:
        settings = replicas.settings(redis_url, allow=["alice"])
        client = Redis.from_url(redis_url)
        for tenant, (version, adapter) in routes.items():
            await write_served_tenant(client, settings.sync.served_key, tenant, version, adapter,
                                      held[adapter])  # fmt: skip
        syncs, metrics = TenantSyncs(settings, client), WeightSyncMetrics()
        _, task = await watching(settings, client, syncs, metrics)
        try:
            await until(lambda: replicas.routed() == [{"alice": "tenant-alice-v1"}] * 2)
            await asyncio.sleep(0.3)  # several convergence checks: carol is not synced back
        finally:
            await stopped(task)
        await client.aclose()
    assert replicas.routed() == [{"alice": "tenant-alice-v1"}] * 2
    assert syncs.launched == [] and unroutes(metrics, "carol") == 2


# --- end to end: real gateway processes, the launcher process, the CPU engine -----------------


@pytest.fixture(scope="module")
def lora_engine(engine_factory) -> str:
    """test_lora_sync's engine (the same flags: one process); this module's adapter names are
    its own."""
    return engine_factory(MODEL, *LORA_FLAGS, "--weight-version", "0", "--random-seed", "0")


def turn_of(replica, user: str) -> httpx.Response:
    """A main turn of `user` (keys off: the `user` field names the tenant), its session done."""
    return httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "user": user},
        headers={"X-Session-Id": f"unroute-{uuid.uuid4().hex[:10]}", "X-Session-Done": "true"},
        timeout=60,
    )


def turns_of(redis_url: str, stream: str, tenant: str) -> list[Turn]:
    client = redis.Redis.from_url(redis_url)
    entries = [decode_entry(fields, Turn) for _, fields in client.xrange(stream)]
    return [turn for turn in entries if turn.tenant == tenant]


def test_after_a_reset_running_gateways_serve_the_tenant_the_shared_policy(
    lora_engine, sync_env, redis_url, log_dir, tmp_path
):
    tag = uuid.uuid4().hex[:8]
    served_key, turns = f"test:{tag}:serving", f"test:{tag}:turns"
    env = {**sync_env, "CLAWRL_SYNC__SERVED_KEY": served_key, "CLAWRL_TENANTS__MODE": "per_tenant"}
    first = tiny_adapter(tmp_path / f"tenant-erin-{tag}-v1", seed=21)
    second = tmp_path / f"tenant-erin-{tag}-v2"
    shutil.copytree(first, second)
    tenant = f"erin-{tag}"  # adapter names of its own on the shared engine
    gateways = start_replicas(
        (f"unroute-a-{tag}", f"unroute-b-{tag}"), lora_engine, redis_url, log_dir,
        {"CLAWRL_CONTROL__SERVED_KEY": served_key, "CLAWRL_TENANTS__MODE": "per_tenant",
         "CLAWRL_REDIS__TURNS_STREAM": turns},
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    stream = tenant_versions_stream(env["CLAWRL_REDIS__VERSIONS_STREAM"])
    client.xadd(stream, VersionReady(1, str(first), 1, time.time(), f"tenant-{tenant}-v1",
                                     tenant).fields())  # fmt: skip
    launcher = start_launcher(env, gateways, [lora_engine])
    try:
        synced = env["CLAWRL_SYNC__RESULTS_STREAM"]
        wait_until(lambda: results(redis_url, synced), 60, "the tenant's sync", launcher)
        assert [(r.tenant, r.version, r.outcome) for r in results(redis_url, synced)] == [
            (tenant, 1, "ok")
        ]
        for gateway in gateways:
            assert dict(gateway.status().tenant_adapters) == {tenant: f"tenant-{tenant}-v1"}
        assert turn_of(gateways[0], tenant).status_code == 200
        wait_until(lambda: turns_of(redis_url, turns, tenant), 30, "the turn recorded")
        assert turns_of(redis_url, turns, tenant)[-1].weight_version == f"tenant-{tenant}-v1"

        # The trainer applies `clawrl-trainer tenants reset` (Trainer._release's Redis part).
        asyncio.run(release_sync(redis_url, served_key, env, tenant))
        wait_until(
            lambda: all(tenant not in g.status().tenant_adapters for g in gateways),
            30, "the tenant unrouted", launcher,
        )  # fmt: skip
        for gateway in gateways:
            status = gateway.status()
            assert dict(status.tenant_adapters) == {}
            assert (status.policy_version, status.adapter) == (0, "")
            assert turn_of(gateway, tenant).json()["system_fingerprint"] == "clawrl-policy-v0"
        wait_until(lambda: len(turns_of(redis_url, turns, tenant)) == 3, 30, "the turns recorded")
        # Its new turns record the shared version: the trainer keeps them (no tenant_reset).
        for turn in turns_of(redis_url, turns, tenant)[1:]:
            assert (turn.weight_version, turn.policy_version) == ("0", 0)
        wait_until(lambda: f"tenant-{tenant}-v1" not in loaded(lora_engine), 30, "unloaded")

        # The tenant's new adapter (from its floor) is routed as before.
        client.xadd(stream, VersionReady(2, str(second), 2, time.time(), f"tenant-{tenant}-v2",
                                         tenant).fields())  # fmt: skip
        wait_until(
            lambda: all(g.status().tenant_adapters.get(tenant) == f"tenant-{tenant}-v2"
                        for g in gateways),
            60, "the new adapter routed", launcher,
        )  # fmt: skip
    finally:
        stderr = stop_launcher(launcher)
        for gateway in gateways:
            gateway.child.stop()
        client.close()
        # The engine is shared with other modules, which assert on what it holds.
        for name in (f"tenant-{tenant}-v1", f"tenant-{tenant}-v2"):
            if name in loaded(lora_engine):
                httpx.post(f"{lora_engine}/unload_lora_adapter", json={"lora_name": name},
                           timeout=30)  # fmt: skip
    assert f"routed tenant {tenant} to tenant-{tenant}-v1 (released): unrouted" in stderr


async def release_sync(redis_url: str, served_key: str, env: dict[str, str], tenant: str) -> None:
    settings = WeightSyncSettings(
        redis={"url": redis_url, "versions_stream": env["CLAWRL_REDIS__VERSIONS_STREAM"]},
        sync={"served_key": served_key},
    )
    async with Redis.from_url(redis_url) as client:
        await release(client, settings, tenant, 2)
