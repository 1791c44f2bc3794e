"""Engines that restarted lose their LoRA adapters: the launcher checks every few seconds that
each policy engine holds the adapter the gateways route to (the served version in Redis) and
loads it into one that lacks it. Until then the gateways answer that engine's requests with 503
and Retry-After (never from the base model)."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from clawrl.common.served import read_served
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.replicas import Engine, ReplicaError, engine_urls
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)


async def reconcile_adapters(
    settings: WeightSyncSettings, redis: Redis, metrics: WeightSyncMetrics
) -> int:
    """One pass; how many engines got the served adapter back."""
    if await redis.exists(settings.sync.lock_key):
        return 0  # a sync is changing the adapters; it leaves every engine with the new one
    try:
        served = await read_served(redis, settings.sync.served_key)
    except ValueError as exc:
        metrics.adapter_reloads.labels(outcome="failed").inc()
        log.error("cannot reconcile adapters: %s", exc)
        return 0
    if served is None or not served.adapter:
        return 0
    try:
        urls = await engine_urls(settings.engines)
    except (OSError, LookupError) as exc:
        metrics.adapter_reloads.labels(outcome="unreachable").inc()
        log.warning("cannot find the engines to reconcile adapters: %s", exc)
        return 0
    engines = [Engine(url, settings.engines) for url in urls]
    try:
        loaded = await asyncio.gather(
            *(ensure_adapter(engine, served.adapter, served.path, metrics) for engine in engines)
        )
    finally:
        await asyncio.gather(*(engine.close() for engine in engines), return_exceptions=True)
    return sum(loaded)


async def ensure_adapter(engine: Engine, name: str, path: str, metrics: WeightSyncMetrics) -> bool:
    """Load `name` into `engine` unless it holds it; True when it was loaded now."""
    try:
        held = await engine.adapters()
    except ReplicaError as exc:  # down or restarting: the next pass tries again
        metrics.adapter_reloads.labels(outcome="unreachable").inc()
        log.warning("%s", exc)
        return False
    if name in held:
        return False
    try:
        await engine.load_adapter(name, path)
    except ReplicaError as exc:
        metrics.adapter_reloads.labels(outcome="failed").inc()
        log.error("engine %s lacks the served adapter and did not load it: %s", engine.url, exc)
        return False
    metrics.adapter_reloads.labels(outcome="loaded").inc()
    log.warning("engine %s lacked the served adapter %s (restarted?): loaded it from %s",
                engine.url, name, path)  # fmt: skip
    return True


async def reconcile_forever(
    settings: WeightSyncSettings, redis: Redis, metrics: WeightSyncMetrics
) -> None:
    while True:
        try:
            await reconcile_adapters(settings, redis, metrics)
        except RedisError as exc:  # Redis down a moment: try again on the next pass
            metrics.adapter_reloads.labels(outcome="failed").inc()
            log.error("adapter reconciliation failed: %s", exc)
        await asyncio.sleep(settings.launcher.reconcile_interval_s)
