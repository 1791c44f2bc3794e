"""A real Redis Cluster for tests and benchmarks: `primaries` redis-server processes in cluster
mode on free ports (cluster bus ports chosen free too), joined by `redis-cli --cluster create`,
each primary owning one contiguous third (for 3) of the slots; with `replicas` per primary, as
many more processes replicating them (for failover tests: a short `node_timeout_ms` makes a
replica take over a dead primary in ~2 s)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from clawrl.common.shards import Shards
from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Cluster:
    ports: list[int]
    children: list[ChildProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A live seed node's URL (`[redis] cluster = true` discovers the others)."""
        return f"redis://127.0.0.1:{(self.alive() or self.ports)[0]}/0"

    def alive(self) -> list[int]:
        """The ports of the nodes still running."""
        return [p for p, c in zip(self.ports, self.children, strict=True) if c.proc.poll() is None]

    def stop(self) -> None:
        for child in self.children:
            child.stop()

    def nodes(self) -> dict[int, dict]:
        """port -> CLUSTER NODES' view of it (flags, master_id, slots, node_id), as a live
        node sees the cluster."""
        for port in self.alive():
            with redis.Redis(port=port, socket_timeout=2) as client:
                view = client.execute_command("CLUSTER NODES")
            return {int(addr.split("@")[0].rsplit(":", 1)[1]): node
                    for addr, node in view.items()}  # fmt: skip
        raise RuntimeError("no node of the cluster is running")

    def primary_of(self, key: str) -> int:
        """The port of the primary that serves `key` now."""
        slot = redis.crc.key_slot(key.encode())
        for port, node in self.nodes().items():
            if (
                "master" in node["flags"]
                and "fail" not in node["flags"]
                and any(int(r[0]) <= slot <= int(r[-1]) for r in node["slots"])
            ):
                return port
        raise RuntimeError(f"no live primary serves slot {slot}")

    def replica_of(self, primary: int) -> int:
        nodes = self.nodes()
        primary_id = nodes[primary]["node_id"]
        return next(p for p, n in nodes.items() if n["master_id"] == primary_id)

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, no save): a crash."""
        child = self.children[self.ports.index(port)]
        child.proc.kill()
        child.proc.wait()

    def wait_promoted(self, replica: int, timeout_s: float = 30) -> float:
        """Until `replica` is a primary with slots and every live node says cluster_state:ok;
        the seconds that took."""
        started = time.monotonic()

        def promoted() -> bool:
            node = self.nodes().get(replica, {})
            return "master" in node.get("flags", "") and bool(node.get("slots")) and all(
                b"cluster_state:ok" in _ask(p, b"CLUSTER INFO\r\n") for p in self.alive()
            )  # fmt: skip

        wait_until(promoted, timeout_s, f"{replica} promoted")
        return time.monotonic() - started


def _ask(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.sendall(command)
        return sock.recv(4096)


def start_cluster(
    log_dir: Path,
    primaries: int = 3,
    name: str = "redis-cluster",
    *,
    replicas: int = 0,
    node_timeout_ms: int = 15000,
) -> Cluster:
    """`primaries` primaries (the first ports) with `replicas` replicas each, every replica in
    sync before it returns. `node_timeout_ms`: Redis's cluster-node-timeout (a primary
    unreachable that long is failed over to its replica)."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("redis-server and redis-cli are needed (make setup installs them)")
    cluster = Cluster([free_port() for _ in range(primaries * (1 + replicas))])
    try:
        for port in cluster.ports:
            node_dir = log_dir / f"{name}-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            child = ChildProcess(f"{name}-{port}", [
                server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
                "--cluster-port", str(free_port()), "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                # A replica syncs at once, and takes over however long it was cut off.
                "--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0",
            ], log_dir)  # fmt: skip
            cluster.children.append(child)
            wait_until(lambda p=port: _ask(p, b"PING\r\n").startswith(b"+PONG"), 10,
                       child.name, child.proc)  # fmt: skip
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", str(replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        for port in cluster.ports:
            wait_until(lambda p=port: b"cluster_state:ok" in _ask(p, b"CLUSTER INFO\r\n"), 30,
                       f"{name}-{port} joining")  # fmt: skip
        for port in cluster.ports[primaries:]:
            wait_until(lambda p=port: b"master_link_status:up" in _ask(p, b"INFO replication\r\n"),
                       30, f"{name}-{port} in sync")  # fmt: skip
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass
class ClusterGateway:
    url: str
    stream: str  # its turns stream's name (sharded: one per shard)
    port: int
    child: ChildProcess


@contextmanager
def cluster_gateway(
    log_dir: Path, cluster: Cluster, shards: int, **env: str
) -> Iterator[ClusterGateway]:
    """A real `clawrl-gateway` process in front of the instant engine stand-in, on `cluster`
    with `shards` stream shards, its own stream and key names; `env` adds settings."""
    engine_port, port, grpc_port = free_port(), free_port(), free_port()
    engine = ChildProcess(f"cluster-engine-{engine_port}", [
        sys.executable, str(REPO / "tests/bench/instant_engine.py"), "--port", str(engine_port),
    ], log_dir)  # fmt: skip
    tag = uuid.uuid4().hex[:8]
    stream = f"c:{tag}:turns"
    gateway = ChildProcess(f"cluster-gateway-{port}", [
        str(VENV_BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(port),
        "--grpc-port", str(grpc_port), "--engine-url", f"http://127.0.0.1:{engine_port}",
        "--redis-url", cluster.url,
    ], log_dir, env={
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_MODEL__PATH": "smollm2-tiny",
        "CLAWRL_REDIS__CLUSTER": "true",
        "CLAWRL_REDIS__STREAM_SHARDS": str(shards),
        "CLAWRL_REDIS__TURNS_STREAM": stream,
        "CLAWRL_SESSIONS__KEY_PREFIX": f"c:{tag}:gw",
        "CLAWRL_SESSIONS__SPOOL_DIR": str(log_dir / f"spool-cluster-{tag}"),
        "CLAWRL_CONTROL__SERVED_KEY": f"c:{tag}:serving",
        **env,
    })  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 300,
                       gateway.name, gateway.proc)  # fmt: skip
        except Exception:
            print(gateway.log_tail(), file=sys.stderr)
            raise
        yield ClusterGateway(url, stream, port, gateway)
    finally:
        gateway.stop()
        engine.stop()


def sessions_on_every_shard(per_shard: int, shards: int) -> list[str]:
    """Session ids, `per_shard` of them hashed to each shard (so every shard gets turns), in
    shard order."""
    by_shard, found = Shards(shards, cluster=True), {k: [] for k in range(shards)}
    while min(len(ids) for ids in found.values()) < per_shard:
        session_id = f"cl-{uuid.uuid4().hex[:10]}"
        if len(found[by_shard.of(session_id)]) < per_shard:
            found[by_shard.of(session_id)].append(session_id)
    return [sid for ids in found.values() for sid in ids]
