"""The launcher: turns the trainer's "version N is ready" announcements into syncs.

One sync at a time, newest version first: announcements that arrive while a sync runs are
collapsed to the newest, and a version older than the one already served is never loaded. A
failed sync is retried (`max_attempts`, with a back-off) unless a newer version arrived
meanwhile; one that found the lock held ("busy": another sync runs, or a dead one's lock has not
expired yet) waits for the lock and tries again without spending an attempt.

Whatever dies, the replicas converge: every `reconcile_interval_s` with no sync to run, the
launcher compares what the engines serve and what the gateways admit with the served version
(Redis) and syncs that version again when one left it (an engine restarted on its base model, a
gateway that a dead sync left behind or that joined since).

Per-tenant mode: the tenants' versions (`{versions_stream}:tenants`, adapters `tenant-T-vN`)
are followed the same way, one newest-wins sequence per tenant; syncs still run one at a time,
the announcement that waited longest first, so tenants take turns with each other and with the
shared policy. A tenant whose served adapter a gateway does not route to is synced again. A
tenant's release on that stream (`clawrl-trainer tenants reset|remove`) unroutes it from every
gateway before anything else runs, and none of its versions below the release's floor is synced
again (unroute.py).

Each sync is a child process locally (`make run`) or a Kubernetes Job on a cluster
(kube.py); both run `clawrl-weight-sync run`, which publishes its result on the results stream,
from which this launcher keeps its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from pydantic import SecretStr
from redis.asyncio import Redis

from clawrl.common.served import read_served, read_served_tenants, tenants_key
from clawrl.common.tenants import tenant_versions_stream
from clawrl.common.versions import TenantReleased, VersionReady, tenant_entry
from clawrl.trainer.weight_sync.job import SyncResult, adapter_tenant
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.reconcile import divergence, reconcile_forever, tenant_divergence
from clawrl.trainer.weight_sync.replicas import continue_every_engine
from clawrl.trainer.weight_sync.settings import WeightSyncSettings
from clawrl.trainer.weight_sync.unroute import Unrouter

log = logging.getLogger(__name__)

Launch = Callable[[VersionReady], Awaitable[int]]


def settings_env(settings: WeightSyncSettings) -> dict[str, str]:
    """The settings a sync job needs as `CLAWRL_*` environment, so what the launcher was given
    (flags included) reaches the job it starts."""
    env = {}
    for section in ("logging", "model", "redis", "gateways", "engines", "sync"):
        for key, value in getattr(settings, section):
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            text = value if isinstance(value, str | Path) else json.dumps(value)
            env[f"CLAWRL_{section.upper()}__{key.upper()}"] = str(text)
    return env


def run_args(ready: VersionReady, job_id: str) -> list[str]:
    """The arguments of `clawrl-weight-sync` that sync `ready` (process and Job alike)."""
    args = ["run", "--version", str(ready.version), "--path", ready.path, "--job-id", job_id]
    if ready.adapter:
        args += ["--adapter", ready.adapter]
    return [*args, "--tenant", ready.tenant] if ready.tenant else args


class LocalLauncher:
    """Runs each sync as a child process, with the launcher's settings."""

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.timeout_s = settings.launcher.job_timeout_s
        self.env = settings_env(settings)

    async def __call__(self, ready: VersionReady) -> int:
        whose = f"{ready.tenant}-" if ready.tenant else ""
        job_id = f"sync-{whose}v{ready.version}-{secrets.token_hex(3)}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "clawrl.trainer.weight_sync.main",
            *run_args(ready, job_id),
            env={**os.environ, **self.env},
        )
        try:
            return await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            log.error("sync %s did not finish in %.0fs; stopping it", job_id, self.timeout_s)
            proc.send_signal(signal.SIGTERM)  # it resumes the gateways on its way out
            try:
                return await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                return await proc.wait()
        except asyncio.CancelledError:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.shield(proc.wait())
            raise


class SyncWatcher:
    """Follows the versions streams (the shared policy's, and the tenants' beside it) and runs
    one sync per new version (newest wins, per tenant)."""

    def __init__(
        self,
        settings: WeightSyncSettings,
        redis: Redis,
        launch: Launch,
        metrics: WeightSyncMetrics,
        *,
        block_ms: int = 5000,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.launch = launch
        self.metrics = metrics
        self.block_ms = block_ms
        self.served = 0  # newest shared version a sync put into service
        self.given_up = 0  # newest shared version abandoned after max_attempts
        # The same per tenant (per-tenant mode); "" is never a key here.
        self.tenant_served: dict[str, int] = {}
        self.tenant_given_up: dict[str, int] = {}
        # Newest announcement not synced yet, per tenant ("": the shared policy), in the order
        # they started waiting: tenants take turns, and a busy one cannot starve the others.
        self.pending: dict[str, VersionReady] = {}
        # Tenants released (adapter reset or removed) whose gateways are to unroute them next.
        self.releases: dict[str, TenantReleased] = {}
        self.unrouter = Unrouter(settings, redis, metrics)
        self.per_tenant = settings.tenants.per_tenant
        self._tenants_stream = tenant_versions_stream(settings.redis.versions_stream)
        self._read_ids = {settings.redis.versions_stream: "0-0"}
        if self.per_tenant:
            self._read_ids[self._tenants_stream] = "0-0"
        self._results_id = "0-0"
        self._checked_at = 0.0  # last comparison of the replicas with the served version

    async def start(self) -> None:
        """Follow the results from now on. What the engines serve is not taken from old
        results: they may have restarted on their initial weights, so the newest announced
        version is synced once at start (the job skips it when every engine serves it).

        A launcher that died with its job (the trainer pod lost) may have left the engines
        paused by a retracting sync that nobody continues; with no sync running (its lock is
        free) /continue_generation is harmless, so every engine gets one now."""
        newest = await self.redis.xrevrange(self.settings.sync.results_stream, count=1)
        self._results_id = newest[0][0] if newest else "0-0"
        if not self.per_tenant:
            left = await read_served_tenants(self.redis, self.settings.sync.served_key)
            if left:
                log.warning(
                    "shared mode: ignoring the served adapters of %d tenant(s) (%s) left in %s:"
                    " every caller is served the shared policy",
                    len(left),
                    ", ".join(sorted(left)),
                    tenants_key(self.settings.sync.served_key),
                )
        if await self.redis.exists(self.settings.sync.lock_key):
            log.info("a sync holds the lock at start: leaving the engines to it")
            return
        for error in await continue_every_engine(self.settings.engines):
            self.metrics.continue_failures.inc()
            log.error("continuing the engines at start: %s", error)

    async def run_forever(self) -> None:
        await self.start()
        # Beside the syncs: engines that restarted get the served LoRA adapters back.
        reconciler = asyncio.create_task(
            reconcile_forever(self.settings, self.redis, self.metrics, self.unrouter.released),
            name="reconcile",
        )
        try:
            while True:
                await self._read_announcements(block=not self.pending and not self.releases)
                if self.releases:  # before any sync: a newer adapter of the tenant comes after
                    await self._unroute(self.releases.pop(next(iter(self.releases))))
                    continue
                ready = self._next_pending()
                if ready is not None:
                    await self._sync(ready)
                    continue
                for ready in await self._converge():
                    await self._sync(ready)
        finally:
            reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reconciler

    def _done(self, tenant: str) -> int:
        """The newest version of `tenant` ("": shared) served, given up or released: older
        ones are never synced from an announcement."""
        if not tenant:
            return max(self.served, self.given_up)
        return max(
            self.tenant_served.get(tenant, 0),
            self.tenant_given_up.get(tenant, 0),
            self.unrouter.floors.get(tenant, 1) - 1,
        )

    def _next_pending(self) -> VersionReady | None:
        """The announcement that waited longest among those newer than what is served (the
        others are dropped)."""
        for tenant in list(self.pending):
            ready = self.pending.pop(tenant)
            if ready.version > self._done(tenant):
                return ready
        return None

    async def _converge(self) -> list[VersionReady]:
        """The served versions (shared, tenants'), to sync again, that a replica left (at most
        every reconcile_interval_s, never while a sync holds the lock)."""
        now = asyncio.get_running_loop().time()
        if now - self._checked_at < self.settings.launcher.reconcile_interval_s:
            return []
        self._checked_at = now
        if await self.redis.exists(self.settings.sync.lock_key):
            return []
        again = []
        try:
            served = await read_served(self.redis, self.settings.sync.served_key)
        except ValueError as exc:
            log.error("cannot compare the replicas with the served version: %s", exc)
            served = None
        cause = None if served is None else await divergence(self.settings, served)
        if served is not None and cause is not None:
            self.metrics.convergence_syncs.labels(cause=cause).inc()
            log.warning(
                "%s left the served version v%d%s: syncing it again",
                "an engine" if cause == "engines" else "a gateway",
                served.version,
                f" ({served.adapter})" if served.adapter else "",
            )
            again.append(
                VersionReady(served.version, served.path, 0, served.updated_at, served.adapter)
            )
        if not self.per_tenant:
            return again
        # A tenant taken out of allow/pattern, or released, is not routed to its adapter again.
        await self.unrouter.unroute()
        tenants = {
            tenant: mine
            for tenant, mine in (
                await read_served_tenants(self.redis, self.settings.sync.served_key)
            ).items()
            if not self.unrouter.stray(tenant, mine.adapter)
        }
        for tenant in await tenant_divergence(self.settings, tenants):
            mine = tenants[tenant]
            self.metrics.convergence_syncs.labels(cause="gateways").inc()
            log.warning("a gateway does not route tenant %s to its served adapter %s: syncing "
                        "it again", tenant, mine.adapter)  # fmt: skip
            again.append(
                VersionReady(mine.version, mine.path, 0, mine.updated_at, mine.adapter, tenant)
            )
        return again

    async def _sync(self, ready: VersionReady) -> None:
        """Sync `ready`, retrying; stops early when a newer version of its tenant arrived (it
        is pending then)."""
        tenant = ready.tenant
        whose = f"tenant {tenant}'s v{ready.version}" if tenant else f"v{ready.version}"
        attempt = 0
        while attempt < self.settings.launcher.max_attempts:
            attempt += 1
            log.info("syncing %s (attempt %d) from %s", whose, attempt, ready.path)
            code = await self.launch(ready)
            results = [
                r
                for r in await self._collect_results()
                if (r.version, r.tenant) == (ready.version, tenant)
            ]
            if code == 0:
                if tenant:
                    self.tenant_served[tenant] = max(self._done(tenant), ready.version)
                else:
                    self.served = max(self.served, ready.version)
                return
            if any(r.outcome == "busy" for r in results):
                # Not a failure: another sync runs, or a dead one's lock has not expired.
                self.metrics.busy_waits.inc()
                attempt -= 1
                await self._wait_for_lock()
                await self._read_announcements(block=False)
                if self._newer_pending(ready):
                    return
                continue
            if not results:
                self.metrics.syncs.labels(outcome="crashed").inc()
                if tenant:
                    self.metrics.tenant_syncs.labels(tenant=tenant, outcome="crashed").inc()
                # A job that died with the engines paused (retract) cannot continue them; the
                # gateways' leases end their pause by themselves, the engines' is ended here.
                for error in await continue_every_engine(self.settings.engines):
                    self.metrics.continue_failures.inc()
                    log.error("after a crashed sync: %s", error)
            log.warning("sync of %s failed (exit code %d)", whose, code)
            await self._read_announcements(block=False)
            if self._newer_pending(ready):
                return  # newest wins: sync it instead
            await asyncio.sleep(self.settings.launcher.retry_backoff_s)
        log.error(
            "giving up on %s after %d attempts; waiting for a newer version",
            whose,
            self.settings.launcher.max_attempts,
        )
        if tenant:
            self.tenant_given_up[tenant] = ready.version
        else:
            self.given_up = ready.version

    async def _unroute(self, released: TenantReleased) -> None:
        """Unroute a released tenant from every gateway, retried like a sync; then unload its
        released adapters. Given up, the convergence check tries again."""
        tenant = released.tenant
        for attempt in range(1, self.settings.launcher.max_attempts + 1):
            log.info("unrouting tenant %s (%s, its versions below %d released; attempt %d)",
                     tenant, released.action, released.floor, attempt)  # fmt: skip
            if await self.unrouter.unroute(tenant):
                await self.unrouter.unload(tenant)
                return
            if attempt < self.settings.launcher.max_attempts:
                await asyncio.sleep(self.settings.launcher.retry_backoff_s)
        log.error("giving up unrouting tenant %s after %d attempts; the convergence check tries "
                  "again", tenant, self.settings.launcher.max_attempts)  # fmt: skip

    def _release(self, released: TenantReleased) -> None:
        """Read a release: the tenant's versions below its floor are never synced (one waiting
        is dropped), and the gateways are to unroute it."""
        tenant, floor = released.tenant, released.floor
        self.unrouter.floors[tenant] = max(self.unrouter.floors.get(tenant, 1), floor)
        waiting = self.pending.get(tenant)
        if waiting is not None and waiting.version < floor:
            del self.pending[tenant]
        self.releases[tenant] = released

    def _newer_pending(self, ready: VersionReady) -> bool:
        waiting = self.pending.get(ready.tenant)
        return waiting is not None and waiting.version > ready.version

    async def _wait_for_lock(self) -> None:
        """Until no sync holds the lock (it expires lock_ttl_s after a dead job's last
        renewal)."""
        log.info("the sync lock is held; waiting for it")
        while await self.redis.exists(self.settings.sync.lock_key):  # noqa: ASYNC110 (Redis)
            await asyncio.sleep(min(1.0, self.settings.sync.lock_ttl_s / 10))

    async def _read_announcements(self, *, block: bool) -> None:
        """Every announcement after the last one read (waiting for one when `block`) into
        `pending`, the newest per tenant."""
        reply = await self.redis.xread(
            dict(self._read_ids), count=1000, block=self.block_ms if block else None
        )
        for stream, entries in reply or ():
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                self._read_ids[name] = entry_id
                try:
                    if name == self._tenants_stream:
                        entry = tenant_entry(fields)
                        if isinstance(entry, TenantReleased):
                            self._release(entry)
                            continue
                        tenant = adapter_tenant(entry)
                        if not tenant:
                            raise ValueError("an announcement on the tenants' stream names no "
                                             "tenant")  # fmt: skip
                    else:
                        entry, tenant = VersionReady.from_fields(fields), ""
                except ValueError as exc:
                    log.error("skipping announcement %s on %s: %s", entry_id, name, exc)
                    continue
                ready = replace(entry, tenant=tenant)
                waiting = self.pending.get(tenant)
                if waiting is None or ready.version > waiting.version:
                    self.pending[tenant] = ready
        shared = self.pending.get("")
        if shared is not None:
            self.metrics.announced_version.set(max(shared.version, self.served))

    async def _collect_results(self) -> list[SyncResult]:
        """New entries of the results stream, counted into the metrics."""
        stream = self.settings.sync.results_stream
        reply = await self.redis.xread({stream: self._results_id}, count=1000)
        results = []
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self._results_id = entry_id
                result = SyncResult.from_fields(fields)
                results.append(result)
                self.metrics.observe(result)
        return results
