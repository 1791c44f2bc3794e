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
from pathlib import Path

from pydantic import SecretStr
from redis.asyncio import Redis

from clawrl.common.served import read_served
from clawrl.common.versions import VersionReady
from clawrl.trainer.weight_sync.job import SyncResult
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from clawrl.trainer.weight_sync.reconcile import divergence, reconcile_forever
from clawrl.trainer.weight_sync.replicas import continue_every_engine
from clawrl.trainer.weight_sync.settings import WeightSyncSettings

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
    return [*args, "--adapter", ready.adapter] if ready.adapter else args


class LocalLauncher:
    """Runs each sync as a child process, with the launcher's settings."""

    def __init__(self, settings: WeightSyncSettings) -> None:
        self.timeout_s = settings.launcher.job_timeout_s
        self.env = settings_env(settings)

    async def __call__(self, ready: VersionReady) -> int:
        job_id = f"sync-v{ready.version}-{secrets.token_hex(3)}"
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
    """Follows the versions stream and runs one sync per new version (newest wins)."""

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
        self.served = 0  # newest version a sync put into service
        self.given_up = 0  # newest version abandoned after max_attempts
        self._versions_id = "0-0"
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
        if await self.redis.exists(self.settings.sync.lock_key):
            log.info("a sync holds the lock at start: leaving the engines to it")
            return
        for error in await continue_every_engine(self.settings.engines):
            self.metrics.continue_failures.inc()
            log.error("continuing the engines at start: %s", error)

    async def run_forever(self) -> None:
        await self.start()
        # Beside the syncs: engines that restarted get the served LoRA adapter back.
        reconciler = asyncio.create_task(
            reconcile_forever(self.settings, self.redis, self.metrics), name="reconcile"
        )
        try:
            pending: VersionReady | None = None
            while True:
                newest = await self._next_announcement(block=pending is None)
                if newest is not None and (pending is None or newest.version > pending.version):
                    pending = newest
                if pending is None or pending.version <= max(self.served, self.given_up):
                    pending = await self._converge()
                    if pending is None:
                        continue
                pending = await self._sync(pending)
        finally:
            reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reconciler

    async def _converge(self) -> VersionReady | None:
        """The served version, to sync again, when a replica left it (at most every
        reconcile_interval_s, never while a sync holds the lock)."""
        now = asyncio.get_running_loop().time()
        if now - self._checked_at < self.settings.launcher.reconcile_interval_s:
            return None
        self._checked_at = now
        if await self.redis.exists(self.settings.sync.lock_key):
            return None
        try:
            served = await read_served(self.redis, self.settings.sync.served_key)
        except ValueError as exc:
            log.error("cannot compare the replicas with the served version: %s", exc)
            return None
        if served is None:
            return None  # nothing synced yet: the engines serve their initial weights
        cause = await divergence(self.settings, served)
        if cause is None:
            return None
        self.metrics.convergence_syncs.labels(cause=cause).inc()
        log.warning(
            "%s left the served version v%d%s: syncing it again",
            "an engine" if cause == "engines" else "a gateway",
            served.version,
            f" ({served.adapter})" if served.adapter else "",
        )
        return VersionReady(served.version, served.path, 0, served.updated_at, served.adapter)

    async def _sync(self, ready: VersionReady) -> VersionReady | None:
        """Sync `ready`, retrying; returns a newer announcement that cut the retries short."""
        attempt = 0
        while attempt < self.settings.launcher.max_attempts:
            attempt += 1
            log.info("syncing v%d (attempt %d) from %s", ready.version, attempt, ready.path)
            code = await self.launch(ready)
            results = await self._collect_results()
            if code == 0:
                self.served = max(self.served, ready.version)
                return None
            if any(r.version == ready.version and r.outcome == "busy" for r in results):
                # Not a failure: another sync runs, or a dead one's lock has not expired.
                self.metrics.busy_waits.inc()
                attempt -= 1
                await self._wait_for_lock()
                newer = await self._next_announcement(block=False)
                if newer is not None and newer.version > ready.version:
                    return newer
                continue
            if not any(r.version == ready.version for r in results):
                self.metrics.syncs.labels(outcome="crashed").inc()
                # A job that died with the engines paused (retract) cannot continue them; the
                # gateways' leases end their pause by themselves, the engines' is ended here.
                for error in await continue_every_engine(self.settings.engines):
                    self.metrics.continue_failures.inc()
                    log.error("after a crashed sync: %s", error)
            log.warning("sync of v%d failed (exit code %d)", ready.version, code)
            newer = await self._next_announcement(block=False)
            if newer is not None and newer.version > ready.version:
                return newer  # newest wins: sync it instead
            await asyncio.sleep(self.settings.launcher.retry_backoff_s)
        log.error(
            "giving up on v%d after %d attempts; waiting for a newer version",
            ready.version,
            self.settings.launcher.max_attempts,
        )
        self.given_up = ready.version
        return None

    async def _wait_for_lock(self) -> None:
        """Until no sync holds the lock (it expires lock_ttl_s after a dead job's last
        renewal)."""
        log.info("the sync lock is held; waiting for it")
        while await self.redis.exists(self.settings.sync.lock_key):  # noqa: ASYNC110 (Redis)
            await asyncio.sleep(min(1.0, self.settings.sync.lock_ttl_s / 10))

    async def _next_announcement(self, *, block: bool) -> VersionReady | None:
        """The newest announcement after the last one read (waiting for one when `block`)."""
        stream = self.settings.redis.versions_stream
        reply = await self.redis.xread(
            {stream: self._versions_id}, count=1000, block=self.block_ms if block else None
        )
        newest = None
        for _, entries in reply or ():
            for entry_id, fields in entries:
                self._versions_id = entry_id
                try:
                    ready = VersionReady.from_fields(fields)
                except ValueError as exc:
                    log.error("skipping announcement %s: %s", entry_id, exc)
                    continue
                if newest is None or ready.version > newest.version:
                    newest = ready
        if newest is not None:
            self.metrics.announced_version.set(max(newest.version, self.served))
        return newest

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
