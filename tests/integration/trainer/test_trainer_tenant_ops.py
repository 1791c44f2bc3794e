"""Tenants' operations on a real Redis and the tiny model (issue 20): a restarted trainer
announces again each tenant's version whose announcement was lost; `clawrl-trainer tenants
export T --out DIR` writes T's newest version as a PEFT adapter directory; `clawrl-trainer
tenants reset T` drops T's adapter (issue 30: its slot freed, its served record deleted, its
version floor past every version it had, the release announced for the launcher to unroute T;
applied once even across a restart, which announces no version below the floor again)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from redis.asyncio import Redis
from safetensors.torch import load_file

from clawrl.common.served import read_served_tenants, write_served_tenant
from clawrl.common.tenants import tenant_versions_stream
from clawrl.common.versions import TenantReleased, tenant_entry
from clawrl.trainer.main import main
from tests.conftest import wait_until

from .helpers import counter, make_sample, publish_all, settings_for, start_trainer
from .test_trainer_tenants import SECTIONS, announced, tenant_step

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str):
    async with Redis.from_url(redis_url) as client:
        yield client


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_resume_reannounces_and_reset_and_export_work(
    redis, redis_url, tmp_path, monkeypatch, capsys
) -> None:
    settings = settings_for(redis_url, tmp_path / "ckpt", **SECTIONS)
    trainer = await start_trainer(settings, redis)
    order = ["alice", "alice", "alice", "alice", "", ""]
    # alice's turns 2 and 3 come once her v1 serves her.
    served = {2: "tenant-alice-v1", 3: "tenant-alice-v1"}
    await publish_all(redis, settings, [
        make_sample(f"{t or 'shared'}:{i}", [10 + i, 11], tenant=t,
                    weight_version=served.get(i, ""), policy_version=1 if i in served else 0)
        for i, t in enumerate(order)
    ])  # fmt: skip
    steps = [(await tenant_step(trainer))[0] for _ in range(3)]
    assert steps == ["alice", "alice", ""]
    policies = tmp_path / "ckpt" / "policy"
    alice_v2, shared_v1 = weights(policies / "tenant-alice" / "v2"), weights(policies / "v1")
    assert not same(alice_v2, shared_v1)

    # The announcement of alice's v2 is lost (the trainer died after its durable state):
    # the restart announces it again, and nothing that was announced.
    stream = tenant_versions_stream(settings.redis.versions_stream)
    [(newest, _)] = await redis.xrevrange(stream, count=1)
    await redis.xdel(stream, newest)
    assert await announced(redis, stream) == [("alice", 1, "tenant-alice-v1")]
    trainer = await start_trainer(settings, redis)
    assert await announced(redis, stream) == [
        ("alice", 1, "tenant-alice-v1"),
        ("alice", 2, "tenant-alice-v2"),
    ]

    # Export (flags and env as the trainer's): alice's newest version as a flat PEFT directory.
    monkeypatch.setenv("CLAWRL_TENANTS__MODE", "per_tenant")
    monkeypatch.setenv("CLAWRL_LORA__ENABLED", "true")
    monkeypatch.setenv("CLAWRL_REDIS__VERSIONS_STREAM", settings.redis.versions_stream)
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    flags = ["--redis-url", redis_url, "--checkpoint-dir", str(tmp_path / "ckpt")]

    def cli(*argv: str):  # in a thread, as in a process of its own: it runs its own loop
        return asyncio.to_thread(main, ["tenants", *argv, *flags])

    out = tmp_path / "alice-export"
    await cli("export", "alice", "--out", str(out))
    assert "exported tenant alice's version 2" in capsys.readouterr().out
    assert (out / "adapter_config.json").is_file() and same(weights(out), alice_v2)
    with pytest.raises(SystemExit) as exited:
        await cli("export", "alice", "--out", str(out))
    assert exited.value.code == 1 and "is not an empty directory" in capsys.readouterr().err

    # Reset through the CLI, asked while the trainer waits for samples (none arrive): applied
    # all the same, within a read.
    served_key = settings.sync.served_key
    await write_served_tenant(redis, served_key, "alice", 2, "tenant-alice-v2", "/x")
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    await cli("reset", "alice")
    await cli("reset", "zed")  # no adapter of its own: counted, nothing done
    assert "reset of tenant alice requested" in capsys.readouterr().out

    def applied() -> bool:  # both requests (they are applied in order)
        return counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="no_adapter") == 1

    await asyncio.to_thread(wait_until, applied, 60, "the resets applied")
    stop.set()
    await running
    # Her adapter is gone (slot freed, nothing announced), her versions go on from 3.
    assert "alice" not in trainer.state.tenant_steps and not trainer.intake.queues.owners
    assert trainer.state.tenant_floors["alice"] == 3
    assert await read_served_tenants(redis, served_key) == {}
    assert (await announced(redis, stream))[-1] == ("alice", 2, "tenant-alice-v2")
    # The release is announced beside her versions: the launcher unroutes her from the running
    # gateways and never syncs a version below the floor.
    [(release_id, last)] = await redis.xrevrange(stream, count=1)
    released = tenant_entry(last)
    assert isinstance(released, TenantReleased)
    assert (released.tenant, released.floor, released.action) == ("alice", 3, "reset")
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="reset") == 1
    # Applied once: the durable state records the request and the floor; a restart keeps both,
    # and does not announce again a version below the floor (her v2's announcement lost).
    [(v2_id, _)] = [(i, f) for i, f in await redis.xrange(stream) if i != release_id][-1:]
    await redis.xdel(stream, v2_id)
    trainer = await start_trainer(settings, redis)
    assert await announced(redis, stream) == [("alice", 1, "tenant-alice-v1")]
    await trainer.apply_resets()
    assert trainer.state.tenant_floors == {"alice": 3}
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="reset") == 0

    # Her old versions are no longer hers to export; bad requests are refused.
    for argv, message in (
        (["export", "alice", "--out", str(tmp_path / "a")], "tenants with one: none"),
        (["reset", "no/such"], "is not a tenant id"),
    ):
        with pytest.raises(SystemExit) as exited:
            await cli(*argv)
        assert exited.value.code == 1
        assert message in capsys.readouterr().err
