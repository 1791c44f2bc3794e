"""`make run`'s whole stack, stopped by a supervisor that sends TERM to its process group twice
(the second while the stop is under way): it exits cleanly and leaves no process behind, Redis,
engines, gateway, judge, trainer, Ray's raylet and workers and the weight-sync launcher
included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port, wait_until
from tests.e2e.local_stack import MODEL, PORTS

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


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


def test_two_terms_to_the_group_leave_no_process_behind(tmp_path) -> None:
    ports = {name: free_port() for name in PORTS}
    log = (tmp_path / "stack.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "deploy/local/stack.py"),
         "--policy-model", MODEL, "--judge-model", MODEL, "--run-dir", str(tmp_path),
         *[arg for name in PORTS for arg in (f"--{name}-port", str(ports[name]))]],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml"},
    )  # fmt: skip
    stack: dict[int, tuple[int, int, int]] = {}
    try:
        # The weight-sync launcher is the last to start: then everything is up.
        url = f"http://127.0.0.1:{ports['sync-metrics']}/metrics"
        wait_until(lambda: httpx.get(url).status_code == 200, 480, url, proc)
        stack = descendants(proc.pid)
        commands = " ".join(Path(f"/proc/{pid}/cmdline").read_text() for pid in stack)
        assert "redis-server" in commands and "raylet" in commands and "ray::" in commands
        os.killpg(proc.pid, signal.SIGTERM)
        # One of its processes is gone: the stop is under way.
        wait_until(lambda: len(left_of(stack)) < len(stack), 60, "the first service's end")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "stack.log").read_text()[-3000:]
        wait_until(lambda: not left_of(stack), 30, "the end of every process of the stack")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in left_of(stack) if stack else []:
            os.kill(pid, signal.SIGKILL)
