"""A Redis Cluster client rebuilding its slot map (a failover, no reachable node) raises
RedisClusterException, which is no RedisError. The gateway's recording treats it as Redis being
away: the record call goes to the spool (replayed once Redis is back), it is counted, and the
request is served; before, the exception escaped the recording and the turn was lost."""

from __future__ import annotations

import random

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException

from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.recording import Recorder
from clawrl.gateway.sessions import SessionStore
from clawrl.gateway.spool import RecordingSpool

from .test_gateway_record_notes import served

pytestmark = pytest.mark.integration


async def test_a_cluster_without_a_reachable_node_spools_the_record(redis_url, tmp_path):
    redis = Redis.from_url(redis_url, socket_timeout=None)
    prefix = f"test:cluster-errors:{random.getrandbits(32):x}"
    store = SessionStore(redis, prefix=prefix, stream=f"{prefix}:turns", maxlen=100, ttl_s=60,
                         timeout_s=5)  # fmt: skip
    metrics = GatewayMetrics()
    spool = RecordingSpool(tmp_path, max_bytes=1 << 20)
    recorder = Recorder(store, metrics, gateway_id="g", anonymous_matching=True,
                        idle_timeout_s=60, sweep_interval_s=60, sweep_batch=10,
                        spool=spool)  # fmt: skip
    record = store.record

    async def no_reachable_node(**kwargs):
        raise RedisClusterException("Redis Cluster cannot be connected: Timeout connecting")

    messages = [{"role": "user", "content": "ping"}]
    try:
        store.record = no_reachable_node
        turn = recorder.begin(f"req-{prefix}", None, messages, messages, scope="-", done=True)
        assert await recorder.finish(turn, served(messages)) is None  # served, not recorded yet
        assert len(spool) == 1
        assert metrics.recording_failures.labels("record")._value.get() == 1
        store.record = record  # Redis is back: the spooled call is replayed, the turn stored
        assert await recorder.replay_spool() == 1
        assert await redis.xlen(f"{prefix}:turns") == 1
    finally:
        await redis.aclose()


async def test_a_replica_starting_during_a_slot_map_rebuild_starts(redis_url: str, caplog) -> None:
    """Its served version and its tenants' adapters cannot be read: it starts on the engine's
    version and the shared policy (the next sync routes it), instead of failing to start."""
    from clawrl.gateway.control import PauseGate
    from clawrl.gateway.lifespan import create_engine, initial_admission, restore_tenant_adapters
    from clawrl.gateway.settings import GatewaySettings

    settings = GatewaySettings.model_validate(
        {
            "tenants": {"mode": "per_tenant"},
            "control": {"served_key": f"test:cluster-errors:{random.getrandbits(32):x}"},
            "serving": {"engine_url": "http://127.0.0.1:9", "engine_connect_timeout_s": 0.5},
        }
    )
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=1.0, retry_after_s=1)
    engine = create_engine(settings)
    redis = Redis.from_url(redis_url)

    async def no_reachable_node(*args, **kwargs):
        raise RedisClusterException("Redis Cluster cannot be connected: Timeout connecting")

    redis.hgetall = no_reachable_node
    try:
        admitted = await initial_admission(settings, engine, redis)
        await restore_tenant_adapters(settings, redis, gate)
    finally:
        await engine.aclose()
        await redis.aclose()
    assert (admitted.policy_version, admitted.adapter) == (0, "")
    assert gate.tenant_adapters == {}
    assert "cannot read the served version" in caplog.text
    assert "cannot read the tenants' served adapters" in caplog.text
