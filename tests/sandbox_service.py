"""The sandbox service (`clawrl-environments`) as a real child process on a free port, for tests
of the lease API and of what calls it (the agent runner)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until


def sandbox_root() -> Path:
    """A directory for sandboxes that the sandbox uid can traverse (pytest's tmp_path is 0700
    and root-owned, which a root service's sandboxes, run as another uid, could not reach)."""
    root = Path(tempfile.mkdtemp(prefix="clawrl-sandboxes-"))
    root.chmod(0o711)
    return root


class SandboxService:
    """One `clawrl-environments` process; `env` adds CLAWRL_* settings."""

    def __init__(self, log_dir: Path, root: Path, name: str = "environments", **env: str):
        self.port = free_port()
        self.root = root
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",  # only the settings given here
            "CLAWRL_ENVIRONMENTS_SERVER__PORT": str(self.port),
            "CLAWRL_SANDBOX__ROOT_DIR": str(root),
            **env,
        }
        self.child = ChildProcess(name, [str(VENV_BIN / "clawrl-environments")], log_dir, self.env)
        wait_until(self.healthy, 30, name, self.child.proc)

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=2).status_code == 200

    def alive(self) -> bool:
        return self.child.proc.poll() is None

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0.0 when the series does not exist yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            if series == (f"{name}{{{want}}}" if want else name):
                return float(value)
        return 0.0

    def kill(self) -> None:
        """SIGKILL: the service dies with no chance to clean up."""
        self.child.proc.send_signal(signal.SIGKILL)
        self.child.proc.wait(timeout=10)

    def stop(self) -> None:
        self.child.stop()


@contextmanager
def sandbox_service(log_dir: Path, **env: str) -> Iterator[SandboxService]:
    root = sandbox_root()
    service = SandboxService(log_dir, root, **env)
    try:
        yield service
    finally:
        service.stop()
        shutil.rmtree(root, ignore_errors=True)


def unique_marker() -> str:
    """Digits no other process on the host has in its command line: put them in a sleep's
    seconds (`sleep 1<marker>`, at most 5 in front: Python's time.sleep takes < 9.2e9 s)."""
    return f"{uuid.uuid4().int % 10**8:08d}.{uuid.uuid4().int % 10**4:04d}"


def processes_with(marker: str) -> list[str]:
    """Command lines of this host's live processes that contain `marker` (zombies aside)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and entry.name != str(os.getpid()):
            found.append(f"{entry.name}: {cmdline}")
    return found


def wait_no_processes(marker: str, timeout_s: float = 5.0) -> list[str]:
    """The processes with `marker` still alive after up to timeout_s (empty when all ended)."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
