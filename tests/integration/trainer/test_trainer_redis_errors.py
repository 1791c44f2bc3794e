"""Redis failing while the trainer fills a batch (a failover, a Redis Cluster client rebuilding
its slot map) costs a pause, not a restart of the trainer and its backend, and loses nothing:
what the intake had read goes back in front of its backlog, and the next batch holds it."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from clawrl.common.tenants import TenantSettings
from clawrl.common.versions import VersionReady
from clawrl.trainer import training
from clawrl.trainer.intake import Intake
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.service import make_consumer
from tests.conftest import free_port, start_redis

from .helpers import counter, make_sample, pending, publish_all, settings_for, start_trainer

pytestmark = pytest.mark.integration

SLOTS_MOVING = RedisClusterException("All slots are not covered after query all startup_nodes.")


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def failing(method, calls: set[int], error: Exception):
    """`method`, raising `error` on the calls numbered in `calls` (1 = the first)."""
    made = 0

    async def call(*args, **kwargs):
        nonlocal made
        made += 1
        if made in calls:
            raise error
        return await method(*args, **kwargs)

    return call


async def make_intake(redis, redis_url, tmp_path):
    settings = settings_for(redis_url, tmp_path)
    consumer = make_consumer(settings, redis)
    await consumer.ensure_group()
    intake = Intake(consumer, TrainerMetrics(), batch_size=4, max_staleness=4,
                    vocab_size=49152, max_length=2048)  # fmt: skip
    return settings, intake


async def run_until_trained(trainer, redis, settings, samples: int) -> None:
    """Run the trainer until it has trained `samples` and nothing is pending (then stop it);
    up to 120 s (a loaded host)."""
    stop = asyncio.Event()

    async def watch() -> None:
        for _ in range(1200):
            if trainer.state.samples_trained >= samples and not await pending(redis, settings):
                break
            await asyncio.sleep(0.1)
        stop.set()

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(trainer.run(stop), 120)
    finally:
        watcher.cancel()


async def next_batch(intake: Intake):
    taking = intake.next_batch(0, lambda _id: False, set(), asyncio.Event(), block_ms=20)
    return await asyncio.wait_for(taking, 20)  # before: waited for entries it had lost


async def test_entries_read_before_redis_failed_come_back(redis, redis_url, tmp_path) -> None:
    settings, intake = await make_intake(redis, redis_url, tmp_path)
    await publish_all(redis, settings, [make_sample(f"s{i}:0", [40 + i]) for i in range(6)])
    # The read went through; the look-up of their lost steps, right after it, did not.
    intake.unfinished.counts = failing(intake.unfinished.counts, {1}, SLOTS_MOVING)
    with pytest.raises(RedisClusterException):
        await next_batch(intake)
    first = await next_batch(intake)
    assert [h.sample.sample_id for h in first.held] == ["s0:0", "s1:0", "s2:0", "s3:0"]
    await publish_all(redis, settings, [make_sample(f"s{i}:0", [40 + i]) for i in (6, 7)])
    second = await next_batch(intake)
    assert [h.sample.sample_id for h in second.held] == ["s4:0", "s5:0", "s6:0", "s7:0"]
    assert first.ack_with_step == second.ack_with_step == []  # none taken for a duplicate


async def test_a_half_filled_batch_survives_a_failed_read(redis, redis_url, tmp_path) -> None:
    settings, intake = await make_intake(redis, redis_url, tmp_path)
    await publish_all(redis, settings, [make_sample(f"h{i}:0", [40 + i]) for i in range(2)])
    # Two entries read into the batch, then the read for the other two fails.
    intake.consumer.read = failing(intake.consumer.read, {2}, RedisConnectionError("reset"))
    with pytest.raises(RedisConnectionError):
        await next_batch(intake)
    await publish_all(redis, settings, [make_sample(f"h{i}:0", [40 + i]) for i in (2, 3)])
    collected = await next_batch(intake)
    assert [h.sample.sample_id for h in collected.held] == ["h0:0", "h1:0", "h2:0", "h3:0"]


async def test_a_tenant_batch_survives_a_failed_read(redis, redis_url, tmp_path) -> None:
    """Per tenant: the entries read go back too, and queue for their adapters next time."""
    settings = settings_for(redis_url, tmp_path)
    consumer = make_consumer(settings, redis)
    await consumer.ensure_group()
    tenants = TenantSettings(mode="per_tenant", min_samples_per_step=2, max_adapters=2)
    intake = Intake(consumer, TrainerMetrics(), batch_size=2, max_staleness=4, vocab_size=49152,
                    max_length=2048, tenants=tenants)  # fmt: skip
    order = ["alice", "bob", "alice"]
    samples = [make_sample(f"{t}:{i}", [40 + i], tenant=t) for i, t in enumerate(order)]
    await publish_all(redis, settings, samples)
    intake.unfinished.counts = failing(intake.unfinished.counts, {1}, SLOTS_MOVING)
    with pytest.raises(RedisClusterException):
        await next_batch(intake)
    collected = await next_batch(intake)
    assert collected.tenant == "alice"
    assert [h.sample.sample_id for h in collected.held] == ["alice:0", "alice:2"]


async def test_an_entry_whose_drop_failed_is_dropped_again(redis, redis_url, tmp_path) -> None:
    """A sample of a tenant no longer selected is dropped (acknowledged); when that
    acknowledgement fails, the entry is read again, not left held until a restart."""
    settings = settings_for(redis_url, tmp_path)
    consumer = make_consumer(settings, redis)
    await consumer.ensure_group()
    tenants = TenantSettings(mode="per_tenant", min_samples_per_step=2, allow=["alice"])
    intake = Intake(consumer, TrainerMetrics(), batch_size=2, max_staleness=4, vocab_size=49152,
                    max_length=2048, tenants=tenants)  # fmt: skip
    samples = [
        make_sample("bob:0", [40], tenant="bob", weight_version="tenant-bob-v1"),  # unrouted
        make_sample("alice:1", [41], tenant="alice"),
        make_sample("alice:2", [42], tenant="alice"),
    ]
    await publish_all(redis, settings, samples)
    consumer.ack = failing(consumer.ack, {1}, RedisConnectionError("reset"))
    with pytest.raises(RedisConnectionError):
        await next_batch(intake)
    collected = await next_batch(intake)
    assert [h.sample.sample_id for h in collected.held] == ["alice:1", "alice:2"]
    assert await pending(redis, settings) == 2  # bob's entry was acknowledged
    dropped = intake.metrics.samples_dropped.labels("tenant_unrouted")._value.get()
    assert dropped == 1  # once: the try whose acknowledgement failed is not counted


async def test_the_trainer_reads_again_after_redis_failed(
    redis, redis_url, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(training, "REDIS_RETRY_S", (0.05, 0.2))
    settings = settings_for(redis_url, tmp_path)
    await publish_all(redis, settings, [make_sample(f"r{i}:0", [50 + i]) for i in range(8)])
    trainer = await start_trainer(settings, redis)
    consumer = trainer.intake.consumer
    consumer.read = failing(consumer.read, {1, 2}, SLOTS_MOVING)  # down for two reads
    await run_until_trained(trainer, redis, settings, 8)  # before: RedisClusterException
    assert trainer.state.samples_trained == 8
    assert counter(trainer, "clawrl_trainer_redis_errors_total", stage="intake") == 2
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="duplicate") == 0


async def test_a_steps_own_redis_calls_are_made_again(
    redis, redis_url, tmp_path, monkeypatch
) -> None:
    """Redis failing inside a step (its unfinished-step counts, the read of the announced
    version, the acknowledgement of its durable state, the announcement) costs a pause: the
    same trainer and backend go on, train every sample once and announce each version once."""
    monkeypatch.setattr(training, "REDIS_RETRY_S", (0.05, 0.2))
    reset = RedisConnectionError("reset")
    settings = settings_for(redis_url, tmp_path, checkpoint={"sync_interval": 1})
    await publish_all(redis, settings, [make_sample(f"c{i}:0", [60 + i]) for i in range(8)])
    trainer = await start_trainer(settings, redis)
    unfinished = trainer.intake.unfinished
    unfinished.begin = failing(unfinished.begin, {1}, reset)
    unfinished.finish = failing(unfinished.finish, {2}, SLOTS_MOVING)
    trainer.consumer.ack = failing(trainer.consumer.ack, {1, 2}, reset)
    monkeypatch.setattr(training, "latest", failing(training.latest, {1}, reset))
    monkeypatch.setattr(training, "announce", failing(training.announce, {2}, SLOTS_MOVING))
    await run_until_trained(trainer, redis, settings, 8)  # before: ConnectionError
    assert trainer.state.samples_trained == 8 and trainer.state.policy_version == 2
    assert await pending(redis, settings) == 0
    announced = [VersionReady.from_fields(f).version
                 for _, f in await redis.xrange(settings.redis.versions_stream)]  # fmt: skip
    assert announced == [1, 2]
    errors = {stage: counter(trainer, "clawrl_trainer_redis_errors_total", stage=stage)
              for stage in ("step", "export", "commit", "announce")}  # fmt: skip
    assert errors == {"step": 2, "export": 1, "commit": 2, "announce": 1}
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="duplicate") == 0


async def errors_at_least(metrics: TrainerMetrics, stage: str, count: int) -> None:
    """Wait (up to 120 s: a loaded host) until `count` Redis errors of `stage` were counted."""
    for _ in range(1200):
        if (metrics.registry.get_sample_value(
                "clawrl_trainer_redis_errors_total", {"stage": stage}) or 0) >= count:  # fmt: skip
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {count} Redis errors at stage {stage}")


async def test_a_trainer_that_starts_before_redis_waits_for_it(
    log_dir, tmp_path, monkeypatch
) -> None:
    """Redis not answering yet when the trainer starts (its pod scheduled first, `make run`
    on a slow host): the trainer waits for it with its backend loaded, then trains."""
    monkeypatch.setattr(training, "REDIS_RETRY_S", (0.05, 0.2))
    port = free_port()
    settings = settings_for(f"redis://127.0.0.1:{port}/0", tmp_path)
    redis, metrics = Redis.from_url(settings.redis.url), TrainerMetrics()
    starting = asyncio.create_task(start_trainer(settings, redis, metrics))
    try:
        await errors_at_least(metrics, "resume", 2)  # before: the start-up failed at once
        assert not starting.done()
        child = start_redis(port, log_dir, name="redis-late")
        try:
            trainer = await asyncio.wait_for(starting, 60)
            await publish_all(redis, settings, [make_sample(f"l{i}:0", [80 + i]) for i in range(4)])
            await run_until_trained(trainer, redis, settings, 4)
            assert trainer.state.samples_trained == 4 and trainer.state.policy_version == 1
        finally:
            child.stop()
    finally:
        starting.cancel()
        await redis.aclose()


async def test_a_trainer_stopped_while_waiting_for_redis_at_start_ends(
    tmp_path, monkeypatch
) -> None:
    """SIGTERM while the trainer waits for Redis at start-up: the wait ends at once (the error
    goes up, and the service exits)."""
    monkeypatch.setattr(training, "REDIS_RETRY_S", (0.05, 0.2))
    settings = settings_for(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    redis, metrics, stop = Redis.from_url(settings.redis.url), TrainerMetrics(), asyncio.Event()
    starting = asyncio.create_task(start_trainer(settings, redis, metrics, stop))
    try:
        await errors_at_least(metrics, "resume", 2)
        stop.set()
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(starting, 10)
    finally:
        starting.cancel()
        await redis.aclose()


async def test_a_stopping_trainer_gives_up_on_redis(
    redis, redis_url, tmp_path, monkeypatch
) -> None:
    """Redis down for good while a step commits: the trainer keeps trying until it is told to
    stop, then the error goes up at once (the restart replays from its durable state), the
    step's entries still pending."""
    monkeypatch.setattr(training, "REDIS_RETRY_S", (0.05, 0.2))
    settings = settings_for(redis_url, tmp_path)
    await publish_all(redis, settings, [make_sample(f"d{i}:0", [70 + i]) for i in range(4)])
    trainer = await start_trainer(settings, redis)
    trainer.consumer.ack = failing(trainer.consumer.ack, set(range(1, 10_000)), SLOTS_MOVING)
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    await errors_at_least(trainer.metrics, "commit", 3)
    assert not running.done()  # still trying
    stop.set()
    with pytest.raises(RedisClusterException):
        await asyncio.wait_for(running, 10)
    assert trainer.state.samples_trained == 4 and await pending(redis, settings) == 4
