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

A LoRA version (the announcement names an adapter) pauses nothing: see adapter_sync.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from clawrl.common.logs import log_context
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.adapter_sync import AdapterSync, adapter_tenant
from clawrl.trainer.weight_sync.replicas import (
    Engine,
    EngineWeights,
    Gateway,
    ReplicaError,
    engine_urls,
    gateway_addresses,
    gather_errors,
    record_served,
)
from clawrl.trainer.weight_sync.result import SyncResult
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)

# Pushes `ready`'s weights into the engines at these URLs; raises when it cannot.
Broadcast = Callable[[VersionReady, list[str]], Awaitable[None]]


async def rollback_path(redis: Redis, stream: str, served: EngineWeights) -> str:
    """Where the weights an engine serves now can be reloaded from: the announcement of its
    version, else the path it reports (its initial model)."""
    if served.version.isdigit():
        for _, entry in await redis.xrevrange(stream, count=1000):
            ready = VersionReady.from_fields(entry)
            if str(ready.version) == served.version:
                return ready.path
    return served.path


class WeightSync:
    """The steps of one sync over already-connected replicas (an adapter's: `AdapterSync`)."""

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
            sync = AdapterSync(self.settings, self.redis, self.gateways, self.engines)
            await sync.run(ready, result, result.tenant)
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
                await self._record_served(ready.version, ready.path)

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
        await self._record_served(ready.version, ready.path)

    async def _record_served(self, version: int, path: str) -> None:
        """Full weights of `version` from now on (no adapter), for replicas that (re)start."""
        await record_served(self.redis, self.settings.sync.served_key, version, "", path)

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
        except REDIS_ERRORS as exc:
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
