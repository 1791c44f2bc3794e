"""Fixtures shared by every test layer: free ports, real child processes (redis-server, the CPU
engine) started once per session and stopped at the end."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORTS_GIVEN: set[int] = set()
_PORT_CHOICE = random.SystemRandom()  # not the seedable module state: runs must not agree


def free_port() -> int:
    """A port free now, never given before in this run, and below the kernel's ephemeral range.
    A port from bind(0) is an ephemeral one: an outgoing connection of a process started in the
    meantime could take it before the service it was meant for binds it (seen: a stack's
    metrics port was taken while the stack's other services started)."""
    low, high = 20000, _ephemeral_ports()[0] - 1
    if high - low < 1000:  # an unusual ephemeral range: let the kernel choose
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    while True:
        port = _PORT_CHOICE.randint(low, high)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        try:
            if check():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    """Until `url` answers 200; fails at once if `proc` exits first."""
    wait_until(lambda: httpx.get(url, timeout=1).status_code == 200, timeout_s, what, proc)


class ChildProcess:
    """A server started as a real child process, with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Torch in the test process computes on one thread. Two threads on a 2-core host whose
    other core serves the tests' engines and trainers spin against each other: a forward pass
    of the tiny model took 0.18-0.31 s on two, 0.02 s on one (nice 19, load 7). Reset before
    each test, as a backend under test may have set its own count."""
    torch = sys.modules.get("torch")  # never imported here: tests without torch stay light
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


def start_redis(
    port: int, log_dir: Path, name: str = "redis", aof_dir: Path | None = None
) -> ChildProcess:
    """A real redis-server on `port`, ready to answer PING: without persistence, or with
    `aof_dir` persisting every write there (appendfsync always), as a production one would."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (make setup installs it)")
    persistence = (
        ["--appendonly", "no", "--dir", str(log_dir)]
        if aof_dir is None
        else ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(aof_dir)]
    )
    child = ChildProcess(
        name,
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence],
        log_dir,
    )  # fmt: skip

    def ping() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    wait_until(ping, 10, name, child.proc)
    return child


@pytest.fixture(scope="session")
def redis_url(log_dir: Path) -> Iterator[str]:
    """A real redis-server on a free port for the whole session."""
    port = free_port()
    child = start_redis(port, log_dir)
    yield f"redis://127.0.0.1:{port}/0"
    child.stop()


class EngineFactory:
    """Starts `clawrl-engine` processes on demand, one per (model, extra args), reused."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: dict[tuple, tuple[ChildProcess, str]] = {}

    def __call__(self, model: str = "smollm2-tiny", *extra: str) -> str:
        key = (model, *extra)
        if key not in self.children:
            port = free_port()
            name = f"engine-{Path(model).name}-{port}"  # a model may be a path
            child = ChildProcess(
                name,
                [
                    str(VENV_BIN / "clawrl-engine"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--model",
                    model,
                    *extra,
                ],
                self.log_dir,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until(
                    lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200,
                    180,
                    name,
                    child.proc,
                )
            except Exception:
                print(child.log_tail())
                child.stop()
                raise
            self.children[key] = (child, url)
        return self.children[key][1]

    def stop_all(self) -> None:
        for child, _ in self.children.values():
            child.stop()


@pytest.fixture(scope="session")
def engine_factory(log_dir: Path) -> Iterator[EngineFactory]:
    """`engine_factory(model, *args)` -> base URL of a running CPU engine (started once)."""
    factory = EngineFactory(log_dir)
    yield factory
    factory.stop_all()
