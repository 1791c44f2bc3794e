"""Per-tenant adapters after a reset or remove (issue 30), on a real Redis and the tiny model:
a sample trains the adapter that served it (a tenant's turn the shared policy served after the
tenant's first version trains neither); `tenants reset T` drops the samples of T's old adapter,
queued or still coming, counted and acknowledged, and across a restart (T's version floor is in
the durable state); a reset and a `tenants remove` free T's slot for another tenant."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from clawrl.trainer.tenants import request_reset

from .helpers import counter, make_sample, pending, publish_all, settings_for, start_trainer
from .test_trainer_tenants import SECTIONS, tenant_step

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str):
    async with Redis.from_url(redis_url) as client:
        yield client


def turn(i: int, tenant: str, served_by: str = ""):
    """Sample `tenant:i`; `served_by`: its tenant's adapter that served it ("": the shared
    policy, at version 0)."""
    version = int(served_by.rsplit("-v", 1)[1]) if served_by else 0
    return make_sample(f"{tenant}:{i}", [10 + i, 11], tenant=tenant,
                       weight_version=served_by, policy_version=version)  # fmt: skip


def dropped(trainer, reason: str) -> float:
    return counter(trainer, "clawrl_trainer_samples_dropped_total", reason=reason)


async def test_reset_and_remove_drop_the_old_adapters_samples_and_free_its_slot(
    redis, redis_url, tmp_path
) -> None:
    sections = {**SECTIONS, "tenants": {**SECTIONS["tenants"], "max_adapters": 1}}
    settings = settings_for(redis_url, tmp_path, **sections)
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [turn(0, "alice"), turn(1, "alice")])
    assert await tenant_step(trainer) == ("alice", ("alice:0", "alice:1"))  # her v1

    # alice:3 came from the shared policy after her v1 (a gateway that had not switched her):
    # it trains neither her adapter nor the shared policy (which serves others): dropped. bob
    # finds no room (max_adapters 1): his samples train the shared policy.
    await publish_all(redis, settings, [
        turn(2, "alice", "tenant-alice-v1"), turn(3, "alice"), turn(4, "bob"), turn(5, "bob"),
    ])  # fmt: skip
    assert await tenant_step(trainer) == ("", ("bob:4", "bob:5"))
    assert dropped(trainer, "tenant_served_shared") == 1

    # Reset alice: her queued sample (alice:2) is dropped, and so is one of her v1 that comes
    # after; her slot goes to bob, whose next samples start his adapter.
    await asyncio.to_thread(request_reset, settings, "alice")  # as the CLI: its own loop
    await trainer.apply_resets()
    assert dropped(trainer, "tenant_reset") == 1
    assert trainer.intake.queues.owners == set()
    await publish_all(redis, settings, [
        turn(6, "alice", "tenant-alice-v1"), turn(7, "bob"), turn(8, "bob"),
    ])  # fmt: skip
    assert await tenant_step(trainer) == ("bob", ("bob:7", "bob:8"))
    assert dropped(trainer, "tenant_reset") == 2
    assert trainer.state.tenant_versions == {"alice": 1, "bob": 1}

    # A restart keeps alice's floor: a late sample of her v1 is still dropped. Removing bob
    # frees the slot for alice's new adapter (her versions go on from 2), and bob's samples
    # train the shared policy.
    trainer = await start_trainer(settings, redis)
    await asyncio.to_thread(request_reset, settings, "bob", "remove")
    await trainer.apply_resets()
    await publish_all(redis, settings, [
        turn(9, "alice", "tenant-alice-v1"), turn(10, "alice"), turn(11, "bob"),
        turn(12, "alice"), turn(13, "bob"),
    ])  # fmt: skip
    assert await tenant_step(trainer) == ("alice", ("alice:10", "alice:12"))
    assert await tenant_step(trainer) == ("", ("bob:11", "bob:13"))
    assert dropped(trainer, "tenant_reset") == 1  # this run's: alice:9
    assert trainer.state.tenant_versions == {"alice": 2, "bob": 1}
    assert trainer.state.tenants_removed == ["bob"]
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="removed") == 1
    assert await pending(redis, settings) == 0  # every sample trained or dropped, acknowledged
