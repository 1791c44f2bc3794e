"""The lease pool: who holds which sandbox, for how long, and the one core every route calls.

A lease is granted by /allocate (a slot, no sandbox yet), gets its sandbox at /reset, runs tool
calls and checkers, and ends at /close or when its TTL passes with no call (any call renews it;
/heartbeat exists to renew it while the runner thinks). A lease whose command is still running
does not expire under it. Expired leases are closed by the reaper, and also found at the next
call or allocation, so a lease past its TTL is gone whatever the reaper's timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from clawrl.environments import tools
from clawrl.environments.backend import (
    ExecResult,
    Limits,
    SandboxBackend,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SpecError,
)
from clawrl.environments.metrics import EnvironmentsMetrics
from clawrl.environments.protocol import TaskMeta, eval_timeout, spec_of
from clawrl.environments.settings import LeaseSettings

log = logging.getLogger(__name__)

# The checker reaches the sandbox on stdin and lives in the command's private /tmp, so the agent
# never saw it and it is gone after the run. A script without "#!" runs under sh.
CHECKER_PATH = "/tmp/.clawrl-checker"
RUN_EXECUTABLE = f"cat > {CHECKER_PATH} && chmod 700 {CHECKER_PATH} && exec {CHECKER_PATH}"
RUN_SHELL = f"cat > {CHECKER_PATH} && exec sh {CHECKER_PATH}"
CHECKER_OUTPUT_CHARS = 4000


class LeaseError(Exception):
    """A request the pool refuses; status and code go to the client as they are."""

    status = 400
    code = "BAD_REQUEST"


class LeaseNotFound(LeaseError):
    status, code = 404, "LEASE_NOT_FOUND"


class PoolExhausted(LeaseError):
    status, code = 429, "POOL_EXHAUSTED"


class NotReset(LeaseError):
    status, code = 409, "NOT_RESET"


class BadTask(LeaseError):
    status, code = 400, "BAD_TASK"


class SandboxFailed(LeaseError):
    status, code = 503, "SANDBOX_ERROR"


@dataclass
class Lease:
    lease_id: str
    task_key: str
    expires_at: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    handle: SandboxHandle | None = None
    task: TaskMeta | None = None
    spec: SandboxSpec | None = None
    eval_timeout_s: float | None = None
    busy: int = 0  # commands in flight: a busy lease does not expire
    closed: bool = False


@dataclass(frozen=True)
class Verdict:
    passed: bool
    result: ExecResult
    output: str

    @property
    def score(self) -> float:
        return 1.0 if self.passed else 0.0


def outcome_of(result: ExecResult) -> str:
    return "timeout" if result.timed_out else "ok" if result.exit_code == 0 else "failed"


def parse_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any]:
    """A tool call's arguments as an object (OpenAI sends a JSON string)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise tools.ToolCallError(f"arguments are not valid JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise tools.ToolCallError("arguments must be a JSON object")
    return arguments


class LeasePool:
    """Leases over one backend. Every public method is one route's work."""

    def __init__(
        self,
        backend: SandboxBackend,
        settings: LeaseSettings,
        defaults: Limits,
        ceilings: Limits,
        metrics: EnvironmentsMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend, self.settings, self.metrics, self.clock = backend, settings, metrics, clock
        self.defaults, self.ceilings = defaults, ceilings
        self._leases: dict[str, Lease] = {}
        self._requests: dict[tuple[str, str], tuple[str, float]] = {}
        self._lock = asyncio.Lock()
        self.metrics.leases_limit.set(settings.max_leases)

    # --- lookup and expiry -----------------------------------------------------------------

    def _touch(self, lease: Lease) -> None:
        lease.expires_at = self.clock() + self.settings.ttl_s

    def _expired(self, lease: Lease) -> bool:
        return lease.busy == 0 and lease.expires_at <= self.clock()

    async def _get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.closed:
            raise LeaseNotFound(f"unknown lease {lease_id!r} (closed, expired or never granted)")
        if self._expired(lease):
            await self.close(lease_id, reason="expired")
            raise LeaseNotFound(f"lease {lease_id!r} expired (no call for {self.settings.ttl_s}s)")
        self._touch(lease)
        return lease

    async def reap_expired(self) -> int:
        """Close every expired lease; returns how many."""
        expired = [lid for lid, lease in list(self._leases.items()) if self._expired(lease)]
        for lease_id in expired:
            log.warning("lease %s expired: closing it and destroying its sandbox", lease_id)
            await self.close(lease_id, reason="expired")
        return len(expired)

    async def run_reaper(self) -> None:
        """Reap expired leases every reap_interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            try:
                await self.reap_expired()
            except Exception:
                self.metrics.backend_errors.labels("reap").inc()
                log.exception("reaping expired leases failed; trying again next round")

    # --- lifecycle ------------------------------------------------------------------------

    async def allocate(self, task_key: str, request_id: str | None) -> tuple[Lease, bool]:
        """A new lease (or the one a repeated request_id got); PoolExhausted when full."""
        await self.reap_expired()
        async with self._lock:
            now = self.clock()
            self._requests = {
                k: v for k, v in self._requests.items() if v[1] > now and v[0] in self._leases
            }
            if request_id and (task_key, request_id) in self._requests:
                lease = self._leases[self._requests[(task_key, request_id)][0]]
                self._touch(lease)
                self.metrics.allocations.labels("reused").inc()
                return lease, True
            if len(self._leases) >= self.settings.max_leases:
                self.metrics.allocations.labels("pool_exhausted").inc()
                log.warning("pool exhausted: %d leases held", len(self._leases))
                raise PoolExhausted(
                    f"all {self.settings.max_leases} leases are held; retry after one closes"
                )
            lease = Lease(f"lease-{uuid.uuid4().hex[:20]}", task_key, now + self.settings.ttl_s)
            self._leases[lease.lease_id] = lease
            if request_id:
                self._requests[(task_key, request_id)] = (
                    lease.lease_id,
                    now + self.settings.request_id_ttl_s,
                )
            self.metrics.allocations.labels("granted").inc()
            self.metrics.leases_active.set(len(self._leases))
        log.info("lease %s granted for task %s", lease.lease_id, task_key)
        return lease, False

    async def heartbeat(self, lease_id: str) -> Lease:
        return await self._get(lease_id)

    def expires_in(self, lease: Lease) -> float:
        return max(0.0, lease.expires_at - self.clock())

    async def reset(
        self, lease_id: str, task: TaskMeta, task_timeouts: dict[str, Any] | None = None
    ) -> Lease:
        """A fresh sandbox for the task: the old one (if any) is replaced."""
        lease = await self._get(lease_id)
        try:
            spec = spec_of(task, self.defaults, self.ceilings)
        except SpecError as exc:
            self.metrics.resets.labels("bad_task").inc()
            raise BadTask(str(exc)) from exc
        async with self._busy(lease):
            try:
                if lease.handle is None:
                    lease.handle = await self.backend.create(lease_id, spec)
                else:
                    lease.handle = await self.backend.reset(lease.handle, spec)
            except SpecError as exc:
                lease.handle, lease.task = None, None
                self.metrics.resets.labels("bad_task").inc()
                log.warning("reset of lease %s refused: %s", lease_id, exc)
                raise BadTask(str(exc)) from exc
            except SandboxError as exc:
                lease.handle, lease.task = None, None
                self.metrics.resets.labels("error").inc()
                self.metrics.backend_errors.labels("reset").inc()
                log.error("reset of lease %s failed: %s", lease_id, exc)
                raise SandboxFailed(str(exc)) from exc
            lease.task, lease.spec = task, spec
            lease.eval_timeout_s = eval_timeout(task_timeouts)
        if lease.closed:  # closed while the sandbox was being made: do not leak it
            await self._destroy(lease)
            raise LeaseNotFound(f"lease {lease_id!r} was closed during the reset")
        self.metrics.resets.labels("ok").inc()
        return lease

    async def close(self, lease_id: str, reason: str = "closed") -> bool:
        """End the lease and destroy its sandbox; False when it was already gone."""
        async with self._lock:
            lease = self._leases.pop(lease_id, None)
            self.metrics.leases_active.set(len(self._leases))
        if lease is None:
            return False
        lease.closed = True
        self.metrics.leases_closed.labels(reason).inc()
        await self._destroy(lease)
        log.info("lease %s %s", lease_id, reason)
        return True

    async def _destroy(self, lease: Lease) -> None:
        handle, lease.handle = lease.handle, None
        if handle is None:
            return
        try:
            await self.backend.destroy(handle)
        except Exception:
            self.metrics.backend_errors.labels("destroy").inc()
            log.exception("destroying the sandbox of lease %s failed", lease.lease_id)

    async def reclaim_leftovers(self) -> int:
        """Destroy the backend's sandboxes no lease owns (an earlier process's)."""
        owned = {lease.handle.id for lease in self._leases.values() if lease.handle}
        stale = [h for h in await self.backend.list_live() if h.id not in owned]
        removed = 0
        for handle in stale:
            log.warning("removing leftover sandbox %s", handle.id)
            try:
                await self.backend.destroy(handle)
            except Exception:  # one stuck leftover must not keep the service from starting
                self.metrics.backend_errors.labels("reclaim").inc()
                log.exception("leftover sandbox %s could not be removed", handle.id)
                continue
            self.metrics.leftovers.inc()
            removed += 1
        return removed

    async def shutdown(self) -> None:
        for lease_id in list(self._leases):
            await self.close(lease_id, reason="shutdown")

    def status(self) -> dict[str, Any]:
        return {
            "max_leases": self.settings.max_leases,
            "active_leases": len(self._leases),
            "leases": [
                {
                    "lease_id": lease.lease_id,
                    "task_key": lease.task_key,
                    "reset": lease.handle is not None,
                    "expires_in_s": round(self.expires_in(lease), 3),
                }
                for lease in self._leases.values()
            ],
        }

    # --- commands -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _busy(self, lease: Lease) -> AsyncIterator[None]:
        """Hold the lease's lock, and keep it from expiring, while a command runs."""
        lease.busy += 1
        try:
            async with lease.lock:
                yield
        finally:
            lease.busy -= 1
            self._touch(lease)

    async def _run(
        self, lease: Lease, kind: str, command: str, *, timeout_s: float, **kwargs: Any
    ) -> ExecResult:
        """One command in the lease's sandbox, counted and timed."""
        if lease.handle is None or lease.spec is None:
            raise NotReset(f"lease {lease.lease_id!r} has no sandbox yet: call /reset first")
        try:
            result = await self.backend.exec(lease.handle, command, timeout_s=timeout_s, **kwargs)
        except SpecError as exc:  # e.g. a checker tool this host does not have
            self.metrics.commands.labels(kind, "error").inc()
            log.warning("command in lease %s refused: %s", lease.lease_id, exc)
            raise BadTask(str(exc)) from exc
        except SandboxError as exc:
            self.metrics.commands.labels(kind, "error").inc()
            if lease.closed:
                raise LeaseNotFound(f"lease {lease.lease_id!r} was closed while it ran") from exc
            self.metrics.backend_errors.labels("exec").inc()
            log.error("command in lease %s failed in the sandbox: %s", lease.lease_id, exc)
            raise SandboxFailed(str(exc)) from exc
        self.metrics.commands.labels(kind, outcome_of(result)).inc()
        self.metrics.command_seconds.labels(kind).observe(result.duration_s)
        for limit in ("timeout" if result.timed_out else None, result.limit):
            if limit:
                self.metrics.limit_hits.labels(limit).inc()
        if result.truncated:
            self.metrics.limit_hits.labels("output").inc()
        if result.timed_out or result.limit:
            log.info(
                "command in lease %s hit a limit: %s",
                lease.lease_id,
                "timeout" if result.timed_out else result.limit,
            )
        return result

    async def exec_tool(
        self, lease_id: str, name: str, arguments: dict[str, Any] | str | None
    ) -> tuple[str, ExecResult | None]:
        """Run one tool call: (observation, result); an invalid call is only an observation."""
        lease = await self._get(lease_id)
        if lease.spec is None:
            raise NotReset(f"lease {lease_id!r} has no sandbox yet: call /reset first")
        try:
            command = tools.command_of(name, parse_arguments(arguments))
        except tools.ToolCallError as exc:
            self.metrics.invalid_tool_calls.inc()
            log.info("invalid tool call in lease %s: %s", lease_id, exc)
            return f"[TOOL_ERROR] {name}: {exc}", None
        limit = lease.spec.limits.timeout_s
        timeout = min(command.timeout_s, limit) if command.timeout_s else limit
        async with self._busy(lease):
            result = await self._run(
                lease, "tool", command.command, timeout_s=timeout, stdin=command.stdin
            )
        return tools.observation(result), result

    async def evaluate(
        self, lease_id: str, checker: str | None = None, timeout_s: float | None = None
    ) -> Verdict:
        """Run the checker in the lease's sandbox: passed when it exits 0 within its time."""
        lease = await self._get(lease_id)
        if lease.task is None:
            raise NotReset(f"lease {lease_id!r} has no sandbox yet: call /reset first")
        script = checker if checker is not None else lease.task.checker
        if not script or not script.strip():
            raise LeaseError("no checker: give `checker` here or task_meta.checker at /reset")
        timeout = min(
            timeout_s or lease.eval_timeout_s or self.settings.eval_timeout_s,
            self.ceilings.timeout_s,
        )
        command = RUN_EXECUTABLE if script.startswith("#!") else RUN_SHELL
        async with self._busy(lease):
            try:
                result = await self._run(
                    lease, "evaluate", command, timeout_s=timeout, stdin=script.encode(),
                    tools=tuple(lease.task.checker_tools),
                )  # fmt: skip
            except SandboxFailed:
                self.metrics.evaluations.labels("error").inc()
                raise
        passed = result.exit_code == 0 and not result.timed_out
        self.metrics.evaluations.labels("passed" if passed else "failed").inc()
        output = tools.observation(result)[-CHECKER_OUTPUT_CHARS:]
        log.info("lease %s evaluated: %s", lease_id, "passed" if passed else "failed")
        return Verdict(passed, result, output)
