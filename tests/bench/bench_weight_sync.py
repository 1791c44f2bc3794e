"""Benchmark of the user-visible pause of a weight sync: SmolLM2-135M in the CPU engine behind
the gateway, steady load from several clients, then `clawrl-weight-sync run` loading a new
checkpoint (a copy of the model with changed weights) a few times. Prints, per sync, the job's
figures (pause = first Pause sent -> last Resume answered; drain; load) and what the clients
saw (requests held by the pause and how long, the longest request, failures). Asserts nothing.

    .venv/bin/python tests/bench/bench_weight_sync.py [--clients 4] [--syncs 3] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis
from safetensors.torch import load_file, save_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.trainer.weight_sync.job import SyncResult

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.conftest import free_port, wait_http  # noqa: E402

BIN = Path(sys.executable).parent


def checkpoint(model_dir: Path, target: Path, scale: float) -> Path:
    """The model with every weight scaled: same shapes, other outputs."""
    target.mkdir(parents=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({k: (v * scale).contiguous() for k, v in tensors.items()},
              str(target / "model.safetensors"))  # fmt: skip
    shutil.copy(model_dir / "config.json", target / "config.json")
    return target


class Clients:
    """Steady load: each client sends the next request as soon as the last one answered."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.stop = threading.Event()
        self.records: list[tuple[float, float, int]] = []  # (start, duration, status)
        self.threads = [threading.Thread(target=self._loop) for _ in range(clients)]

    def _loop(self):
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    status = client.post(
                        f"{self.url}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "Count to ten."}],
                              "max_tokens": self.max_tokens},
                        headers={"X-Turn-Type": "side"},
                    ).status_code  # fmt: skip
                except httpx.HTTPError:
                    status = 0
                self.records.append((start, time.monotonic() - start, status))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join()


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=5.0, help="load before/after a sync")
    args = parser.parse_args()
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    ckpts = [checkpoint(model_dir, work / f"v{i}", s) for i, s in ((1, 0.999), (2, 1.001))]
    ports = {name: free_port() for name in ("redis", "engine", "gateway", "grpc")}
    env = {**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml"}
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    logs = (work / "servers.log").open("wb")
    procs = [
        subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                          str(ports["redis"]), "--save", "", "--appendonly", "no"],
                         stdout=logs, stderr=subprocess.STDOUT),
        subprocess.Popen([str(BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port",
                          str(ports["engine"]), "--model", args.model, "--weight-version", "0"],
                         stdout=logs, stderr=subprocess.STDOUT, env=env),
    ]  # fmt: skip
    engine = f"http://127.0.0.1:{ports['engine']}"
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    try:
        wait_http(f"{engine}/health", procs[1], "engine")
        procs.append(subprocess.Popen(
            [str(BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(ports["gateway"]),
             "--grpc-port", str(ports["grpc"]), "--engine-url", engine, "--redis-url", redis_url,
             "--model", args.model],
            stdout=logs, stderr=subprocess.STDOUT, env=env,
        ))  # fmt: skip
        wait_http(f"{gateway}/readyz", procs[2], "gateway")
        warm_up = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        httpx.post(f"{gateway}/v1/chat/completions", json=warm_up, timeout=120)
        rows = []
        with Clients(gateway, args.clients, args.max_tokens) as clients:
            time.sleep(args.settle_s)
            for n in range(args.syncs):
                held = metric(gateway, "clawrl_gateway_hold_duration_seconds_count")
                held_s = metric(gateway, "clawrl_gateway_hold_duration_seconds_sum")
                mark = len(clients.records)
                job = subprocess.run(
                    [sys.executable, "-m", "clawrl.trainer.weight_sync.main",
                     "--redis-url", redis_url, "--gateways", f"127.0.0.1:{ports['grpc']}",
                     "--engines", engine, "run", "--version", str(n + 1),
                     "--path", str(ckpts[n % 2])],
                    env=env, capture_output=True, text=True,
                )  # fmt: skip
                time.sleep(args.settle_s)
                during = clients.records[mark:]
                result = SyncResult.from_fields(
                    redis.Redis.from_url(redis_url).xrevrange("clawrl:weight-syncs", count=1)[0][1]
                )
                n_held = metric(gateway, "clawrl_gateway_hold_duration_seconds_count") - held
                s_held = metric(gateway, "clawrl_gateway_hold_duration_seconds_sum") - held_s
                rows.append((n + 1, result, job.returncode, n_held, s_held, during))
        baseline = [d for _, d, _ in clients.records[: max(1, len(clients.records) // 10)]]
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        logs.close()
    p50 = statistics.median(d for _, d, _ in clients.records)
    failed = sum(1 for _, _, status in clients.records if status != 200)
    early = statistics.median(baseline)
    print(f"\nweight sync of {args.model} under load: {args.clients} clients, "
          f"max_tokens {args.max_tokens}; request p50 {p50:.2f}s over {len(clients.records)} "
          f"requests ({failed} failed); early-load p50 {early:.2f}s")  # fmt: skip
    print(f"{'sync':>4} {'rc':>3} {'outcome':>8} {'pause_s':>8} {'drain_s':>8} {'load_s':>7} "
          f"{'retracted':>9} {'held':>5} {'mean_hold_s':>11} {'max_req_s':>9}")  # fmt: skip
    for version, result, code, n_held, s_held, during in rows:
        mean_hold = s_held / n_held if n_held else 0.0
        longest = max((d for _, d, _ in during), default=0.0)
        print(f"{version:>4} {code:>3} {result.outcome:>8} {result.pause_s:>8.3f} "
              f"{result.drain_s:>8.3f} {result.load_s:>7.3f} {result.retracted:>9} "
              f"{n_held:>5.0f} {mean_hold:>11.3f} "
              f"{longest:>9.2f}")  # fmt: skip
    print(f"(servers' log: {work / 'servers.log'})")


if __name__ == "__main__":
    main()
