"""Unrouting tenants (per-tenant mode): a gateway must stop routing a tenant to an adapter of its
own once the trainer released it (`clawrl-trainer tenants reset|remove`: the adapter is dropped,
and samples its versions below the tenant's new floor serve are dropped) or once the tenant is
taken out of `[tenants] allow`/`pattern`. A gateway that starts never routes it (its served
record is deleted, or it is not selected); one already running is told here: SwitchAdapter with
the tenant and no adapter, after which the shared policy serves the tenant and its turns record
the shared version.

The launcher reads each release (`TenantReleased`, with the floor) on the tenants' versions
stream, in order with the versions. It unroutes the tenant at once, retried like a sync
(`max_attempts`, `retry_backoff_s`), then unloads the released adapters from the engines once no
request uses them. Every reconcile_interval_s it also unroutes whatever a gateway still routes
that way (one unreachable before; a tenant de-selected while the gateway ran). A gateway that
routes a tenant to a version at or past its floor (its new adapter after a reset) is left as it
is, so a release read again (a restarted launcher reads the stream from its start) changes
nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis

from clawrl.common.served import delete_served_tenant, read_served_tenants
from clawrl.common.tenants import parse_tenant_adapter
from clawrl.trainer.weight_sync.adapter_sync import AdapterSync
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.replicas import (
    Engine,
    Gateway,
    ReplicaError,
    engine_urls,
    gateway_addresses,
)
from clawrl.trainer.weight_sync.result import SyncResult
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)


@dataclass
class Unrouter:
    """Tells the gateways which tenants to route to the shared policy again."""

    settings: WeightSyncSettings
    redis: Redis
    metrics: WeightSyncMetrics
    # Per tenant, the first version of its current adapter (from the releases read).
    floors: dict[str, int] = field(default_factory=dict)

    def released(self, tenant: str, version: int) -> bool:
        """Whether `version` of `tenant`'s adapter was released (reset or removed since)."""
        return version < self.floors.get(tenant, 1)

    def stray(self, tenant: str, adapter: str) -> bool:
        """Whether no gateway may route `tenant` to `adapter`: the tenant is not selected, or
        the adapter is one of its released versions."""
        if not self.settings.tenants.owns_adapter(tenant):
            return True
        parsed = parse_tenant_adapter(adapter)
        return parsed is not None and parsed[0] == tenant and self.released(tenant, parsed[1])

    async def unroute(self, only: str | None = None) -> bool:
        """One pass: each gateway unroutes every tenant (`only`: that one) it routes although
        it must not; True when every gateway answered and did, False to try again. A served
        record of a released version (written back by a sync that raced the release) is
        deleted first, so that no gateway that starts routes it again."""
        for tenant, mine in (
            await read_served_tenants(self.redis, self.settings.sync.served_key)
        ).items():
            if (only is None or tenant == only) and self.released(tenant, mine.version):
                await delete_served_tenant(self.redis, self.settings.sync.served_key, tenant)
                log.warning("deleted the served record of tenant %s's released adapter %s",
                            tenant, mine.adapter)  # fmt: skip
        try:
            addresses = await gateway_addresses(self.settings.gateways)
        except (OSError, LookupError) as exc:
            log.warning("cannot find the gateways to unroute tenants: %s", exc)
            return False
        gateways = [Gateway(address, self.settings.gateways, holder="") for address in addresses]
        try:
            return await self._unroute(gateways, only)
        finally:
            await asyncio.gather(*(g.close() for g in gateways), return_exceptions=True)

    async def _unroute(self, gateways: list[Gateway], only: str | None) -> bool:
        statuses = await asyncio.gather(*(g.status() for g in gateways), return_exceptions=True)
        done = True
        calls = []  # (gateway, tenant, adapter)
        for gateway, status in zip(gateways, statuses, strict=True):
            if isinstance(status, ReplicaError):
                done = False  # it may route the tenant: the next pass asks again
                log.warning("%s", status)
                if only is not None:
                    self.metrics.tenant_unroutes.labels(tenant=only, outcome="failed").inc()
                continue
            if isinstance(status, BaseException):
                raise status
            calls += [
                (gateway, tenant, adapter)
                for tenant, adapter in sorted(status.tenant_adapters.items())
                if (only is None or tenant == only) and self.stray(tenant, adapter)
            ]
        answers = await asyncio.gather(
            *(gateway.unroute(tenant) for gateway, tenant, _ in calls), return_exceptions=True
        )
        for (gateway, tenant, adapter), answer in zip(calls, answers, strict=True):
            if isinstance(answer, ReplicaError):
                done = False
                self.metrics.tenant_unroutes.labels(tenant=tenant, outcome="failed").inc()
                log.error("unrouting tenant %s: %s", tenant, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                self.metrics.tenant_unroutes.labels(tenant=tenant, outcome="ok").inc()
                why = "not selected" if not self.settings.tenants.owns_adapter(tenant) else (
                    "released")  # fmt: skip
                log.warning("gateway %s routed tenant %s to %s (%s): unrouted, the shared "
                            "policy serves it", gateway.address, tenant, adapter, why)  # fmt: skip
        return done

    async def unload(self, tenant: str) -> None:
        """Unload `tenant`'s released adapters from every engine once no gateway has a request
        running on them (bounded by sync.unload_wait_s; ones still busy stay loaded)."""
        floor = self.floors.get(tenant, 1)
        try:
            urls = await engine_urls(self.settings.engines)
            addresses = await gateway_addresses(self.settings.gateways)
        except (OSError, LookupError) as exc:
            log.warning("cannot find the replicas to unload tenant %s's adapters: %s", tenant, exc)
            return
        engines = [Engine(url, self.settings.engines) for url in urls]
        gateways = [Gateway(address, self.settings.gateways, holder="") for address in addresses]
        result = SyncResult(floor - 1, "ok", tenant=tenant)
        try:
            await AdapterSync(self.settings, self.redis, gateways, engines).unload_old(
                "", result, tenant, below=floor
            )
        finally:
            await asyncio.gather(
                *(r.close() for r in [*engines, *gateways]), return_exceptions=True
            )
        self.metrics.adapters_unloaded.inc(result.unloaded)
        self.metrics.adapters_kept.inc(result.kept)
        if result.unloaded:
            log.info("unloaded %d released adapter(s) of tenant %s from the engines",
                     result.unloaded, tenant)  # fmt: skip
