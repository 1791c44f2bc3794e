"""Tenants' operations on a real Redis and the tiny model (issue 20): a restarted trainer
announces again each tenant's version whose announcement was lost; `clawrl-trainer tenants
reset T` makes T's adapter the shared policy's again (a new version, exported and announced,
applied once even across a restart); `clawrl-trainer tenants export T --out DIR` writes T's
newest version as a PEFT adapter directory."""

from __future__ import annotations

import asyncio

import pytest
import torch
from redis.asyncio import Redis
from safetensors.torch import load_file

from clawrl.common.tenants import tenant_versions_stream
from clawrl.trainer.main import main

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
    await publish_all(redis, settings, [
        make_sample(f"{t or 'shared'}:{i}", [10 + i, 11], tenant=t) for i, t in enumerate(order)
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

    # Reset through the CLI (flags and env as the trainer's): applied before the next step.
    monkeypatch.setenv("CLAWRL_TENANTS__MODE", "per_tenant")
    monkeypatch.setenv("CLAWRL_LORA__ENABLED", "true")
    monkeypatch.setenv("CLAWRL_REDIS__VERSIONS_STREAM", settings.redis.versions_stream)
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    flags = ["--redis-url", redis_url, "--checkpoint-dir", str(tmp_path / "ckpt")]

    def cli(*argv: str):  # in a thread, as in a process of its own: it runs its own loop
        return asyncio.to_thread(main, ["tenants", *argv, *flags])

    # Asked while the trainer waits for samples (none arrive), it is applied all the same: the
    # reset version's announcement is the next entry of the tenants' versions stream.
    [(last, _)] = await redis.xrevrange(stream, count=1)
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    await cli("reset", "alice")
    await cli("reset", "zed")  # no adapter of its own: counted, nothing done
    assert "reset of tenant alice requested" in capsys.readouterr().out
    async with asyncio.timeout(60):
        while not await redis.xread({stream: last}, block=1000):
            pass
    stop.set()
    await running
    assert trainer.state.tenant_versions["alice"] == 3
    assert same(weights(policies / "tenant-alice" / "v3"), shared_v1)
    assert (await announced(redis, stream))[-1] == ("alice", 3, "tenant-alice-v3")
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="reset") == 1
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="no_adapter") == 1
    # Applied once: the durable state records the request; a restart does not reset again.
    trainer = await start_trainer(settings, redis)
    await trainer.apply_resets()
    assert trainer.state.tenant_versions["alice"] == 3
    assert counter(trainer, "clawrl_trainer_tenant_resets_total", outcome="reset") == 0

    # Export: alice's newest version (v3, the reset one) as a flat PEFT directory.
    out = tmp_path / "alice-export"
    await cli("export", "alice", "--out", str(out))
    assert "exported tenant alice's version 3" in capsys.readouterr().out
    assert (out / "adapter_config.json").is_file() and same(weights(out), shared_v1)
    for argv, message in (
        (["export", "alice", "--out", str(out)], "is not an empty directory"),
        (["export", "bob", "--out", str(tmp_path / "b")], "tenants with one: alice"),
        (["reset", "no/such"], "is not a tenant id"),
    ):
        with pytest.raises(SystemExit) as exited:
            await cli(*argv)
        assert exited.value.code == 1
        assert message in capsys.readouterr().err
