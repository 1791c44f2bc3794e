"""A drain longer than the pause lease: the job renews the lease from the first Pause on, so
the gateway stays paused until the engines have loaded (a real GatewayControl gRPC server over a
real pause gate, a scripted SGLang engine over real HTTP, real Redis for the lock)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiohttp import web
from redis.asyncio import Redis

from clawrl.common.versions import VersionReady
from clawrl.gateway.control import PauseGate, start_control_server
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.trainer.weight_sync.job import sync_version
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from tests.scripted_engine import scripted_engine

pytestmark = pytest.mark.integration


async def test_the_lease_is_renewed_while_the_gateway_drains(redis_url):
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=30, retry_after_s=1, lease_s=30)
    server, port = await start_control_server(
        gate, host="127.0.0.1", port=0, token=None, gateway_id="g", drain_timeout_s=30
    )
    loads: list[float] = []

    async def model_info(request):
        return web.json_response({"weight_version": "0", "model_path": "/base"})

    async def update(request):
        loads.append(time.monotonic())
        assert gate.paused  # the engine loads while the gateway is paused
        return web.json_response({"success": True, "message": "ok"})

    finish = asyncio.Event()

    async def generation():  # in flight when the pause arrives, for over two leases
        async with gate.admit():
            await finish.wait()

    running = asyncio.create_task(generation())
    await asyncio.sleep(0)
    async with scripted_engine(
        {"/get_model_info": model_info, "/update_weights_from_disk": update}
    ) as engine:
        tag = uuid.uuid4().hex[:8]
        settings = WeightSyncSettings(
            redis={"url": redis_url, "versions_stream": f"test:{tag}:versions"},
            gateways={"addresses": [f"127.0.0.1:{port}"], "lease_s": 1.2, "drain_timeout_s": 10},
            engines={"urls": [engine]},
            sync={"lock_key": f"test:{tag}:lock", "results_stream": f"test:{tag}:syncs"},
        )
        redis = Redis.from_url(redis_url)
        asyncio.get_running_loop().call_later(3.0, finish.set)
        result = await sync_version(settings, redis, VersionReady(1, "/ckpt/v1", 1, 0.0), "job")
        await redis.aclose()
    await running
    await server.stop(None)
    assert result.outcome == "ok" and result.drain_s >= 2.9 and len(loads) == 1
    assert gate.metrics.registry.get_sample_value("clawrl_gateway_pause_lease_expiries_total") == 0
    assert not gate.paused and gate.policy_version == 1
