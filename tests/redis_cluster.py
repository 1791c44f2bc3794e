"""A real Redis Cluster for tests and benchmarks: `primaries` redis-server processes in cluster
mode on free ports (cluster bus ports chosen free too), joined by `redis-cli --cluster create`
with no replicas, each primary owning one contiguous third (for 3) of the slots."""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ChildProcess, free_port, wait_until


@dataclass
class Cluster:
    ports: list[int]
    children: list[ChildProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed node's URL (`[redis] cluster = true` discovers the others)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for child in self.children:
            child.stop()


def _ask(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(command)
        return sock.recv(4096)


def start_cluster(log_dir: Path, primaries: int = 3, name: str = "redis-cluster") -> Cluster:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("redis-server and redis-cli are needed (make setup installs them)")
    cluster = Cluster([free_port() for _ in range(primaries)])
    try:
        for port in cluster.ports:
            node_dir = log_dir / f"{name}-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            child = ChildProcess(f"{name}-{port}", [
                server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-port", str(free_port()), "--cluster-config-file", "nodes.conf",
            ], log_dir)  # fmt: skip
            cluster.children.append(child)
            wait_until(lambda p=port: _ask(p, b"PING\r\n").startswith(b"+PONG"), 10,
                       child.name, child.proc)  # fmt: skip
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        for port in cluster.ports:
            wait_until(lambda p=port: b"cluster_state:ok" in _ask(p, b"CLUSTER INFO\r\n"), 30,
                       f"{name}-{port} joining")  # fmt: skip
    except BaseException:
        cluster.stop()
        raise
    return cluster
