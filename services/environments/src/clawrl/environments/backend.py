"""The sandbox backend protocol: what the lease service asks of a place that runs commands.

A backend makes a sandbox from a `SandboxSpec` (files seeded into its workspace, the tools on its
PATH, resource limits), runs shell commands in it (`exec`, one `ExecResult` each), gives it a fresh
workspace (`reset`), and destroys it. The lease service (leases.py) owns the leases, their TTLs
and the pool limit; a backend owns nothing but its sandboxes, so two backends can stand behind
the same API: `local` (bubblewrap on this host, local.py) and `kubernetes` (agent-sandbox claims
from a warm pool).

Contract every backend keeps:
- A command runs with `/workspace` as its working directory, as `sh -c <command>`; files written
  there persist between commands of the same sandbox until `reset` or `destroy`.
- `exec` never raises for what the command did (non-zero exit, timeout, a limit hit, output over
  the cap): that is all in the `ExecResult`. It raises `SandboxError` only when the backend
  itself failed (the sandbox is gone, the runtime could not start).
- A timed-out command is killed with everything it started (background children included)
  before `exec` returns.
- `destroy` is idempotent and leaves nothing behind: no process, no workspace.
- `list_live` names the sandboxes this backend (this `owner`) still holds, so a restarted
  service can destroy the ones no lease owns any more (a crashed service's leftovers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

WORKSPACE = "/workspace"


class SandboxError(Exception):
    """The backend failed (not the command): the sandbox is gone or could not be made."""


class IsolationUnavailable(SandboxError):
    """The host cannot isolate a sandbox (no namespaces, no bwrap): the service must not start."""


class SpecError(ValueError):
    """A sandbox spec the backend cannot honour (an unknown tool, a path outside the workspace)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of every command run in a sandbox. On the local backend they are rlimits
    of each process (memory and CPU are per process, the process count per sandbox); on
    Kubernetes they are the pod's."""

    cpu_s: int = 30  # CPU seconds of one process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space of one process (RLIMIT_AS)
    pids: int = 64  # processes in the sandbox at once (RLIMIT_NPROC)
    file_size_mb: int = 64  # largest file a process may write (RLIMIT_FSIZE)
    timeout_s: float = 30.0  # wall clock of one command; then the whole tree is killed
    output_bytes: int = 65536  # stdout and stderr are each cut at this many bytes

    def __post_init__(self) -> None:
        for name in ("cpu_s", "memory_mb", "pids", "file_size_mb", "timeout_s", "output_bytes"):
            if getattr(self, name) <= 0:
                raise SpecError(f"limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox starts with.

    files: workspace-relative path -> content, written before the first command.
    tools: executables (by name, e.g. "python3", "grep") the task needs on PATH, beside the
        backend's base set (a shell and coreutils). A backend with a fixed image may only check
        that they exist.
    setup: a shell script run once in the fresh workspace after seeding (its failure fails the
        reset); not counted as an agent's command.
    """

    files: Mapping[str, str | bytes] = field(default_factory=dict)
    tools: Sequence[str] = ()
    limits: Limits = field(default_factory=Limits)
    env: Mapping[str, str] = field(default_factory=dict)
    setup: str | None = None


@dataclass(frozen=True)
class SandboxHandle:
    """A live sandbox. `id` is unique per service; `data` holds what the backend needs to find
    it again (a host directory, a pod or claim name), as strings so a handle can be listed."""

    id: str
    backend: str
    data: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult:
    """What one command did. exit_code follows the shell: 128 + N when signal N ended it, and
    -1 when it was killed for its timeout (timed_out is then True)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False  # stdout or stderr was cut at limits.output_bytes
    duration_s: float = 0.0
    limit: str | None = None  # the limit it hit, when the backend can tell: cpu, file_size


@runtime_checkable
class SandboxBackend(Protocol):
    """A place that runs sandboxes. Every method is async and safe to call concurrently for
    different handles; the lease service never runs two commands in one sandbox at once."""

    name: str

    async def probe(self) -> None:
        """Check that isolation works on this host; raise IsolationUnavailable if not."""
        ...

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        """Make a sandbox with a fresh workspace seeded from spec (and its setup run)."""
        ...

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        tools: Sequence[str] = (),
    ) -> ExecResult:
        """Run `sh -c command` in the workspace. timeout_s defaults to the spec's limit; tools
        adds executables for this command only (a checker's interpreter)."""
        ...

    async def reset(self, handle: SandboxHandle, spec: SandboxSpec) -> SandboxHandle:
        """Kill what runs in the sandbox and give it a fresh workspace seeded from spec."""
        ...

    async def destroy(self, handle: SandboxHandle) -> None:
        """Kill everything in the sandbox and remove it; a second call does nothing."""
        ...

    async def list_live(self) -> list[SandboxHandle]:
        """The sandboxes this backend still holds (for reclaiming leftovers at start)."""
        ...

    async def aclose(self) -> None:
        """Release the backend's own resources (clients); sandboxes are destroyed first."""
        ...
