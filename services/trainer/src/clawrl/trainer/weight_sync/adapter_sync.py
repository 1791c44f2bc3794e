"""One LoRA sync: a version whose announcement names an adapter, which pauses nothing.

Every engine loads adapter policy-vN beside the one it serves (at once, while serving); if any
fails, those that loaded it unload it and no gateway switches (the old adapter keeps serving).
Else the served version is recorded in Redis (`sync.served_key`, for gateways and engines that
restart), every gateway switches to it (SwitchAdapter: requests admitted from then on use it),
and old policy adapters are unloaded once no gateway has a request running on them (bounded by
`sync.unload_wait_s`; SGLang's unload itself waits for the engine's own requests).

A tenant's LoRA version (per-tenant mode: adapter `tenant-T-vN`, announced with `tenant` T) is
the same, for that tenant alone: every engine loads it, its served adapter is recorded beside
the shared one (`served.tenants_key`), every gateway switches only T's new requests to it
(SwitchAdapter with `tenant`), and only T's older `tenant-T-v*` adapters are unloaded once no
request uses them. The shared policy and every other tenant keep their adapters; a failed load
is undone on the engines that loaded it, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from clawrl.common.tenants import parse_tenant_adapter
from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.replicas import (
    Engine,
    Gateway,
    ReplicaError,
    gather_answers,
    gather_errors,
    record_served,
)
from clawrl.trainer.weight_sync.result import SyncResult
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)

# Adapters a sync loaded (adapter_name): the only ones it unloads; others (tenants', the
# engine's --lora-paths) are not its to remove.
POLICY_ADAPTER = re.compile(r"policy-v\d+")


def adapter_tenant(ready: VersionReady) -> str:
    """Whose adapter `ready` is: its `tenant`, else the tenant its name `tenant-T-vN` names, else
    "" (the shared policy's). ValueError when the two disagree, or a tenant's adapter is not
    named `tenant-T-vN` of its version: the name is what the gateways route by."""
    parsed = parse_tenant_adapter(ready.adapter)
    tenant = ready.tenant or (parsed[0] if parsed else "")
    if tenant and parsed != (tenant, ready.version):
        raise ValueError(
            f"tenant {tenant}'s version {ready.version} must be the adapter "
            f"tenant-{tenant}-v{ready.version}, not {ready.adapter!r}"
        )
    return tenant


def ours(name: str, tenant: str) -> bool:
    """Whether a sync of `tenant` ("" = the shared policy) unloads the adapter `name` once it is
    old: the shared policy's `policy-vN`, or that tenant's `tenant-T-vN`; never another
    tenant's, nor one the engine was started with."""
    if tenant:
        parsed = parse_tenant_adapter(name)
        return parsed is not None and parsed[0] == tenant
    return POLICY_ADAPTER.fullmatch(name) is not None


def _version(name: str) -> int:
    """The version of a tenant adapter's name (0 for any other name)."""
    parsed = parse_tenant_adapter(name)
    return parsed[1] if parsed else 0


@dataclass
class AdapterSync:
    """The steps of one LoRA sync over already-connected replicas."""

    settings: WeightSyncSettings
    redis: Redis
    gateways: list[Gateway]
    engines: list[Engine]

    async def run(self, ready: VersionReady, result: SyncResult, tenant: str) -> None:
        """Load the adapter everywhere, switch every gateway, unload the old adapters (with
        `tenant`: for that tenant alone)."""
        held, errors = await gather_answers([engine.adapters() for engine in self.engines])
        if errors:
            result.outcome, result.reason = "failed", "; ".join(errors)
            return
        # An engine holding the name already (a retried sync, or one the launcher reloaded)
        # keeps it: SGLang refuses to load a name twice.
        missing = [
            e for e, names in zip(self.engines, held, strict=True) if ready.adapter not in names
        ]
        if not missing and await self._all_switched(ready, tenant):
            result.outcome = "skipped"
            result.reason = f"every engine holds {ready.adapter} and every gateway serves it"
            return
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(engine.load_adapter(ready.adapter, ready.path) for engine in missing),
            return_exceptions=True,
        )
        result.load_s = time.monotonic() - started
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, ReplicaError):
                raise outcome
        failed = [str(o) for o in outcomes if isinstance(o, ReplicaError)]
        if failed:
            loaded = [e for e, o in zip(missing, outcomes, strict=True) if o is None]
            # Nobody routes to it: unloading it keeps the engines as they were.
            undo = await gather_errors([e.unload_adapter(ready.adapter) for e in loaded])
            for error in undo:
                log.warning("after the failed load: %s", error)
            result.outcome = "failed"
            result.reason = "; ".join(failed) + (
                f"; unloaded it from {len(loaded) - len(undo)} engine(s) that had loaded it"
                if loaded
                else ""
            )
            return
        key = self.settings.sync.served_key
        await record_served(self.redis, key, ready.version, ready.adapter, ready.path, tenant)
        started = time.monotonic()
        _, errors = await gather_answers(
            [g.switch_adapter(ready.version, ready.adapter, tenant) for g in self.gateways]
        )
        result.switch_s = time.monotonic() - started
        if errors:
            # Those that switched serve the new adapter, the others the old one: both loaded,
            # and each turn records its own. The retry switches the rest.
            result.outcome, result.reason = "failed", "; ".join(errors)
            return
        result.outcome = "ok"
        await self.unload_old(ready.adapter, result, tenant)

    async def _all_switched(self, ready: VersionReady, tenant: str) -> bool:
        """Whether every gateway already routes to `ready`'s adapter (`tenant`'s requests, with
        a tenant); False when one does not answer: the switch then tells."""
        statuses, errors = await gather_answers([g.status() for g in self.gateways])
        if tenant:
            return not errors and all(
                s.tenant_adapters.get(tenant) == ready.adapter for s in statuses
            )
        return not errors and all(
            (s.policy_version, s.adapter) == (ready.version, ready.adapter) for s in statuses
        )

    async def unload_old(
        self, keep: str, result: SyncResult, tenant: str, *, below: int | None = None
    ) -> None:
        """Unload every policy adapter (with `tenant`: every adapter of that tenant; with
        `below` too, its versions below it: a release's) but `keep` from every engine once no
        gateway has a request running on it (or routes to it); ones still busy after the wait
        stay."""
        held, errors = await gather_answers([engine.adapters() for engine in self.engines])
        if errors:
            log.warning("old adapters not unloaded: %s", "; ".join(errors))
            return
        old = {
            (engine, name)
            for engine, names in zip(self.engines, held, strict=True)
            for name in names
            if name != keep and ours(name, tenant) and (below is None or _version(name) < below)
        }
        deadline = time.monotonic() + self.settings.sync.unload_wait_s
        while old:
            statuses, errors = await gather_answers([g.status() for g in self.gateways])
            if errors:  # a gateway we cannot see may still route to one of them
                log.warning("old adapters not unloaded: %s", "; ".join(errors))
                break
            busy = {s.adapter for s in statuses} | {
                name for s in statuses for name, count in s.in_flight_by_adapter.items() if count
            }
            busy |= {name for s in statuses for name in s.tenant_adapters.values()}
            idle = {(engine, name) for engine, name in old if name not in busy}
            errors = await gather_errors([engine.unload_adapter(name) for engine, name in idle])
            for error in errors:
                log.warning("%s", error)
            result.unloaded += len(idle) - len(errors)
            result.kept += len(errors)
            old -= idle
            if not old or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if old:
            result.kept += len(old)
            log.warning(
                "adapters still in use after %.0fs, left loaded: %s",
                self.settings.sync.unload_wait_s,
                ", ".join(sorted(f"{name} on {engine.url}" for engine, name in old)),
            )
