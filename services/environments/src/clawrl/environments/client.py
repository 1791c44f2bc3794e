"""An async client of the sandbox service's lease API (what the agent runner uses).

The calls and their fields are OpenClaw-RL's pool server's (`terminal-rl/env_client.py` speaks
the same): allocate -> reset -> exec_tool ... -> evaluate -> close, with heartbeats between.

    async with SandboxClient("http://localhost:8090") as client:
        async with client.lease("sort-numbers") as lease:        # allocate + heartbeats + close
            reset = await lease.reset({"task_name": "sort-numbers", "instruction": "...",
                                       "files": {"in.txt": "3\\n1\\n"}, "tools": ["sort"],
                                       "checker": "sort -n in.txt | cmp - out.txt"})
            tool = await lease.exec_tool("shell_exec", {"command": "sort -n in.txt > out.txt"})
            verdict = await lease.evaluate()                     # verdict.passed, verdict.score

`task_meta` keys (see api.py): task_name, instruction, files {path: text}, tools [names],
setup (script), checker (script, exit 0 = pass), checker_tools [names], limits {cpu_s,
memory_mb, pids, file_size_mb, timeout_s, output_bytes}, env {name: value}.

Errors: every non-ok answer raises `SandboxServiceError` (status, code, message);
`PoolExhausted` (429, retry later) and `LeaseNotFound` (404: expired or closed) are subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from clawrl.environments.backend import ExecResult

log = logging.getLogger(__name__)


class SandboxServiceError(RuntimeError):
    """The service answered {"ok": false}: status is the HTTP status, code a stable word."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class PoolExhausted(SandboxServiceError):
    """Every lease is taken (429): retry after a while."""


class LeaseNotFound(SandboxServiceError):
    """The lease expired, was closed or never existed (404)."""


@dataclass(frozen=True)
class ResetResult:
    user_msg: str
    tool_schemas: list[dict[str, Any]]
    tools: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ToolResult:
    observation: str  # what the model reads as the tool message
    result: ExecResult | None  # None when the call itself was invalid (unknown tool, ...)


@dataclass(frozen=True)
class Evaluation:
    score: float  # 1.0 when the checker exited 0, else 0.0
    passed: bool
    exit_code: int
    output: str
    timed_out: bool = False
    duration_s: float = 0.0


def _exec_result(data: Mapping[str, Any] | None) -> ExecResult | None:
    if not data:
        return None
    return ExecResult(
        stdout=data["stdout"],
        stderr=data["stderr"],
        exit_code=data["exit_code"],
        timed_out=data.get("timed_out", False),
        truncated=data.get("truncated", False),
        duration_s=data.get("duration_s", 0.0),
        limit=data.get("limit"),
    )


class SandboxClient:
    """One HTTP connection pool to the service; close it (or use `async with`)."""

    def __init__(
        self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        response = await self._http.post(path, json=dict(body))
        try:
            data = response.json()
        except ValueError:
            data = {"ok": False, "code": "BAD_RESPONSE", "error": response.text[:500]}
        if response.is_success and data.get("ok"):
            return data
        code, message = str(data.get("code", "ERROR")), str(data.get("error", data))
        error = {429: PoolExhausted, 404: LeaseNotFound}.get(response.status_code)
        raise (error or SandboxServiceError)(response.status_code, code, message)

    async def allocate(self, task_key: str, request_id: str | None = None) -> str:
        """A new lease's id (the same one again for a repeated request_id)."""
        data = await self._post("/allocate", {"task_key": task_key, "request_id": request_id})
        return str(data["lease_id"])

    async def heartbeat(self, lease_id: str) -> float:
        """Renew the lease; returns its seconds left."""
        data = await self._post("/heartbeat", {"lease_id": lease_id})
        return float(data.get("expires_in_s", 0.0))

    async def reset(
        self,
        lease_id: str,
        task_meta: Mapping[str, Any],
        run_ctx: Mapping[str, Any] | None = None,
        task_timeouts: Mapping[str, Any] | None = None,
    ) -> ResetResult:
        """A fresh sandbox for the task (files seeded, setup run)."""
        body = {
            "lease_id": lease_id,
            "task_meta": dict(task_meta),
            "run_ctx": dict(run_ctx or {}),
            "task_timeouts": dict(task_timeouts) if task_timeouts else None,
        }
        data = await self._post("/reset", body)
        return ResetResult(data["user_msg"], data["tool_schemas"], data.get("tools", []))

    async def exec_tool(
        self, lease_id: str, name: str, arguments: Mapping[str, Any] | str
    ) -> ToolResult:
        """Run one tool call; an invalid call comes back as an observation, not an error.
        arguments: an object, or the JSON string an OpenAI tool call carries (sent as is)."""
        args = arguments if isinstance(arguments, str) else dict(arguments)
        body = {"lease_id": lease_id, "tool_call": {"name": name, "arguments": args}}
        data = await self._post("/exec_tool", body)
        return ToolResult(str(data["observation"]), _exec_result(data.get("result")))

    async def evaluate(
        self, lease_id: str, checker: str | None = None, timeout_s: float | None = None
    ) -> Evaluation:
        """Run the checker (the reset's task_meta.checker unless given) in the sandbox."""
        body: dict[str, Any] = {"lease_id": lease_id}
        if checker is not None:
            body["checker"] = checker
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        data = await self._post("/evaluate", body)
        return Evaluation(
            score=float(data["score"]),
            passed=bool(data["passed"]),
            exit_code=int(data["exit_code"]),
            output=str(data.get("output", "")),
            timed_out=bool(data.get("timed_out", False)),
            duration_s=float(data.get("duration_s", 0.0)),
        )

    async def close(self, lease_id: str) -> bool:
        """Release the lease and destroy its sandbox; False when it was already gone."""
        data = await self._post("/close", {"lease_id": lease_id})
        return bool(data.get("found", False))

    async def health(self) -> dict[str, Any]:
        response = await self._http.get("/health")
        response.raise_for_status()
        return response.json()

    @contextlib.asynccontextmanager
    async def lease(
        self, task_key: str, *, heartbeat_s: float = 10.0, request_id: str | None = None
    ) -> AsyncIterator[Lease]:
        """Allocate, heartbeat every heartbeat_s in the background, and close on the way out
        (also on cancellation). A runner killed outright is covered by the lease's TTL."""
        lease = Lease(self, await self.allocate(task_key, request_id))
        beats = asyncio.create_task(lease.beat_forever(heartbeat_s))
        try:
            yield lease
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
            try:
                await asyncio.shield(self.close(lease.lease_id))
            except (httpx.HTTPError, SandboxServiceError) as exc:
                log.warning(
                    "closing lease %s failed (its TTL reclaims it): %s", lease.lease_id, exc
                )


@dataclass
class Lease:
    """A lease bound to its client: the calls without the lease id."""

    client: SandboxClient
    lease_id: str

    async def reset(self, task_meta: Mapping[str, Any], **kwargs: Any) -> ResetResult:
        return await self.client.reset(self.lease_id, task_meta, **kwargs)

    async def exec_tool(self, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
        return await self.client.exec_tool(self.lease_id, name, arguments)

    async def evaluate(
        self, checker: str | None = None, timeout_s: float | None = None
    ) -> Evaluation:
        return await self.client.evaluate(self.lease_id, checker, timeout_s)

    async def beat_forever(self, interval_s: float) -> None:
        """Heartbeat until cancelled; a failed beat is logged and retried on the next tick."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.client.heartbeat(self.lease_id)
            except LeaseNotFound:
                log.warning("lease %s is gone; heartbeats stop", self.lease_id)
                return
            except (httpx.HTTPError, SandboxServiceError) as exc:
                log.warning("heartbeat of lease %s failed: %s", self.lease_id, exc)
