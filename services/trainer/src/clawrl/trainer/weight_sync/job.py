"""One weight sync: Pause every gateway (a lease renewed while the job works) -> every policy
engine loads version N from disk -> Resume every gateway with policy_version=N.

The load step may instead be a broadcast (`Broadcast`, the trainer's in-process sync with
`weight_sync.transport = nccl`): when it fails, or an engine does not report N after it, the
engines load N from disk and the sync still succeeds (`broadcast_error` says why).

The drain is bounded, as in SGLang/slime: Pause waits at most the drain budget for in-flight
generations; if some still run then (engines.in_flight = retract), every engine is paused with
/pause_generation mode=retract, loads at once, and gets /continue_generation (always, also when
the load fails) before the gateways resume. The retracted generations go on under the new
weights; the gateway records both versions of such a turn.

Failure rules: any failure resumes the gateways on the version they had (Resume 0) and the job
exits non-zero with the reason; engines that loaded N while another failed are rolled back to
what they served before, so every replica ends on one version (if a rollback fails too, the
outcome is `inconsistent`). A job killed outright leaves its pause to the gateways' lease (which
ends on the engines' version) and its lock to the lock's TTL. Two syncs never run at once: a
Redis lock with a TTL, renewed from the moment it is taken until the sync ends; a sync that
loses it aborts. Only the gateways this sync paused are resumed (each Resume names the holder:
a gateway refuses one for a pause it did not take), and every engine call but the load has its
own short timeout.

Every engine serving N already is not enough to skip: a job that died after its load, a Resume
that failed or a gateway that joined leave gateways admitting another version. Those are
resumed on N (no pause, no load: the engines serve N); only engines and gateways all on N skip.

A LoRA version (the announcement names an adapter) pauses nothing: every engine loads adapter
policy-vN beside the one it serves (at once, while serving); if any fails, those that loaded it
unload it and no gateway switches (the old adapter keeps serving). Else the served version is
recorded in Redis (`sync.served_key`, for gateways and engines that restart), every gateway
switches to it (SwitchAdapter: requests admitted from then on use it), and old policy adapters
are unloaded once no gateway has a request running on them (bounded by `sync.unload_wait_s`;
SGLang's unload itself waits for the engine's own requests).

A tenant's LoRA version (per-tenant mode: adapter `tenant-T-vN`, announced with `tenant` T) is
the same, for that tenant alone: every engine loads it, its served adapter is recorded beside
the shared one (`served.tenants_key`), every gateway switches only T's new requests to it
(SwitchAdapter with `tenant`), and only T's older `tenant-T-v*` adapters are unloaded once no
request uses them. The shared policy and every other tenant keep their adapters; a failed load
is undone on the engines that loaded it, and nothing else changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, fields
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError, RedisError

from clawrl.common.logs import log_context
from clawrl.common.served import write_served, write_served_tenant
from clawrl.common.tenants import parse_tenant_adapter
from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.replicas import (
    Engine,
    EngineWeights,
    Gateway,
    ReplicaError,
    engine_urls,
    gateway_addresses,
)
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

# Pushes `ready`'s weights into the engines at these URLs; raises when it cannot.
Broadcast = Callable[[VersionReady, list[str]], Awaitable[None]]

# Adapters a sync loaded (adapter_name): the only ones it unloads; others (tenants', the
# engine's --lora-paths) are not its to remove.
POLICY_ADAPTER = re.compile(r"policy-v\d+")

# Exit codes of `clawrl-weight-sync run`, by outcome.
EXIT_CODES = {"ok": 0, "skipped": 0, "failed": 1, "busy": 2, "inconsistent": 3}


@dataclass
class SyncResult:
    """What one sync did; published on the results stream and logged in one line."""

    version: int
    outcome: str  # ok | skipped | failed | busy | inconsistent
    reason: str = ""
    pause_s: float = 0.0  # user-visible: first Pause sent -> last Resume answered
    drain_s: float = 0.0  # of which waiting for in-flight generations
    load_s: float = 0.0  # slowest engine's load (or the broadcast, and its disk fallback)
    transport: str = "disk"  # how the engines got the weights: disk | nccl
    broadcast_error: str = ""  # why a broadcast fell back to disk
    retracted: int = 0  # generations that went on under the new weights (engines' count)
    gateways: int = 0
    engines: int = 0
    renewal_failures: int = 0
    job_id: str = ""
    finished_at: float = 0.0
    adapter: str = ""  # LoRA syncs: the adapter switched to (no pause; load_s is its load)
    switch_s: float = 0.0  # LoRA syncs: first SwitchAdapter sent -> last answered
    unloaded: int = 0  # LoRA syncs: old adapters unloaded (engine x adapter)
    kept: int = 0  # LoRA syncs: old adapters left loaded (still in use, or unload failed)
    tenant: str = ""  # a tenant's adapter sync (per-tenant mode): whose; "" for the shared policy

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.outcome, 1)

    def fields(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, entry: dict[bytes | str, bytes | str]) -> SyncResult:
        text = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in entry.items()
        }
        known = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in text.items():
            kind = known.get(key)
            if kind is not None:
                values[key] = {"int": int, "float": float}.get(str(kind), str)(value)
        return cls(**values)

    def summary(self) -> str:
        if self.adapter:
            return (
                f"weight sync to v{self.version} (adapter {self.adapter}"
                + (f" of tenant {self.tenant}" if self.tenant else "")
                + f"): {self.outcome}"
                + (f" ({self.reason})" if self.reason else "")
                + f"; no pause; load {self.load_s:.3f}s, switch {self.switch_s:.4f}s"
                + f", {self.unloaded} old adapter(s) unloaded"
                + (f", {self.kept} kept" if self.kept else "")
                + f" over {self.gateways} gateway(s) and {self.engines} engine(s)"
            )
        return (
            f"weight sync to v{self.version}: {self.outcome}"
            + (f" ({self.reason})" if self.reason else "")
            + f"; pause {self.pause_s:.3f}s (drain {self.drain_s:.3f}s, load {self.load_s:.3f}s)"
            + (f", {self.retracted} generation(s) retracted" if self.retracted else "")
            + f" over {self.gateways} gateway(s) and {self.engines} engine(s)"
            + (" by broadcast" if self.transport == "nccl" else "")
        )


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


async def rollback_path(redis: Redis, stream: str, served: EngineWeights) -> str:
    """Where the weights an engine serves now can be reloaded from: the announcement of its
    version, else the path it reports (its initial model)."""
    if served.version.isdigit():
        for _, entry in await redis.xrevrange(stream, count=1000):
            ready = VersionReady.from_fields(entry)
            if str(ready.version) == served.version:
                return ready.path
    return served.path


async def gather_answers(calls: list[Awaitable[T]]) -> tuple[list[T], list[str]]:
    """Run the calls at once; the answers of those that succeeded and the messages of those
    that raised ReplicaError."""
    answers, errors = [], []
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, ReplicaError):
            errors.append(str(result))
        elif isinstance(result, BaseException):
            raise result
        else:
            answers.append(result)
    return answers, errors


async def gather_errors(calls: list[Awaitable[object]]) -> list[str]:
    """Run the calls at once; the messages of those that raised ReplicaError."""
    return (await gather_answers(calls))[1]


class WeightSync:
    """The steps of one sync over already-connected replicas."""

    def __init__(
        self,
        settings: WeightSyncSettings,
        redis: Redis,
        gateways: list[Gateway],
        engines: list[Engine],
        *,
        broadcast: Broadcast | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.gateways = gateways
        self.engines = engines
        self.broadcast = broadcast
        self.renewal_failures = 0
        self.paused: list[Gateway] = list(gateways)  # those to renew and resume: not refused

    async def run(self, ready: VersionReady, result: SyncResult) -> None:
        """Fills `result` (outcome, reason, durations) as it goes."""
        if ready.is_adapter:
            result.adapter = ready.adapter
            await self._run_adapter(ready, result, result.tenant)
            return
        served = await asyncio.gather(*(engine.weights() for engine in self.engines))
        if all(weights.version == str(ready.version) for weights in served):
            await self._converge_gateways(ready, result)
            return
        reason = f"weight sync to v{ready.version}"
        resume_version: int | None = None
        engines_paused = False
        started = time.monotonic()
        renewals: asyncio.Task | None = None
        try:
            # Renewals start with the pause: draining may outlast one lease.
            renewals = asyncio.create_task(self._renew_forever(reason), name="lease-renewal")
            drain = self.settings.gateways.drain_timeout_s
            outcomes = await asyncio.gather(
                *(g.pause(reason, drain) for g in self.gateways), return_exceptions=True
            )
            result.drain_s = time.monotonic() - started
            for outcome in outcomes:
                if isinstance(outcome, BaseException) and not isinstance(outcome, ReplicaError):
                    raise outcome
            # A refused Pause: another holder's pause runs there; never resume it.
            self.paused = [
                g
                for g, o in zip(self.gateways, outcomes, strict=True)
                if not (isinstance(o, ReplicaError) and o.refused)
            ]
            errors = [str(o) for o in outcomes if isinstance(o, ReplicaError)]
            if errors:
                raise ReplicaError("; ".join(errors))
            paused = outcomes
            if self.settings.engines.in_flight == "retract" and not all(p.drained for p in paused):
                engines_paused = True  # before the call: a lost answer still gets its continue
                errors = await gather_errors([e.pause_generation() for e in self.engines])
                if errors:
                    raise ReplicaError("; ".join(errors))
            resume_version = await self._load(ready, served, result)
        except ReplicaError as exc:
            result.outcome, result.reason = result.outcome or "failed", str(exc)
        finally:
            if renewals is not None:
                renewals.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewals
            if engines_paused:
                await self._continue_engines(result)
            # Every gateway this sync may have paused (also one whose Pause answer was lost):
            # Resume is idempotent; not those that refused the Pause.
            errors = await gather_errors([g.resume(resume_version) for g in self.paused])
            result.pause_s = time.monotonic() - started
            result.renewal_failures = self.renewal_failures
            if errors:
                # Their leases end the pause anyway; the version they serve is not lost, since
                # every turn records the engine's own weight_version.
                log.error("resume failed (the pause lease will end it): %s", "; ".join(errors))
                if result.outcome == "ok":
                    result.outcome, result.reason = "failed", "; ".join(errors)
            if result.outcome == "ok":
                # Full weights now: a gateway that starts must not route to an old adapter.
                await self._record_served(ready.version, "", ready.path)

    async def _run_adapter(self, ready: VersionReady, result: SyncResult, tenant: str) -> None:
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
        await self._record_served(ready.version, ready.adapter, ready.path, tenant)
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
        await self._unload_old(ready.adapter, result, tenant)

    async def _converge_gateways(self, ready: VersionReady, result: SyncResult) -> None:
        """Every engine serves `ready` already: resume each gateway that does not admit it
        (paused by no one else) on it. Skipped only when every gateway does."""
        statuses = await asyncio.gather(
            *(g.status() for g in self.gateways), return_exceptions=True
        )
        behind = []
        for gateway, status in zip(self.gateways, statuses, strict=True):
            if isinstance(status, BaseException) and not isinstance(status, ReplicaError):
                raise status
            if isinstance(status, ReplicaError) or (
                status.paused or (status.policy_version, status.adapter) != (ready.version, "")
            ):
                behind.append(gateway)
        if not behind:
            result.outcome = "skipped"
            result.reason = f"every engine serves v{ready.version} and every gateway admits it"
        else:
            errors = await gather_errors([g.resume(ready.version) for g in behind])
            if errors:
                result.outcome, result.reason = "failed", "; ".join(errors)
                return
            result.outcome = "ok"
            result.reason = (
                f"every engine served v{ready.version} already: resumed {len(behind)} "
                "gateway(s) on it"
            )
        await self._record_served(ready.version, "", ready.path)

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

    async def _unload_old(self, keep: str, result: SyncResult, tenant: str) -> None:
        """Unload every policy adapter (with `tenant`: every adapter of that tenant) but `keep`
        from every engine once no gateway has a request running on it (or routes to it); ones
        still busy after the wait stay."""
        held, errors = await gather_answers([engine.adapters() for engine in self.engines])
        if errors:
            log.warning("old adapters not unloaded: %s", "; ".join(errors))
            return
        old = {
            (engine, name)
            for engine, names in zip(self.engines, held, strict=True)
            for name in names
            if name != keep and ours(name, tenant)
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

    async def _record_served(self, version: int, adapter: str, path: str, tenant: str = "") -> None:
        """What the gateways route to from now on (`tenant`'s requests, with a tenant), for
        gateways and engines that (re)start."""
        key = self.settings.sync.served_key
        try:
            if tenant:
                await write_served_tenant(self.redis, key, tenant, version, adapter, path)
            else:
                await write_served(self.redis, key, version, adapter, path)
        except RedisError as exc:  # serving goes on; only a restart would miss it
            log.error("cannot record the served version at %s: %s",
                      self.settings.sync.served_key, exc)  # fmt: skip

    async def _continue_engines(self, result: SyncResult) -> None:
        """/continue_generation on every engine, whatever happened before: one left paused
        would hold its requests. A failure fails the sync, so the stuck engine is seen; the
        gateways still resume on the version the engines serve."""
        errors = await gather_errors([e.continue_generation() for e in self.engines])
        if errors:
            log.error("engines not continued: %s", "; ".join(errors))
            if result.outcome == "ok":
                result.outcome = "failed"
            result.reason = "; ".join([r for r in [result.reason, *errors] if r])

    async def _load(
        self, ready: VersionReady, served: list[EngineWeights], result: SyncResult
    ) -> int | None:
        """Every engine loads N (by broadcast, else from disk); the version to resume with
        (None: keep the old one)."""
        started = time.monotonic()
        if self.broadcast is not None:
            try:
                await self._broadcast(ready)
            except Exception as exc:  # whatever broke the broadcast, the export is on disk
                result.broadcast_error = str(exc) or type(exc).__name__
                log.warning("broadcast of v%d failed, loading it from disk: %s",
                            ready.version, result.broadcast_error)  # fmt: skip
            else:
                result.load_s = time.monotonic() - started
                result.outcome, result.transport = "ok", "nccl"
                return ready.version
        outcomes = await asyncio.gather(
            *(engine.load(ready.path, str(ready.version)) for engine in self.engines),
            return_exceptions=True,
        )
        result.load_s = time.monotonic() - started
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        for outcome in failed:
            if not isinstance(outcome, ReplicaError):
                raise outcome
        result.retracted = sum(o for o in outcomes if isinstance(o, int))
        if not failed:
            result.outcome = "ok"
            if result.broadcast_error:
                result.reason = f"broadcast failed ({result.broadcast_error}); loaded from disk"
            return ready.version
        updated = [
            (engine, weights)
            for engine, weights, outcome in zip(self.engines, served, outcomes, strict=True)
            # After a failed broadcast any engine may hold part of N: every one goes back.
            if result.broadcast_error or not isinstance(outcome, BaseException)
        ]
        reason = "; ".join(str(f) for f in failed)
        rollback_errors = []
        for engine, weights in updated:
            path = await rollback_path(self.redis, self.settings.redis.versions_stream, weights)
            log.warning("rolling %s back to %s (%s)", engine.url, weights.version, path)
            rollback_errors += await gather_errors([engine.load(path, weights.version)])
        if rollback_errors:
            result.outcome = "inconsistent"
            raise ReplicaError(f"{reason}; rollback failed: {'; '.join(rollback_errors)}")
        if updated:
            reason += f"; rolled {len(updated)} updated engine(s) back"
        raise ReplicaError(reason)

    async def _broadcast(self, ready: VersionReady) -> None:
        """The broadcast, then every engine must report N (the last bucket carries it)."""
        await self.broadcast(ready, [engine.url for engine in self.engines])
        served = await asyncio.gather(*(engine.weights() for engine in self.engines))
        behind = [
            f"{engine.url} reports v{weights.version}"
            for engine, weights in zip(self.engines, served, strict=True)
            if weights.version != str(ready.version)
        ]
        if behind:
            raise ReplicaError(f"after the broadcast: {'; '.join(behind)}")

    async def _renew_forever(self, reason: str) -> None:
        """Renew the pause lease of the gateways it paused every lease_s / 3 while it works."""
        while True:
            await asyncio.sleep(self.settings.gateways.lease_s / 3)
            # A tiny drain: the gateways drained at the first Pause; a renewal must not wait.
            errors = await gather_errors([g.pause(reason, 0.01) for g in self.paused])
            for error in errors:
                self.renewal_failures += 1
                log.warning("lease renewal failed: %s", error)


def ours(name: str, tenant: str) -> bool:
    """Whether a sync of `tenant` ("" = the shared policy) unloads the adapter `name` once it is
    old: the shared policy's `policy-vN`, or that tenant's `tenant-T-vN`; never another
    tenant's, nor one the engine was started with."""
    if tenant:
        parsed = parse_tenant_adapter(name)
        return parsed is not None and parsed[0] == tenant
    return POLICY_ADAPTER.fullmatch(name) is not None


class LockLost(Exception):
    """The sync lock expired or passed to another job while this sync held it."""


async def keep_lock(lock: Lock, ttl_s: float) -> None:
    """Renew the sync lock every ttl_s / 3 from the moment it is taken; raises LockLost once
    it is gone (another job may hold it: this sync must stop). Redis errors are retried until
    a whole TTL passed without a renewal (the key has expired by then)."""
    renewed = time.monotonic()
    while True:
        try:
            await lock.extend(ttl_s, replace_ttl=True)
            renewed = time.monotonic()
        except LockError as exc:
            raise LockLost(f"the sync lock was lost: {exc}") from exc
        except RedisError as exc:
            if time.monotonic() - renewed >= ttl_s:
                raise LockLost(f"the sync lock was not renewed for {ttl_s:.0f}s: {exc}") from exc
            log.warning("cannot renew the sync lock (retrying): %s", exc)
        await asyncio.sleep(ttl_s / 3)


async def publish(redis: Redis, settings: WeightSyncSettings, result: SyncResult) -> None:
    await redis.xadd(settings.sync.results_stream, result.fields(), maxlen=1000, approximate=True)


async def sync_version(
    settings: WeightSyncSettings,
    redis: Redis,
    ready: VersionReady,
    job_id: str,
    *,
    broadcast: Broadcast | None = None,
) -> SyncResult:
    """One whole sync under the lock; the result is published, logged and returned (also
    when the job is cancelled by SIGTERM: then the gateways are resumed first). With
    `broadcast`, it is the load step and disk the fallback."""
    result = SyncResult(version=ready.version, outcome="", job_id=job_id)
    lock = redis.lock(
        settings.sync.lock_key,
        timeout=settings.sync.lock_ttl_s,
        blocking=False,
        thread_local=False,
    )
    with log_context(policy_version=ready.version):
        try:
            try:
                result.tenant = adapter_tenant(ready)
            except ValueError as exc:  # published and logged below, as every outcome
                result.outcome, result.reason = "failed", str(exc)
                return result
            if not await lock.acquire(token=job_id):
                holder = await redis.get(settings.sync.lock_key)
                result.outcome = "busy"
                result.reason = (
                    f"another sync holds the lock ({holder.decode() if holder else '?'})"
                )
                return result
            try:
                await _sync_locked(settings, redis, ready, lock, result, broadcast)
            finally:
                try:
                    await lock.release()
                except LockError:
                    log.warning("the sync lock expired before the sync ended")
            return result
        finally:
            result.finished_at = time.time()
            try:
                await publish(redis, settings, result)
            except Exception as exc:  # the log line below still has the figures
                log.warning("cannot publish the sync result: %s", exc)
            (log.info if result.exit_code == 0 else log.error)(
                result.summary(),
                extra={
                    "pause_s": round(result.pause_s, 4),
                    "load_s": round(result.load_s, 4),
                    "outcome": result.outcome,
                },
            )


async def _sync_locked(
    settings, redis, ready, lock, result: SyncResult, broadcast: Broadcast | None
) -> None:
    try:
        addresses = await gateway_addresses(settings.gateways)
        urls = await engine_urls(settings.engines)
    except (OSError, LookupError) as exc:
        result.outcome, result.reason = "failed", f"cannot find the replicas: {exc}"
        return
    result.gateways, result.engines = len(addresses), len(urls)
    gateways = [Gateway(a, settings.gateways, holder=result.job_id) for a in addresses]
    engines = [Engine(u, settings.engines) for u in urls]
    sync = WeightSync(settings, redis, gateways, engines, broadcast=broadcast)
    work = asyncio.create_task(sync.run(ready, result), name="sync")
    keeper = asyncio.create_task(keep_lock(lock, settings.sync.lock_ttl_s), name="lock-renewal")
    try:
        await asyncio.wait({work, keeper}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the lock is lost: another sync may start; stop this one
            lost = keeper.exception()
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work  # its cleanup resumes the gateways and continues the engines
            if result.outcome != "inconsistent":
                result.outcome = "failed"
            result.reason = "; ".join(r for r in [result.reason, f"{lost}: aborted"] if r)
        else:
            await work
    except ReplicaError as exc:  # before the pause: an engine did not say what it serves
        result.outcome, result.reason = "failed", str(exc)
    except asyncio.CancelledError:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        if result.outcome not in ("ok", "inconsistent"):
            result.outcome = "failed"
            result.reason = result.reason or "terminated during the sync"
        raise
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError, LockLost):
            await keeper
        await asyncio.gather(*(r.close() for r in [*gateways, *engines]), return_exceptions=True)
