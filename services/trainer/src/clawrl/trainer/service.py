"""The trainer service's lifespan: build every client once, resume, train until told to stop.

Ray (local runtime or the cluster) -> backend actors, loaded -> Redis, consumer group ->
checkpoint store -> Trainer.resume() -> background tasks -> Trainer.run() until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import start_http_server
from redis.asyncio import Redis

from clawrl.common import redis_client
from clawrl.common.models import context_length, resolve_model_dir
from clawrl.common.streams import GroupConsumer, ShardedConsumer, consumer_over
from clawrl.trainer.checkpoints import CheckpointStore
from clawrl.trainer.driver import BackendHandle, connect, start_backend
from clawrl.trainer.intake import Intake
from clawrl.trainer.megatron.broadcast_sync import BroadcastSync
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.settings import TrainerSettings
from clawrl.trainer.training import Trainer
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics

log = logging.getLogger(__name__)

# A task the trainer runs next to its loop (e.g. the weight-sync launcher, which follows the
# versions stream); it gets the settings, the Redis client and the stop event.
BackgroundTask = Callable[[TrainerSettings, Redis, asyncio.Event], Awaitable[None]]


def make_consumer(settings: TrainerSettings, redis: Redis) -> GroupConsumer | ShardedConsumer:
    """The trainer's consumer of the samples stream: of every shard, when it is sharded."""
    c = settings.consumer
    return consumer_over(
        redis,
        settings.redis.shards(),
        stream=settings.redis.samples_stream,
        group=c.group,
        consumer=c.name,
        deadletter_stream=settings.redis.deadletter_stream,
        max_deliveries=c.max_deliveries,
        claim_idle_ms=c.claim_idle_ms,
    )


async def build_trainer(
    settings: TrainerSettings,
    backend: BackendHandle,
    redis: Redis,
    metrics: TrainerMetrics,
    stop: asyncio.Event | None = None,
) -> Trainer:
    """Load the backend, join the consumer group, resume from the newest durable state (Redis
    away: waiting for it, until `stop` is set)."""
    model_dir = resolve_model_dir(settings.model)
    await backend.call("load", model_dir, load_reference=settings.ppo.kl_coef > 0)
    consumer = make_consumer(settings, redis)
    intake = Intake(
        consumer,
        metrics,
        batch_size=settings.rollout.rollout_batch_size,
        max_staleness=settings.rollout.max_staleness,
        vocab_size=await backend.call("vocab_size"),
        max_length=context_length(settings.model, model_dir),
        loss_retries=settings.consumer.backend_loss_retries,
        estimator=settings.advantage.estimator,
        tenants=settings.tenants,
    )
    store = CheckpointStore(settings.checkpoint)
    sync = None
    if settings.weight_sync.transport == "nccl":  # the trainer syncs; no launcher runs
        sync = BroadcastSync(settings, backend, redis, WeightSyncMetrics(metrics.registry))
    trainer = Trainer(settings, backend, intake, consumer, store, redis, metrics, sync, stop)
    await trainer.resume()
    return trainer


async def serve(
    settings: TrainerSettings, stop: asyncio.Event, background: Sequence[BackgroundTask] = ()
) -> None:
    """Run the trainer until `stop` is set (the step in progress commits first)."""
    metrics = TrainerMetrics()
    server, _thread = start_http_server(
        settings.server.metrics_port, addr=settings.server.host, registry=metrics.registry
    )
    log.info("metrics on http://%s:%d/metrics", settings.server.host, server.server_port)
    connect(settings.ray)
    # Reads block up to block_ms: the socket must wait longer than that.
    timeout_s = settings.redis.socket_timeout_s + settings.consumer.block_ms / 1000
    redis = redis_client.connect(settings.redis, socket_timeout=timeout_s)
    tasks: list[asyncio.Task] = []
    try:
        backend = start_backend(settings)
        trainer = await build_trainer(settings, backend, redis, metrics, stop)
        tasks = [asyncio.create_task(task(settings, redis, stop)) for task in background]
        log.info("training: %d samples per step from %s (group %s)",
                 settings.rollout.rollout_batch_size, settings.redis.samples_stream,
                 settings.consumer.group)  # fmt: skip
        await trainer.run(stop)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await redis.aclose()
        server.shutdown()
