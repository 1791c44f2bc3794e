"""Per-tenant adapters in the trainer (issue 20) on a real Redis and the tiny model: a step
trains one tenant's adapter on that tenant's samples only, each sample once; tenants take turns;
each tenant's versions are exported and announced as `tenant-<id>-vN` beside the shared
policy's; a restart resumes every tenant's version."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from clawrl.common.tenants import tenant_versions_stream
from clawrl.common.versions import VersionReady, tenant_entry
from clawrl.trainer.main import main
from clawrl.trainer.tenants import tenant_rows

from .helpers import counter, make_sample, pending, publish_all, settings_for, start_trainer
from .test_trainer_stream import NO_STOP

pytestmark = pytest.mark.integration

SECTIONS = {
    "lora": {"enabled": True, "rank": 4, "alpha": 8},
    "tenants": {"mode": "per_tenant", "min_samples_per_step": 2, "max_adapters": 2},
    "rollout": {"rollout_batch_size": 2},
}


@pytest.fixture
async def redis(redis_url: str):
    async with Redis.from_url(redis_url) as client:
        yield client


async def tenant_step(trainer):
    collected = await trainer.intake.next_batch(
        trainer._version_of, trainer.trained.__contains__, trainer.uncommitted, NO_STOP,
        block_ms=100,
    )  # fmt: skip
    report = await trainer.step(collected)
    return collected.tenant, report.sample_ids


async def announced(client: Redis, stream: str) -> list[tuple[str, int, str]]:
    """The versions announced on the tenants' stream (its releases left out)."""
    entries = [tenant_entry(fields) for _, fields in await client.xrange(stream)]
    return [(r.tenant, r.version, r.adapter) for r in entries if isinstance(r, VersionReady)]


async def test_each_tenant_trains_its_own_adapter_in_turn(
    redis, redis_url, tmp_path, capsys
) -> None:
    settings = settings_for(redis_url, tmp_path, **SECTIONS)
    trainer = await start_trainer(settings, redis)
    order = ["alice", "bob", "alice", "", "alice", "alice", "bob", "", "carol", "carol"]
    # alice's turns 4 and 5 come once her v1 serves her; until a tenant's first export, the
    # shared policy serves it (weight_version ""), and those samples start its adapter.
    served = {4: "tenant-alice-v1", 5: "tenant-alice-v1"}
    samples = [
        make_sample(
            f"{tenant or 'shared'}:{i}",
            [10 + i, 11],
            tenant=tenant,
            reward=0.5 if tenant == "bob" else 1.0,
            weight_version=served.get(i, ""),
            policy_version=1 if i in served else 0,
        )
        for i, tenant in enumerate(order)
    ]
    await publish_all(redis, settings, samples)
    steps = [await tenant_step(trainer) for _ in range(5)]
    assert steps == [
        ("alice", ("alice:0", "alice:2")),
        ("alice", ("alice:4", "alice:5")),
        ("bob", ("bob:1", "bob:6")),  # waiting since before the shared batch
        ("", ("shared:3", "shared:7")),
        ("", ("carol:8", "carol:9")),  # max_adapters (2) reached: carol shares the policy
    ]
    assert await pending(redis, settings) == 0  # every sample trained once and acknowledged
    assert counter(trainer, "clawrl_trainer_tenant_overflow_samples_total") == 2
    assert counter(trainer, "clawrl_trainer_tenant_steps_total", tenant="alice") == 2
    assert counter(trainer, "clawrl_trainer_tenant_steps_total", tenant="shared") == 2
    # The dashboard's tenant row: samples, and each adapter's last step's reward and staleness
    # (alice's second step trained samples her v1 served on her v1; bob's one step on his v0).
    samples = [counter(trainer, "clawrl_trainer_tenant_samples_total", tenant=t)
               for t in ("alice", "bob", "shared")]  # fmt: skip
    assert samples == [4, 2, 4]
    assert counter(trainer, "clawrl_trainer_tenant_reward_mean", tenant="bob") == 0.5
    assert counter(trainer, "clawrl_trainer_tenant_reward_mean", tenant="alice") == 1.0
    assert counter(trainer, "clawrl_trainer_tenant_staleness_mean", tenant="alice") == 0
    assert counter(trainer, "clawrl_trainer_tenant_staleness_mean", tenant="bob") == 0

    tenants = tenant_versions_stream(settings.redis.versions_stream)
    assert await announced(redis, tenants) == [
        ("alice", 1, "tenant-alice-v1"),
        ("alice", 2, "tenant-alice-v2"),
        ("bob", 1, "tenant-bob-v1"),
    ]
    assert await announced(redis, settings.redis.versions_stream) == [
        ("", 1, "policy-v1"),
        ("", 2, "policy-v2"),
    ]
    for tenant, version in (("alice", 1), ("alice", 2), ("bob", 1)):
        exported = tmp_path / "policy" / f"tenant-{tenant}" / f"v{version}"
        assert (exported / "adapter_model.safetensors").is_file()
        assert (exported / "adapter_config.json").is_file()

    restarted = await start_trainer(settings, redis)
    assert restarted.state.tenant_versions == {"alice": 2, "bob": 1}
    assert restarted.state.policy_version == 2
    assert restarted.intake.queues.owners == {"alice", "bob"}
    version = "clawrl_trainer_tenant_policy_version"
    assert [counter(restarted, version, tenant=t) for t in ("alice", "bob")] == [2, 1]

    # `clawrl-trainer tenants` lists them from the newest durable state.
    assert tenant_rows(restarted.state, restarted.store) == [
        ("-", 2, 2, str(tmp_path / "policy" / "v2")),
        ("alice", 2, 2, str(tmp_path / "policy" / "tenant-alice" / "v2")),
        ("bob", 1, 1, str(tmp_path / "policy" / "tenant-bob" / "v1")),
    ]
    capsys.readouterr()
    main(["tenants", "--checkpoint-dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[:3] == ["alice", "2", "2"] and len(lines) == 4
