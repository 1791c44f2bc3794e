"""After a LoRA switch the job unloads the old adapter only once no gateway has a request
running on it, and leaves it loaded when the wait runs out; a version every engine holds and
every gateway serves is skipped (a real GatewayControl server over a real gate, a scripted
SGLang engine speaking the LoRA API over real HTTP, real Redis)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiohttp import web
from redis.asyncio import Redis

from clawrl.common.served import read_served
from clawrl.common.versions import VersionReady
from clawrl.gateway.control import PauseGate, start_control_server
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.trainer.weight_sync.job import sync_version
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.scripted_engine import scripted_engine

pytestmark = pytest.mark.integration


class LoraEngine:
    """SGLang's LoRA surface over a dict: what is loaded, and when each unload came."""

    def __init__(self, held: dict[str, str]):
        self.held = dict(held)
        self.unloads: dict[str, float] = {}

    def routes(self):
        async def models(request):
            cards = [{"id": "base", "root": "/base", "parent": None}]
            cards += [{"id": n, "root": p, "parent": "base"} for n, p in self.held.items()]
            return web.json_response({"object": "list", "data": cards})

        async def load(request):
            body = await request.json()
            self.held[body["lora_name"]] = body["lora_path"]
            return web.json_response({"success": True, "loaded_adapters": self.held})

        async def unload(request):
            name = (await request.json())["lora_name"]
            self.held.pop(name)
            self.unloads[name] = time.monotonic()
            return web.json_response({"success": True, "loaded_adapters": self.held})

        return {"/v1/models": models, "/load_lora_adapter": load, "/unload_lora_adapter": unload}


def sync_settings(port: int, engine_url: str, redis_url: str, **sync) -> WeightSyncSettings:
    """One gateway and one engine; this test's own lock, streams and served key."""
    tag = uuid.uuid4().hex[:8]
    return WeightSyncSettings(
        gateways={"addresses": [f"127.0.0.1:{port}"]},
        engines={"urls": [engine_url]},
        redis={"url": redis_url, "versions_stream": f"test:{tag}:versions"},
        sync={"lock_key": f"test:{tag}:lock", "results_stream": f"test:{tag}:syncs",
              "served_key": f"test:{tag}:serving", **sync},
    )  # fmt: skip


async def sync_with_a_request_on_the_old_adapter(redis_url: str, finish_after_s: float, wait_s):
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=5, retry_after_s=1, policy_version=1,
                     adapter="policy-v1")  # fmt: skip
    server, port = await start_control_server(
        gate, host="127.0.0.1", port=0, token=None, gateway_id="g", drain_timeout_s=5
    )
    engine = LoraEngine({"policy-v1": "/ckpt/v1", "tenant-a": "/tenants/a"})
    finish = asyncio.Event()
    admitted = asyncio.Event()

    async def generation():  # admitted under policy-v1, still running at the switch
        async with gate.admit() as admission:
            admitted.set()
            await finish.wait()
            return admission

    running = asyncio.create_task(generation())
    await admitted.wait()
    async with scripted_engine(engine.routes()) as url:
        settings = sync_settings(port, url, redis_url, unload_wait_s=wait_s)
        redis = Redis.from_url(redis_url)
        asyncio.get_running_loop().call_later(finish_after_s, finish.set)
        started = time.monotonic()
        ready = VersionReady(2, "/ckpt/v2", 2, 0.0, adapter="policy-v2")
        result = await sync_version(settings, redis, ready, "job")
        served = await read_served(redis, settings.sync.served_key)
        await redis.aclose()
    finish.set()
    admission = await running
    await server.stop(None)
    return result, engine, gate, admission, started, served


async def test_the_old_adapter_is_unloaded_once_its_last_request_finished(redis_url):
    result, engine, gate, admission, started, served = await sync_with_a_request_on_the_old_adapter(
        redis_url, finish_after_s=0.6, wait_s=10
    )
    assert (result.outcome, result.adapter, result.unloaded, result.kept) == (
        "ok",
        "policy-v2",
        1,
        0,
    )
    # The running request kept its adapter; the unload came after it ended, not before.
    assert (admission.policy_version, admission.adapter) == (1, "policy-v1")
    assert engine.unloads["policy-v1"] - started >= 0.6
    # Another tenant's adapter is not the sync's to remove.
    assert engine.held == {"policy-v2": "/ckpt/v2", "tenant-a": "/tenants/a"}
    assert (gate.policy_version, gate.adapter, gate.paused) == (2, "policy-v2", False)
    assert (served.version, served.adapter, served.path) == (2, "policy-v2", "/ckpt/v2")


async def test_an_old_adapter_still_in_use_when_the_wait_ends_stays_loaded(redis_url):
    result, engine, gate, _, _, _ = await sync_with_a_request_on_the_old_adapter(
        redis_url, finish_after_s=3.0, wait_s=0.3
    )
    assert (result.outcome, result.unloaded, result.kept) == ("ok", 0, 1)
    assert "policy-v1" in engine.held and "policy-v1" not in engine.unloads
    assert gate.adapter == "policy-v2"


async def test_a_version_already_loaded_and_served_everywhere_is_skipped(redis_url):
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=5, retry_after_s=1, policy_version=2,
                     adapter="policy-v2")  # fmt: skip
    server, port = await start_control_server(
        gate, host="127.0.0.1", port=0, token=None, gateway_id="g", drain_timeout_s=5
    )
    engine = LoraEngine({"policy-v2": "/ckpt/v2"})
    async with scripted_engine(engine.routes()) as url:
        settings = sync_settings(port, url, redis_url)
        redis = Redis.from_url(redis_url)
        ready = VersionReady(2, "/ckpt/v2", 2, 0.0, adapter="policy-v2")
        result = await sync_version(settings, redis, ready, "job")
        await redis.aclose()
    await server.stop(None)
    assert (result.outcome, result.exit_code, result.load_s) == ("skipped", 0, 0.0)
    assert gate.metrics.registry.get_sample_value("clawrl_gateway_adapter_switches_total") == 0
