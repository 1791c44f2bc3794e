"""The trainer's delivery bounds on a real Redis with the tiny model: an entry held in a
half-filled batch is never re-claimed from itself, and a sample that kills the backend's
process (SIGKILL of the Ray actor, as a host OOM would) is isolated over restarts and
dead-lettered alone while the rest of its batch is trained exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import ray
from redis.asyncio import Redis

from clawrl.trainer.driver import ActorGroup, BackendLost
from clawrl.trainer.intake import Intake
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import build_trainer, make_consumer
from clawrl.trainer.torch_backend import TorchBackend

from .helpers import make_sample, pending, publish_all, settings_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_an_entry_held_in_a_half_filled_batch_is_not_claimed_again(
    redis, redis_url, tmp_path
) -> None:
    # Samples trickle in slower than claim_idle_ms: the first waits in the batch all along.
    settings = settings_for(redis_url, tmp_path, consumer={"claim_idle_ms": 50,
                                                           "max_deliveries": 2})  # fmt: skip
    consumer = make_consumer(settings, redis)
    await consumer.ensure_group()
    metrics = TrainerMetrics()
    intake = Intake(consumer, metrics, batch_size=4, max_staleness=4, vocab_size=49152,
                    max_length=2048)  # fmt: skip
    filling = asyncio.create_task(
        intake.next_batch(0, lambda _id: False, set(), asyncio.Event(), block_ms=20)
    )
    for i in range(4):
        await publish_all(redis, settings, [make_sample(f"slow{i}:0", [40 + i])])
        await asyncio.sleep(0.3)  # six claim_idle_ms
    collected = await asyncio.wait_for(filling, 10)
    assert [h.sample.sample_id for h in collected.held] == [f"slow{i}:0" for i in range(4)]
    assert collected.ack_with_step == []  # nothing re-read as its own duplicate
    duplicates = metrics.registry.get_sample_value(
        "clawrl_trainer_samples_dropped_total", {"reason": "duplicate"}
    )
    assert duplicates == 0
    assert await redis.xlen(settings.redis.deadletter_stream) == 0
    rows = await redis.xpending_range(settings.redis.samples_stream, "trainers", "-", "+", 10)
    assert [row["times_delivered"] for row in rows] == [1, 1, 1, 1]


class DiesOnPoison(TorchBackend):
    """The real backend, except that its process is SIGKILLed (as by the OOM killer) when it
    is given a batch holding a sample whose id starts with "poison"."""

    def compute_logprobs(self, batch, which):
        if any(sid.startswith("poison") for sid in batch.sample_ids):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().compute_logprobs(batch, which)


def poison_backend(settings) -> ActorGroup:
    # Sent to the actor's process by value: pytest's module name need not import there.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    remote = ray.remote(DiesOnPoison).options(
        num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
    )
    return ActorGroup([remote.remote(settings.train, settings.ppo, settings.model)])


async def train_until(trainer, redis, settings, trained: int) -> None:
    """Run the trainer until `trained` samples are in a durable state and nothing is pending
    (or the backend is lost: BackendLost propagates, as it ends the trainer process)."""
    stop = asyncio.Event()

    async def watch() -> None:
        while True:
            if trainer.state.samples_trained >= trained and await pending(redis, settings) == 0:
                stop.set()
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(trainer.run(stop), 120)
    finally:
        watcher.cancel()


@pytest.mark.slow
async def test_a_sample_that_kills_the_backend_is_dead_lettered_alone(
    redis, redis_url, tmp_path
) -> None:
    # Batches of 4, split from the first loss on (no whole-batch retry: one restart less).
    settings = settings_for(redis_url, tmp_path, consumer={"backend_loss_retries": 0})
    ids = ["a:0", "b:0", "poison:0", "c:0", "d:0", "e:0", "f:0", "g:0"]
    await publish_all(redis, settings, [make_sample(sid, [50 + i]) for i, sid in enumerate(ids)])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    losses = 0
    try:
        for _ in range(8):  # each pass is a restart of the trainer, as Kubernetes would
            trainer = await build_trainer(settings, poison_backend(settings), redis,
                                          TrainerMetrics())  # fmt: skip
            try:
                await train_until(trainer, redis, settings, trained=7)
                break
            except BackendLost:
                losses += 1
    finally:
        ray.shutdown()
    # [a b poison c]; [poison c] after [a b] trained; [poison] alone: then it is dead-lettered
    # and c trained alone, d..g together.
    assert losses == 3
    dead = await redis.xrange(settings.redis.deadletter_stream)
    assert [fields[b"id"] for _, fields in dead] == [b"poison:0"]
    reason = dead[0][1][b"reason"].decode()
    assert (
        reason
        == "the training backend was lost in 3 steps with this sample, the last with it alone"
    )
    state, _ = trainer.store.latest_state()
    assert sorted(state.trained_ids) == sorted(set(ids) - {"poison:0"})
    assert state.samples_trained == 7  # none trained twice
    assert state.step == 3  # [a b], [c], [d e f g]
    assert await pending(redis, settings) == 0
    assert await redis.exists(trainer.intake.unfinished.key) == 0  # nothing left counted
    dropped = trainer.metrics.registry.get_sample_value(
        "clawrl_trainer_samples_dropped_total", {"reason": "backend_lost"}
    )
    assert dropped == 1
