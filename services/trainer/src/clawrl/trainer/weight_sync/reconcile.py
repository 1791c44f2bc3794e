"""Engines that restarted lose their LoRA adapters: the launcher checks every few seconds that
each policy engine holds the adapter the gateways route to (the served version in Redis), and
every tenant's served adapter (per-tenant mode), and loads those it lacks. Until then the
gateways answer that engine's requests with 503 and Retry-After (never from the base model).

Full weights (and gateways under either): `divergence` says whether an engine serves other
weights than the served version (restarted on its base model, or left by a dead sync) or a
gateway admits another version; the launcher then syncs the served version again, which loads
the engines that need it and resumes every gateway on it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis

from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.served import Served, read_served, read_served_tenants
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.replicas import (
    Engine,
    Gateway,
    ReplicaError,
    engine_urls,
    gateway_addresses,
)
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)


# Whether a version of a tenant's adapter was released (reset or removed since): not served.
Released = Callable[[str, int], bool]


async def reconcile_adapters(
    settings: WeightSyncSettings,
    redis: Redis,
    metrics: WeightSyncMetrics,
    released: Released | None = None,
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
    wanted = []
    if settings.tenants.per_tenant:
        wanted = [
            (t.adapter, t.path)
            for tenant, t in (await read_served_tenants(redis, settings.sync.served_key)).items()
            # A de-selected tenant's is not served, nor a released one (a record a sync that
            # raced the release wrote back, until the launcher deletes it).
            if settings.tenants.owns_adapter(tenant)
            and not (released is not None and released(tenant, t.version))
        ]
    if served is not None and served.adapter:
        wanted.insert(0, (served.adapter, served.path))
    if not wanted:
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
            *(ensure_adapters(engine, wanted, metrics) for engine in engines)
        )
    finally:
        await asyncio.gather(*(engine.close() for engine in engines), return_exceptions=True)
    return sum(loaded)


async def ensure_adapters(
    engine: Engine, wanted: list[tuple[str, str]], metrics: WeightSyncMetrics
) -> int:
    """Load each (name, path) into `engine` unless it holds it; how many were loaded now."""
    try:
        held = await engine.adapters()
    except ReplicaError as exc:  # down or restarting: the next pass tries again
        metrics.adapter_reloads.labels(outcome="unreachable").inc()
        log.warning("%s", exc)
        return 0
    loaded = 0
    for name, path in wanted:
        if name in held:
            continue
        try:
            await engine.load_adapter(name, path)
        except ReplicaError as exc:
            metrics.adapter_reloads.labels(outcome="failed").inc()
            log.error("engine %s lacks the served adapter %s and did not load it: %s",
                      engine.url, name, exc)  # fmt: skip
            continue
        metrics.adapter_reloads.labels(outcome="loaded").inc()
        log.warning("engine %s lacked the served adapter %s (restarted?): loaded it from %s",
                    engine.url, name, path)  # fmt: skip
        loaded += 1
    return loaded


async def reconcile_forever(
    settings: WeightSyncSettings,
    redis: Redis,
    metrics: WeightSyncMetrics,
    released: Released | None = None,
) -> None:
    while True:
        try:
            await reconcile_adapters(settings, redis, metrics, released)
        # Redis down a moment (a cluster rebuilding its slot map included): the next pass.
        except REDIS_ERRORS as exc:
            metrics.adapter_reloads.labels(outcome="failed").inc()
            log.error("adapter reconciliation failed: %s", exc)
        await asyncio.sleep(settings.launcher.reconcile_interval_s)


async def divergence(settings: WeightSyncSettings, served: Served) -> str | None:
    """Why the replicas do not all serve `served` ("engines" or "gateways"), or None when they
    do (or when one cannot be asked: the next pass asks again). A paused gateway is left to
    its pause (its lease ends on the engines' version)."""
    try:
        urls = await engine_urls(settings.engines)
        addresses = await gateway_addresses(settings.gateways)
    except (OSError, LookupError) as exc:
        log.warning("cannot find the replicas to compare versions: %s", exc)
        return None
    engines = [Engine(url, settings.engines) for url in urls]
    gateways = [Gateway(address, settings.gateways, holder="") for address in addresses]
    try:
        if not served.adapter:
            weights = await asyncio.gather(
                *(engine.weights() for engine in engines), return_exceptions=True
            )
            if any(
                not isinstance(w, BaseException) and w.version != str(served.version)
                for w in weights
            ):
                return "engines"
        statuses = await asyncio.gather(
            *(gateway.status() for gateway in gateways), return_exceptions=True
        )
        if any(
            not isinstance(s, BaseException)
            and not s.paused
            and (s.policy_version, s.adapter) != (served.version, served.adapter)
            for s in statuses
        ):
            return "gateways"
        return None
    finally:
        await asyncio.gather(*(r.close() for r in [*engines, *gateways]), return_exceptions=True)


async def tenant_divergence(settings: WeightSyncSettings, served: dict[str, Served]) -> list[str]:
    """The tenants (of `served`, their served adapters) that some gateway does not route to
    their served adapter: one that a dead sync left behind. A gateway that cannot be asked is
    left to the next pass."""
    if not served:
        return []
    try:
        addresses = await gateway_addresses(settings.gateways)
    except (OSError, LookupError) as exc:
        log.warning("cannot find the gateways to compare tenants' adapters: %s", exc)
        return []
    gateways = [Gateway(address, settings.gateways, holder="") for address in addresses]
    try:
        statuses = await asyncio.gather(*(g.status() for g in gateways), return_exceptions=True)
    finally:
        await asyncio.gather(*(g.close() for g in gateways), return_exceptions=True)
    routed = [s.tenant_adapters for s in statuses if not isinstance(s, BaseException)]
    return sorted(
        tenant
        for tenant, mine in served.items()
        if any(adapters.get(tenant) != mine.adapter for adapters in routed)
    )
