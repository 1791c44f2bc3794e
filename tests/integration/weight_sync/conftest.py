"""Weight-sync fixtures: two real gateway replicas in front of a CPU engine of its own (its
weights change here, so no other test shares it), real Redis, and checkpoints exported here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.proto import control_pb2, control_pb2_grpc
from clawrl.common.settings import ModelSettings
from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until

MODEL = "smollm2-tiny"


def tiny_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=MODEL))


@dataclass
class Replica:
    name: str
    url: str
    control: str  # host:port of GatewayControl
    child: ChildProcess

    def status(self) -> control_pb2.GatewayStatus:
        with grpc.insecure_channel(self.control) as channel:
            stub = control_pb2_grpc.GatewayControlStub(channel)
            return stub.GetStatus(control_pb2.GetStatusRequest(), timeout=5)

    def chat(self, text: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 3},
            headers={"X-Turn-Type": "side"},
            timeout=60,
        )

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


@pytest.fixture(scope="module")
def engine(engine_factory) -> str:
    # Its own process (the extra flags make the key unique; the engine tests already use
    # "--weight-version 0" alone and leave other weights in theirs): syncs change its weights.
    return engine_factory(MODEL, "--weight-version", "0", "--random-seed", "0")


def start_replicas(
    names: tuple[str, ...], engine: str, redis_url: str, log_dir: Path, env: dict | None = None
) -> list[Replica]:
    """Gateway replicas in front of `engine`, ready to serve."""
    started = []
    for name in names:
        port, control = free_port(), free_port()
        child = ChildProcess(
            f"gateway-{name}",
            [str(VENV_BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(port),
             "--grpc-port", str(control), "--engine-url", engine, "--redis-url", redis_url,
             "--model", MODEL],
            log_dir,
            # A served-version key of its own unless the test shares one with its syncs: what
            # other modules' syncs wrote on the session's Redis must not decide its start.
            env={"CLAWRL_CONFIG": "/nonexistent/clawrl.toml", "CLAWRL_GATEWAY_ID": name,
                 "CLAWRL_SESSIONS__KEY_PREFIX": f"test:{name}",
                 "CLAWRL_CONTROL__SERVED_KEY": f"test:{name}:serving", **(env or {})},
        )  # fmt: skip
        started.append(Replica(name, f"http://127.0.0.1:{port}", f"127.0.0.1:{control}", child))
    for replica in started:
        try:
            wait_until(
                lambda r=replica: httpx.get(f"{r.url}/readyz", timeout=1).status_code == 200,
                300, replica.name, replica.child.proc,
            )  # fmt: skip
        except Exception:
            print(replica.child.log_tail(), file=sys.stderr)
            for started_replica in started:
                started_replica.child.stop()
            raise
    return started


@pytest.fixture(scope="module")
def replicas(engine, redis_url, log_dir) -> Iterator[list[Replica]]:
    started = start_replicas(("sync-a", "sync-b"), engine, redis_url, log_dir)
    yield started
    for replica in started:
        replica.child.stop()


def export_checkpoint(target: Path, scale: float) -> Path:
    """A copy of smollm2-tiny with every weight scaled: same shapes, different outputs."""
    target.mkdir(parents=True)
    tensors = load_file(str(tiny_dir() / "model.safetensors"))
    save_file({k: (v.float() * scale).to(v.dtype).contiguous() for k, v in tensors.items()},
              str(target / "model.safetensors"))  # fmt: skip
    shutil.copy(tiny_dir() / "config.json", target / "config.json")
    return target


def one_layer_model(target: Path) -> Path:
    """smollm2-tiny cut to one layer: an engine serving it refuses the 2-layer checkpoints."""
    shutil.copytree(tiny_dir(), target)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(target / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k},
              str(target / "model.safetensors"))  # fmt: skip
    return target


@pytest.fixture
def one_layer_engine(tmp_path, log_dir) -> Iterator[str]:
    """A second engine replica that refuses smollm2-tiny's checkpoints (one layer, not two)."""
    port = free_port()
    child = ChildProcess(
        f"engine-one-layer-{port}",
        [str(VENV_BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port", str(port),
         "--model", str(one_layer_model(tmp_path / "one-layer"))],
        log_dir,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200,
            300, child.name, child.proc,
        )  # fmt: skip
        yield url
    finally:
        child.stop()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    return {"v1": export_checkpoint(root / "v1", 1.5), "v2": export_checkpoint(root / "v2", 0.7)}


@pytest.fixture
def sync_env(redis_url) -> dict[str, str]:
    """Settings of one test's sync jobs: their own lock, versions and results streams."""
    tag = uuid.uuid4().hex[:8]
    return {
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_REDIS__URL": redis_url,
        "CLAWRL_REDIS__VERSIONS_STREAM": f"test:{tag}:versions",
        "CLAWRL_SYNC__RESULTS_STREAM": f"test:{tag}:syncs",
        "CLAWRL_SYNC__LOCK_KEY": f"test:{tag}:lock",
        # Not the default key: gateways other tests start read that one at start.
        "CLAWRL_SYNC__SERVED_KEY": f"test:{tag}:serving",
    }


def sync_argv(replicas: list[Replica], engines: list[str], *args: str) -> list[str]:
    return [
        sys.executable, "-m", "clawrl.trainer.weight_sync.main",
        "--gateways", ",".join(r.control for r in replicas),
        "--engines", ",".join(engines),
        *args,
    ]  # fmt: skip


def run_sync(env, replicas, engines, *args: str, timeout: float = 120):
    return subprocess.run(
        sync_argv(replicas, engines, *args),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_launcher(env, replicas, engines, reconcile_interval_s: float = 0.5) -> subprocess.Popen:
    """`clawrl-weight-sync watch` over the replicas, a process of its own; its log on stderr."""
    interval = {"CLAWRL_LAUNCHER__RECONCILE_INTERVAL_S": str(reconcile_interval_s)}
    return subprocess.Popen(
        sync_argv(replicas, engines, "watch"),
        env={**os.environ, **env, **interval},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_launcher(launcher: subprocess.Popen) -> str:
    """Stop it; its log (the tail also printed, for a failing test's report)."""
    launcher.terminate()
    _, stderr = launcher.communicate(timeout=30)
    print(stderr[-3000:], file=sys.stderr)
    return stderr
