"""`make run`'s stack (deploy/local/stack.py) for the end-to-end tests: the tiny model as policy
and judge, every port free and chosen here, the log kept in the run directory; stopped like
Ctrl-C (SIGTERM) and required to exit cleanly."""

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
def local_stack(
    run_dir: Path,
    ready: tuple[str, str],
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 480,
    stop_timeout_s: float = 60,
) -> Iterator[dict[str, int]]:
    """The running stack's ports by name, once `ready` (a port name and a path) answers 200.
    `args` and `env` go to stack.py on top of the ports, the models and the run directory."""
    ports = {name: free_port() for name in PORTS}
    with (run_dir / "stack.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "deploy/local/stack.py"),
             "--policy-model", MODEL, "--judge-model", MODEL, "--run-dir", str(run_dir),
             *[arg for name in PORTS for arg in (f"--{name}-port", str(ports[name]))], *args],
            stdout=log, stderr=subprocess.STDOUT,
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
            yield ports
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=stop_timeout_s) == 0
