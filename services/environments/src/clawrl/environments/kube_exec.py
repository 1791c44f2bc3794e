"""The kubernetes backend's commands inside a sandbox pod: the shell scripts it execs there, their
argument lists, how their output is read back, and the transports that carry them (pod exec
through the API server; a local process for tests). No Kubernetes API objects here.

Every command is one pod exec of `sh -c <RUN_SCRIPT>` with the command and its limits as
arguments, so the sandbox needs nothing but sh and coreutils (no server, no network):
- the command runs as `sh -c` in the workspace under `timeout`, with rlimits set by `ulimit`
  (CPU seconds, address space, file size, no core files) and the task's environment;
- its stdout and stderr go to files in a scratch directory and only their first `cap + 1`
  bytes come back (a chatty command never floods the API server);
- `timeout` leads its own process group and kills all of it at the deadline; then every other
  process of the sandbox is killed (`kill -9 -1` spares only the pod's pid 1 and the script),
  so nothing a command started outlives it, setsid or not, as on the local backend;
- /tmp is emptied after each command (the local backend gives each command a /tmp of its own);
- the last stdout line is `<marker> <exit code> <timed out>`, the marker a random token the
  command cannot know, so what the command printed can never pass for the verdict.

Data going in (stdin, seeded files) travels base64-encoded in the arguments, in chunks that
stay far below Linux's 128 KiB limit on one argument; exec's stdin channel is not used (closing
it needs the v5 streaming protocol, Kubernetes 1.30+).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import secrets
import subprocess
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from clawrl.environments.backend import ExecResult, Limits, SandboxError
from clawrl.environments.local import limit_of

SCRATCH = "/tmp"
CHUNK_BYTES = 48 * 1024  # raw bytes per argument (64 KiB as base64)
EXIT_SCRIPT_FAILED = 125  # the script itself could not run the command (disk full, no ulimit)

RUN_SCRIPT = r"""
ws=$1 tmp=$2 t=$3 cap=$4 cpu=$5 mem=$6 fsize=$7 reap=$8 marker=$9
shift 9
cmd=$1 input=$2
shift 2
d=$(mktemp -d "$tmp/.clawrl-exec.XXXXXX") || exit 125
case $input in
  file:*) mv "${input#file:}" "$d/in" || exit 125 ;;
  *) printf %s "${input#b64:}" | base64 -d >"$d/in" || exit 125 ;;
esac
(
  cd "$ws" || exit 125
  ulimit -c 0 && ulimit -v "$mem" && ulimit -f "$fsize" || exit 125
  # CPU: SIGXCPU at the soft limit (exit 152, "cpu"), SIGKILL a second later at the hard one.
  ulimit -S -t "$cpu" && ulimit -H -t "$((cpu + 1))" || exit 125
  exec timeout -v -s KILL "$t" env "$@" sh -c \
    'exec sh -c "$1" <"$2/in" >"$2/out" 2>"$2/err"' sh "$cmd" "$d" 2>"$d/why"
)
rc=$?
to=0
[ -s "$d/why" ] && to=1
if [ "$reap" = 1 ]; then kill -9 -1 2>/dev/null; fi
head -c "$((cap + 1))" "$d/out"
head -c "$((cap + 1))" "$d/err" >&2
for f in "$tmp"/* "$tmp"/.[!.]* "$tmp"/..?*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  [ "$f" = "$d" ] && continue
  chmod -R u+rwX "$f" 2>/dev/null; rm -rf "$f"
done
rm -rf "$d"
printf '\n%s %s %s\n' "$marker" "$rc" "$to"
"""

# A fresh workspace: every process but pid 1 killed, the workspace and /tmp emptied (a command
# may have made a directory unreadable: chmod first), then checked empty.
WIPE_SCRIPT = r"""
ws=$1 tmp=$2 reap=$3
if [ "$reap" = 1 ]; then kill -9 -1 2>/dev/null; fi
for dir in "$ws" "$tmp"; do
  chmod -R u+rwX "$dir" 2>/dev/null
  find "$dir" -mindepth 1 -maxdepth 1 -exec rm -rf {} + || exit 1
  [ -z "$(ls -A "$dir")" ] || { echo "$dir is not empty after the wipe" >&2; exit 1; }
done
"""

# Append one base64 chunk to a file (a seed archive, a large stdin).
APPEND_SCRIPT = 'printf %s "$2" | base64 -d >>"$1"'

# Unpack the seed archive into the workspace and remove it.
UNPACK_SCRIPT = 'tar -xf "$1" -C "$2" --no-same-owner && rm -f "$1"'

# The tools a task names that the sandbox image does not have, one per line.
MISSING_TOOLS_SCRIPT = 'for t in "$@"; do command -v "$t" >/dev/null 2>&1 || echo "$t"; done'


Output = tuple[bytes, bytes, int]  # stdout, stderr, exit code


class PodTransport(Protocol):
    """Runs an argument list in a sandbox pod's container and returns (stdout, stderr, exit
    code) once it ends; raises SandboxError when it could not be run (pod gone, API down)."""

    async def run(
        self, pod: str, argv: Sequence[str], timeout_s: float
    ) -> tuple[bytes, bytes, int]: ...


def sh(script: str, *args: str) -> list[str]:
    """`sh -c script sh args...`: the script reads its arguments as $1.."""
    return ["/bin/sh", "-c", script, "sh", *args]


def run_argv(
    command: str,
    limits: Limits,
    timeout_s: float,
    marker: str,
    *,
    env: Mapping[str, str],
    stdin: str,
    workspace: str,
    scratch: str = SCRATCH,
    reap: bool = True,
) -> list[str]:
    """The argument list of one command (see RUN_SCRIPT). stdin is "b64:<data>" or
    "file:<path in the pod>"."""
    return sh(
        RUN_SCRIPT,
        workspace,
        scratch,
        f"{max(timeout_s, 0.001):.3f}",
        str(limits.output_bytes),
        str(limits.cpu_s),
        str(limits.memory_mb * 1024),  # ulimit -v: KiB
        str(limits.file_size_mb * 2048),  # ulimit -f: 512-byte blocks
        "1" if reap else "0",
        marker,
        command,
        stdin,
        *[f"{name}={value}" for name, value in env.items()],
    )


@dataclass(frozen=True)
class RunOutput:
    """What RUN_SCRIPT reported: None for exit_code when its verdict line is missing."""

    stdout: bytes
    exit_code: int | None
    timed_out: bool


def parse_run(stdout: bytes, marker: str) -> RunOutput:
    """Split the command's stdout from the script's verdict line (the last one)."""
    head, sep, tail = stdout.rpartition(b"\n" + marker.encode() + b" ")
    if not sep:
        return RunOutput(stdout, None, False)
    fields = tail.split()
    try:
        code, timed_out = int(fields[0]), fields[1] == b"1"
    except (IndexError, ValueError):
        return RunOutput(stdout, None, False)
    return RunOutput(head, code, timed_out)


def cut(data: bytes, cap: int) -> tuple[bytes, bool]:
    return (data[:cap], True) if len(data) > cap else (data, False)


def chunks(data: bytes, size: int = CHUNK_BYTES) -> list[str]:
    """data as base64 arguments of at most `size` raw bytes each (one empty chunk for b"")."""
    return [
        base64.b64encode(data[i : i + size]).decode() for i in range(0, max(len(data), 1), size)
    ]


def seed_archive(files: Mapping[str, str | bytes]) -> bytes:
    """The task's files as one tar archive (paths already checked to stay in the workspace)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path, content in sorted(files.items()):
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class PodShell:
    """The commands of one sandbox pod, over a transport."""

    def __init__(
        self,
        transport: PodTransport,
        pod: str,
        *,
        workspace: str,
        scratch: str = SCRATCH,
        reap: bool = True,
        api_timeout_s: float = 30.0,
    ) -> None:
        self.transport, self.pod = transport, pod
        self.workspace, self.scratch, self.reap = workspace, scratch, reap
        self.api_timeout_s = api_timeout_s

    async def _helper(self, argv: list[str], what: str) -> bytes:
        """Run one of the backend's own scripts; SandboxError unless it exits 0."""
        out, err, code = await self.transport.run(self.pod, argv, self.api_timeout_s)
        if code != 0:
            message = (err or out).decode(errors="replace").strip()[-500:]
            raise SandboxError(f"{what} failed in pod {self.pod} (exit {code}): {message}")
        return out

    async def upload(self, path: str, data: bytes) -> None:
        """Write data to a file in the pod (appended chunk by chunk; the file must not exist)."""
        for chunk in chunks(data):
            await self._helper(sh(APPEND_SCRIPT, path, chunk), f"writing {path}")

    async def seed(self, files: Mapping[str, str | bytes]) -> None:
        if not files:
            return
        archive = f"{self.scratch}/.clawrl-seed-{secrets.token_hex(8)}.tar"
        await self.upload(archive, seed_archive(files))
        await self._helper(sh(UNPACK_SCRIPT, archive, self.workspace), "unpacking the files")

    async def missing_tools(self, tools: Sequence[str]) -> list[str]:
        if not tools:
            return []
        out = await self._helper(sh(MISSING_TOOLS_SCRIPT, *tools), "looking up tools")
        return out.decode(errors="replace").split()

    async def wipe(self) -> None:
        argv = sh(WIPE_SCRIPT, self.workspace, self.scratch, "1" if self.reap else "0")
        await self._helper(argv, "wiping the workspace")

    async def run(
        self,
        command: str,
        limits: Limits,
        timeout_s: float,
        *,
        env: Mapping[str, str],
        stdin: bytes | None,
    ) -> ExecResult:
        """One command to its end or its timeout (see RUN_SCRIPT)."""
        data = stdin or b""
        if len(data) <= CHUNK_BYTES:
            source = "b64:" + base64.b64encode(data).decode()
        else:
            path = f"{self.scratch}/.clawrl-stdin-{secrets.token_hex(8)}"
            await self.upload(path, data)
            source = f"file:{path}"
        marker = secrets.token_hex(16)
        argv = run_argv(
            command, limits, timeout_s, marker, env=env, stdin=source,
            workspace=self.workspace, scratch=self.scratch, reap=self.reap,
        )  # fmt: skip
        started = time.monotonic()
        # The script ends the command at timeout_s; the transport allows it the API's time on top.
        out, err, code = await self.transport.run(self.pod, argv, timeout_s + self.api_timeout_s)
        parsed = parse_run(out, marker)
        if parsed.exit_code is None or parsed.exit_code == EXIT_SCRIPT_FAILED:
            message = err.decode(errors="replace").strip()[-500:]
            raise SandboxError(f"the command could not run in pod {self.pod} ({code}): {message}")
        stdout, out_cut = cut(parsed.stdout, limits.output_bytes)
        stderr, err_cut = cut(err, limits.output_bytes)
        limit = None if parsed.timed_out else limit_of(parsed.exit_code, stderr)
        return ExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            exit_code=-1 if parsed.timed_out else parsed.exit_code,
            timed_out=parsed.timed_out,
            truncated=out_cut or err_cut,
            duration_s=time.monotonic() - started,
            limit=limit,
        )


class KubernetesExec:
    """Pod exec through the API server (the kubernetes client's websocket stream), one
    blocking call per command in a worker thread."""

    def __init__(self, core_api, namespace: str, container: str) -> None:
        self.core, self.namespace, self.container = core_api, namespace, container

    def _run(self, pod: str, argv: Sequence[str], timeout_s: float) -> tuple[bytes, bytes, int]:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import stream

        try:
            ws = stream(
                self.core.connect_get_namespaced_pod_exec, pod, self.namespace,
                container=self.container, command=list(argv), stdin=False, stdout=True,
                stderr=True, tty=False, _preload_content=False, binary=True,
            )  # fmt: skip
        except ApiException as exc:
            raise SandboxError(f"exec in pod {pod} refused: {exc.status} {exc.reason}") from exc
        except Exception as exc:  # websocket and connection errors have no common base
            raise SandboxError(f"exec in pod {pod} failed: {exc}") from exc
        try:
            ws.run_forever(timeout=timeout_s)
            if ws.is_open():
                raise SandboxError(f"exec in pod {pod} still running after {timeout_s:.0f}s")
            code = ws.returncode
            out, err = ws.read_channel(1), ws.read_channel(2)
        finally:
            ws.close()
        if code is None:
            raise SandboxError(f"exec in pod {pod} ended without an exit status")
        return _bytes(out), _bytes(err), int(code)

    async def run(
        self, pod: str, argv: Sequence[str], timeout_s: float
    ) -> tuple[bytes, bytes, int]:
        return await asyncio.to_thread(self._run, pod, argv, timeout_s)


class LocalPod:
    """A stand-in for a sandbox pod on this host (root only): a pid namespace whose pid 1 is
    `sleep infinity`, as the pod's is, and commands that join it with nsenter as pod exec joins
    the container. The scripts' `kill -9 -1` so reaches the namespace's processes only, and
    what a command leaves running stays until they kill it (the namespace outlives commands)."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.init_pid = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            "unshare", "--pid", "--fork", "--kill-child", "sleep", "infinity"
        )
        children = f"/proc/{self.proc.pid}/task/{self.proc.pid}/children"
        for _ in range(200):
            with contextlib.suppress(OSError):
                if pids := open(children).read().split():  # noqa: ASYNC230
                    self.init_pid = int(pids[0])
                    return
            await asyncio.sleep(0.01)
        raise SandboxError("the local pod's pid 1 did not start")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def run(self, pod: str, argv: Sequence[str], timeout_s: float) -> Output:
        proc = await asyncio.create_subprocess_exec(
            "nsenter", "--target", str(self.init_pid), "--pid", "--", *argv,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SandboxError(f"local exec still running after {timeout_s:.0f}s") from None
        return out, err, proc.returncode if proc.returncode is not None else -1


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else data
