"""The trainer's own weight sync (`weight_sync.transport = nccl`) with the Megatron backend (a Ray
actor, gloo) against two real gateway replicas in front of the CPU engine, and three engines in
the broadcast group: two recording engines (they can refuse on demand) and the CPU engine.
After each exported step: the gateways are paused while rank 0 broadcasts, every tensor of the
export arrives, the gateways resume with N. A refused broadcast falls back to loading N from
disk; when that fails too, every engine is rolled back and the gateways stay on the old
version; the next sync forms a fresh group and broadcasts again. At resume the trainer syncs
its version from disk, and the CPU engine then serves exactly what it served after the
broadcast."""

from __future__ import annotations

import uuid

import httpx
import pytest
import ray
from redis.asyncio import Redis

from clawrl.engine.cpu.runner import read_checkpoint
from clawrl.trainer.driver import start_backend
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import build_trainer
from clawrl.trainer.weight_sync.job import SyncResult
from tests.integration.megatron.recording_engine import recording_engines
from tests.integration.trainer.helpers import counter, make_sample, publish_all, settings_for
from tests.integration.trainer.test_trainer_stream import one_step
from tests.integration.weight_sync.conftest import engine, replicas, tiny_dir  # noqa: F401
from tests.integration.weight_sync.test_weight_sync_job import engine_weights

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def recording(log_dir):
    with recording_engines(2, log_dir) as urls:
        yield urls


def post(url: str, path: str, body: dict) -> None:
    httpx.post(url + path, json=body, timeout=10).raise_for_status()


def recorded(url: str) -> list[dict]:
    return httpx.get(url + "/recorded", timeout=10).json()


def weight_version(url: str) -> str:
    return httpx.get(url + "/get_model_info", timeout=10).json()["weight_version"]


async def test_the_trainer_syncs_each_version_by_broadcast_with_disk_as_fallback(
    replicas,  # noqa: F811
    engine,  # noqa: F811
    recording,
    redis_url,
    tmp_path,
):
    engines = [*recording, engine]
    tag = uuid.uuid4().hex[:8]
    redis = Redis.from_url(redis_url)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        settings = settings_for(
            redis_url, tmp_path, train={"backend": "megatron", "device": "cpu"},
            weight_sync={"transport": "nccl", "master_address": "127.0.0.1",
                         "bucket_mb": 1, "timeout_s": 60},
            gateways={"addresses": [r.control for r in replicas]}, engines={"urls": engines},
            sync={"lock_key": f"test:{tag}:lock", "results_stream": f"test:{tag}:syncs"},
        )  # fmt: skip
        trainer = await build_trainer(settings, start_backend(settings), redis, TrainerMetrics())
        # What the gateways say while the broadcast runs.
        during: list[list[tuple[bool, str]]] = []
        broadcast = trainer.sync.broadcast

        async def observed(ready, engine_urls):
            during.append([(s.paused, s.holder) for s in (r.status() for r in replicas)])
            await broadcast(ready, engine_urls)

        trainer.sync.broadcast = observed

        async def step(version: int) -> SyncResult:
            samples = [make_sample(f"s{version}:{i}", [40 + i, 50 + i], reward=(-1) ** i)
                       for i in range(4)]  # fmt: skip
            await publish_all(redis, settings, samples)
            report = await one_step(trainer)
            assert report.exported and report.policy_version == version
            entries = await redis.xrange(settings.sync.results_stream)
            return SyncResult.from_fields(entries[-1][1])

        def gateways() -> list[tuple[bool, int]]:
            return [(s.paused, s.policy_version) for s in (r.status() for r in replicas)]

        # v1: broadcast while both gateways are paused by this sync, then resumed with 1.
        result = await step(1)
        assert (result.outcome, result.transport, result.broadcast_error) == ("ok", "nccl", "")
        assert (result.gateways, result.engines) == (2, 3)
        [paused] = during
        assert [p for p, _ in paused] == [True, True]
        assert all(holder.startswith("trainer-v1-") for _, holder in paused)
        assert gateways() == [(False, 1), (False, 1)]
        export = trainer.store.policies / "v1"
        expected = {n: float(t.double().sum()) for n, t in read_checkpoint(export).items()}
        for rank_offset, url in zip([1, 2], recording, strict=True):
            init, *updates = recorded(url)
            assert init["body"]["rank_offset"] == rank_offset
            assert init["body"]["world_size"] == 4 and init["body"]["backend"] == "gloo"
            assert len(updates) > 1  # 1 MiB buckets
            assert [c["body"].get("weight_version") for c in updates][-1] == "1"
            received = {n: s for c in updates
                        for n, s in zip(c["body"]["names"], c["sums"], strict=True)}  # fmt: skip
            assert received.keys() == expected.keys()
            assert [received[n] for n in expected] == pytest.approx(
                [expected[n] for n in expected], rel=1e-9)  # fmt: skip
        assert [weight_version(url) for url in engines] == ["1", "1", "1"]

        # v2: one engine refuses the broadcast -> all load v2 from disk; the sync succeeds.
        post(recording[1], "/refuse", {"distributed": True})
        result = await step(2)
        assert (result.outcome, result.transport) == ("ok", "disk")
        assert "refused (test)" in result.broadcast_error
        assert "loaded from disk" in result.reason
        v2 = str(trainer.store.announced_path(trainer.store.policies / "v2"))
        for url in recording:
            assert recorded(url)[-1] == {"path": "/update_weights_from_disk", "body": {
                "model_path": v2, "weight_version": "2", "flush_cache": True}}  # fmt: skip
        assert [weight_version(url) for url in engines] == ["2", "2", "2"]
        assert gateways() == [(False, 2), (False, 2)]

        # v3: the broadcast fails and so does a disk load -> every engine goes back to v2
        # (after a failed broadcast any of them may hold part of v3); gateways stay on 2.
        post(recording[0], "/refuse", {"distributed": True})
        post(recording[1], "/refuse", {"disk": "v3"})
        result = await step(3)
        assert result.outcome == "failed"
        assert "refused (test)" in result.broadcast_error
        assert "rolled 3 updated engine(s) back" in result.reason
        for url in recording:
            loads = [c["body"] for c in recorded(url)[-2:]]
            assert [(b["model_path"].rsplit("/", 1)[-1], b["weight_version"])
                    for b in loads] == [("v3", "3"), ("v2", "2")]  # fmt: skip
        assert [weight_version(url) for url in engines] == ["2", "2", "2"]
        assert gateways() == [(False, 2), (False, 2)]

        # v4: refusals lifted -> a fresh group (new name) and a broadcast again.
        for url in recording:
            post(url, "/refuse", {})
        result = await step(4)
        assert (result.outcome, result.transport) == ("ok", "nccl")
        assert gateways() == [(False, 4), (False, 4)]
        by_broadcast = engine_weights(engine)
        assert by_broadcast[0] == "4"
        inits = [c["body"]["group_name"] for c in recorded(recording[0])
                 if c["path"] == "/init_weights_update_group"]  # fmt: skip
        assert len(inits) == len(set(inits)) == 3  # v1 (kept for v2), v3, v4
        assert len(during) == 4
        assert all([p for p, _ in paused] == [True, True] for paused in during)

        metric = trainer.sync.metrics.registry.get_sample_value
        assert metric("clawrl_weight_sync_syncs_total", {"outcome": "ok"}) == 3
        assert metric("clawrl_weight_sync_syncs_total", {"outcome": "failed"}) == 1
        assert metric("clawrl_weight_sync_broadcast_fallbacks_total") == 2
        assert counter(trainer, "clawrl_weight_sync_policy_version") == 4

        # An engine restarted on its initial weights: at resume the trainer syncs v4 to every
        # engine from disk (its backend may hold weights newer than the export).
        post(recording[0], "/update_weights_from_disk", {"model_path": "initial",
                                                      "weight_version": "0"})  # fmt: skip
        await trainer.resume()
        entries = await redis.xrange(settings.sync.results_stream)
        result = SyncResult.from_fields(entries[-1][1])
        assert (result.version, result.outcome, result.transport) == (4, "ok", "disk")
        assert result.broadcast_error == "" and len(during) == 4
        assert [weight_version(url) for url in engines] == ["4", "4", "4"]
        assert gateways() == [(False, 4), (False, 4)]
        # The CPU engine serves from the export on disk exactly what it served after the
        # broadcast (a fingerprint of its weights: greedy log-probs).
        assert engine_weights(engine) == by_broadcast
    finally:
        ray.shutdown()
        await redis.aclose()
        # The other tests of this CPU engine expect its initial weights.
        post(engine, "/update_weights_from_disk", {"model_path": str(tiny_dir()),
                                                   "weight_version": "0"})  # fmt: skip
