"""A gateway replica that (re)starts in per-tenant mode routes each tenant to the adapter its
last sync recorded in Redis, and reports that version (the Tenants row's "served" series)."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from clawrl.common.served import write_served_tenant
from clawrl.gateway.control import PauseGate
from clawrl.gateway.lifespan import restore_tenant_adapters
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration


async def test_restored_tenant_adapters_are_served_and_reported(redis_url: str) -> None:
    key = f"test:restore:{uuid.uuid4().hex[:8]}:serving"
    settings = GatewaySettings.model_validate(
        {"tenants": {"mode": "per_tenant"}, "control": {"served_key": key}}
    )
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=1.0, retry_after_s=1)
    async with Redis.from_url(redis_url) as redis:
        await write_served_tenant(redis, key, "alice", 3, "tenant-alice-v3", "/ckpt/alice/v3")
        await restore_tenant_adapters(settings, redis, gate)
        await redis.delete(f"{key}:tenants")
    assert gate.tenant_adapters == {"alice": (3, "tenant-alice-v3")}
    registry = gate.metrics.registry
    assert (
        registry.get_sample_value("clawrl_gateway_tenant_policy_version", {"tenant": "alice"}) == 3
    )


async def test_a_tenant_taken_out_of_allow_is_served_the_shared_policy(redis_url: str) -> None:
    """Issue 30: its recorded adapter is not restored (its turns then record the shared
    version, which the trainer trains the shared policy on)."""
    key = f"test:restore:{uuid.uuid4().hex[:8]}:serving"
    settings = GatewaySettings.model_validate(
        {"tenants": {"mode": "per_tenant", "allow": ["bob"]}, "control": {"served_key": key}}
    )
    gate = PauseGate(GatewayMetrics(), hold_timeout_s=1.0, retry_after_s=1)
    async with Redis.from_url(redis_url) as redis:
        await write_served_tenant(redis, key, "alice", 3, "tenant-alice-v3", "/ckpt/alice/v3")
        await write_served_tenant(redis, key, "bob", 2, "tenant-bob-v2", "/ckpt/bob/v2")
        await restore_tenant_adapters(settings, redis, gate)
        await redis.delete(f"{key}:tenants")
    assert gate.tenant_adapters == {"bob": (2, "tenant-bob-v2")}
    async with gate.admit("alice") as admitted:
        assert (admitted.policy_version, admitted.adapter) == (gate.policy_version, gate.adapter)
