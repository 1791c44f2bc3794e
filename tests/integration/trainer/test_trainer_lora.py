"""The trainer with `[lora] enabled` on a real Redis and the tiny model: each version is a PEFT
adapter announced under its adapter name, a resume re-announces it as an adapter, and versions
an engine may still serve are never pruned."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from clawrl.common.versions import VersionReady, adapter_name, latest

from .helpers import make_sample, publish_all, settings_for, start_trainer
from .test_trainer_stream import one_step

pytestmark = pytest.mark.integration

LORA = {"enabled": True, "rank": 4, "alpha": 8}


@pytest.fixture
async def redis(redis_url: str):
    async with Redis.from_url(redis_url) as client:
        yield client


async def announcements(client: Redis, stream: str) -> list[VersionReady]:
    return [VersionReady.from_fields(fields) for _, fields in await client.xrange(stream)]


async def test_lora_versions_are_announced_as_adapters(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, lora=LORA, rollout={"rollout_batch_size": 1})
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample(f"a:{i}", [10 + i, 11]) for i in range(2)])
    await one_step(trainer)
    await one_step(trainer)
    stream = settings.redis.versions_stream
    ready = await announcements(redis, stream)
    assert [(r.version, r.adapter) for r in ready] == [(1, "policy-v1"), (2, "policy-v2")]
    for r in ready:
        names = {p.name for p in (tmp_path / "policy" / f"v{r.version}").iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names
        assert r.path == str((tmp_path / "policy" / f"v{r.version}").resolve())

    # A restart whose last announcement was lost announces the version again, as an adapter.
    await redis.delete(stream)
    restarted = await start_trainer(settings, redis)
    assert restarted.state.policy_version == 2
    again = await latest(redis, stream)
    assert (again.version, again.adapter) == (2, adapter_name(2))


async def test_full_weight_versions_name_no_adapter(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 1})
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample("a:0", [10, 11])])
    await one_step(trainer)
    ready = await latest(redis, settings.redis.versions_stream)
    assert (ready.version, ready.adapter, ready.is_adapter) == (1, "", False)
    assert (tmp_path / "policy" / "v1" / "model.safetensors").is_file()


async def test_exports_never_prune_what_engines_may_serve(redis, redis_url, tmp_path) -> None:
    # keep_versions 1 (max_staleness 0 allows it): exporting v{N} while v{N-1} is announced
    # (the engines serve it until the sync of v{N} is done) and v{N-2} is where a failed sync
    # rolls back to; both stay.
    settings = settings_for(redis_url, tmp_path,
                            rollout={"rollout_batch_size": 1, "max_staleness": 0},
                            checkpoint={"keep_versions": 1})  # fmt: skip
    trainer = await start_trainer(settings, redis)
    for i in range(4):  # each sample on the newest version (max_staleness 0)
        sample = make_sample(f"a:{i}", [10 + i, 11], policy_version=trainer.state.policy_version)
        await publish_all(redis, settings, [sample])
        await one_step(trainer)
    assert sorted(int(p.name[1:]) for p in (tmp_path / "policy").iterdir()) == [2, 3, 4]
