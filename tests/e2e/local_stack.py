"""`make run`'s stack (deploy/local/stack.py) for the end-to-end tests: the tiny model as policy
and judge, every port free and chosen here, the log kept in the run directory; stopped like
Ctrl-C (SIGTERM) and required to exit cleanly. Also the process-table helpers with which a test
checks that a stopped stack left no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.conftest import REPO, free_port, wait_until

MODEL = "smollm2-tiny"
PORTS = ("gateway", "grpc", "policy", "judge", "redis", "prometheus", "judge-grpc",
         "judge-metrics", "trainer-metrics", "sync-metrics")  # fmt: skip


@contextlib.contextmanager
def stack_process(
    run_dir: Path,
    ready: tuple[str, str],
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 480,
    stop_timeout_s: float = 60,
    new_session: bool = False,
) -> Iterator[tuple[subprocess.Popen, dict[str, int]]]:
    """stack.py's process and the running stack's ports by name, once `ready` (a port name and
    a path) answers 200. `args` and `env` go to stack.py on top of the ports, the models and the
    run directory; `new_session` starts it as the leader of its own process group (a test may
    then signal the group). At the end it gets a SIGTERM (unless a test stopped it already) and
    must exit with 0."""
    ports = {name: free_port() for name in PORTS}
    with (run_dir / "stack.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "deploy/local/stack.py"),
             "--policy-model", MODEL, "--judge-model", MODEL, "--run-dir", str(run_dir),
             *[arg for name in PORTS for arg in (f"--{name}-port", str(ports[name]))], *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session,
            env={**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml", **(env or {})},
        )  # fmt: skip
        port, path = ready
        url = f"http://127.0.0.1:{ports[port]}{path}"
        try:
            wait_until(lambda: httpx.get(url).status_code == 200, ready_timeout_s, url, proc)
        except Exception:
            proc.kill()
            print((run_dir / "stack.log").read_text())
            raise
        try:
            yield proc, ports
        finally:
            proc.send_signal(signal.SIGTERM)  # a no-op once the process was waited for
            assert proc.wait(timeout=stop_timeout_s) == 0


@contextlib.contextmanager
def local_stack(
    run_dir: Path,
    ready: tuple[str, str],
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 480,
    stop_timeout_s: float = 60,
) -> Iterator[dict[str, int]]:
    """The running stack's ports by name (stack_process without the process)."""
    with stack_process(run_dir, ready, *args, env=env, ready_timeout_s=ready_timeout_s,
                       stop_timeout_s=stop_timeout_s) as (_, ports):  # fmt: skip
        yield ports


def processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, session id, start time) of every process running now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] not in ("Z", "X"):  # a zombie nobody reaps counts as gone
            found[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return found


def descendants(root: int) -> dict[int, tuple[int, int, int]]:
    """Every process below `root`, however deep (Ray's workers are the raylet's children)."""
    table = processes()
    below, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, info in table.items():
            if info[0] == parent and pid not in below:
                below[pid] = info
                frontier.append(pid)
    return below


def left_of(stack: dict[int, tuple[int, int, int]]) -> list[int]:
    """The processes still running that were the stack's, or joined one of its sessions since
    (a worker the raylet started late)."""
    sessions = {info[1] for info in stack.values()}
    return [pid for pid, info in processes().items()
            if (pid in stack and stack[pid][2] == info[2]) or info[1] in sessions]  # fmt: skip
