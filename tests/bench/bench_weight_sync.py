"""Benchmark of the user-visible pause of a weight sync: SmolLM2-135M in the CPU engine behind
the gateway, steady load from several clients, then `clawrl-weight-sync run` loading a new
checkpoint (a copy of the model with changed weights) a few times. Prints, per sync, the job's
figures (pause = first Pause sent -> last Resume answered; drain; load) and what the clients
saw (requests held by the pause and how long, the longest request, failures). Asserts nothing.

With `--lora` the versions are LoRA adapters (rank 16 on all seven projections, made with peft)
and the syncs pause nothing: the trainer's announcement goes on the versions stream, the
launcher (`clawrl-weight-sync watch`) runs the sync, and the table gives the request latency
p50/p99 during the syncs and outside them (one run), the time from the announcement to the
first request served by the new version, the adapter's size and its load and switch times.

    .venv/bin/python tests/bench/bench_weight_sync.py [--clients 4] [--syncs 3] [--max-tokens 8]
    .venv/bin/python tests/bench/bench_weight_sync.py --lora [--syncs 3]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from safetensors.torch import load_file, save_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.common.versions import VersionReady, adapter_name
from clawrl.trainer.weight_sync.job import SyncResult

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.conftest import free_port, wait_http  # noqa: E402
from tests.integration.engine.lora_adapters import ALL_PROJECTIONS, make_adapter  # noqa: E402

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
        # (start, duration, status, system_fingerprint); start on the wall clock
        self.records: list[tuple[float, float, int, str]] = []
        self.threads = [threading.Thread(target=self._loop) for _ in range(clients)]

    def _loop(self):
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                start, clock = time.time(), time.monotonic()
                fingerprint = ""
                try:
                    reply = client.post(
                        f"{self.url}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "Count to ten."}],
                              "max_tokens": self.max_tokens},
                        headers={"X-Turn-Type": "side"},
                    )  # fmt: skip
                    status = reply.status_code
                    if status == 200:
                        fingerprint = reply.json()["system_fingerprint"]
                except httpx.HTTPError:
                    status = 0
                self.records.append((start, time.monotonic() - clock, status, fingerprint))

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


@dataclass
class Stack:
    """Redis, the CPU engine and one gateway, as child processes logging to one file."""

    work: Path
    model: str
    engine_flags: tuple[str, ...] = ()
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        self.ports = {name: free_port() for name in ("redis", "engine", "gateway", "grpc")}
        self.env = {**os.environ, "CLAWRL_CONFIG": "/nonexistent/clawrl.toml"}
        self.redis_url = f"redis://127.0.0.1:{self.ports['redis']}/0"
        self.engine = f"http://127.0.0.1:{self.ports['engine']}"
        self.gateway = f"http://127.0.0.1:{self.ports['gateway']}"
        self.control = f"127.0.0.1:{self.ports['grpc']}"

    def __enter__(self) -> Stack:
        self.logs = (self.work / "servers.log").open("wb")
        # fmt: off
        try:
            self._spawn([shutil.which("redis-server") or "redis-server", "--port",
                         str(self.ports["redis"]), "--save", "", "--appendonly", "no"])
            engine = self._spawn([str(BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port",
                                  str(self.ports["engine"]), "--model", self.model,
                                  "--weight-version", "0", *self.engine_flags])
            wait_http(f"{self.engine}/health", engine, "engine")
            gateway = self._spawn([str(BIN / "clawrl-gateway"), "--host", "127.0.0.1",
                                   "--port", str(self.ports["gateway"]), "--grpc-port",
                                   str(self.ports["grpc"]), "--engine-url", self.engine,
                                   "--redis-url", self.redis_url, "--model", self.model])
            wait_http(f"{self.gateway}/readyz", gateway, "gateway")
        except BaseException:
            self.__exit__()
            raise
        # fmt: on
        warm_up = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        httpx.post(f"{self.gateway}/v1/chat/completions", json=warm_up, timeout=120)
        return self

    def _spawn(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=self.logs, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)
        self.logs.close()


def full_weights(args: argparse.Namespace, work: Path) -> None:
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    ckpts = [checkpoint(model_dir, work / f"v{i}", s) for i, s in ((1, 0.999), (2, 1.001))]
    with Stack(work, args.model) as stack:
        gateway = stack.gateway
        rows = []
        with Clients(gateway, args.clients, args.max_tokens) as clients:
            time.sleep(args.settle_s)
            for n in range(args.syncs):
                held = metric(gateway, "clawrl_gateway_hold_duration_seconds_count")
                held_s = metric(gateway, "clawrl_gateway_hold_duration_seconds_sum")
                mark = len(clients.records)
                job = subprocess.run(
                    [sys.executable, "-m", "clawrl.trainer.weight_sync.main",
                     "--redis-url", stack.redis_url, "--gateways", stack.control,
                     "--engines", stack.engine, "run", "--version", str(n + 1),
                     "--path", str(ckpts[n % 2])],
                    env=stack.env, capture_output=True, text=True,
                )  # fmt: skip
                time.sleep(args.settle_s)
                during = clients.records[mark:]
                result = SyncResult.from_fields(
                    redis.Redis.from_url(stack.redis_url).xrevrange("clawrl:weight-syncs",
                                                                    count=1)[0][1]
                )  # fmt: skip
                n_held = metric(gateway, "clawrl_gateway_hold_duration_seconds_count") - held
                s_held = metric(gateway, "clawrl_gateway_hold_duration_seconds_sum") - held_s
                rows.append((n + 1, result, job.returncode, n_held, s_held, during))
        baseline = [d for _, d, _, _ in clients.records[: max(1, len(clients.records) // 10)]]
    p50 = statistics.median(d for _, d, _, _ in clients.records)
    failed = sum(1 for _, _, status, _ in clients.records if status != 200)
    early = statistics.median(baseline)
    print(f"\nweight sync of {args.model} under load: {args.clients} clients, "
          f"max_tokens {args.max_tokens}; request p50 {p50:.2f}s over {len(clients.records)} "
          f"requests ({failed} failed); early-load p50 {early:.2f}s")  # fmt: skip
    print(f"{'sync':>4} {'rc':>3} {'outcome':>8} {'pause_s':>8} {'drain_s':>8} {'load_s':>7} "
          f"{'retracted':>9} {'held':>5} {'mean_hold_s':>11} {'max_req_s':>9}")  # fmt: skip
    for version, result, code, n_held, s_held, during in rows:
        mean_hold = s_held / n_held if n_held else 0.0
        longest = max((d for _, d, _, _ in during), default=0.0)
        print(f"{version:>4} {code:>3} {result.outcome:>8} {result.pause_s:>8.3f} "
              f"{result.drain_s:>8.3f} {result.load_s:>7.3f} {result.retracted:>9} "
              f"{n_held:>5.0f} {mean_hold:>11.3f} "
              f"{longest:>9.2f}")  # fmt: skip


def percentiles(durations: list[float]) -> tuple[float, float]:
    """(p50, p99) of request durations; NaN for none."""
    if len(durations) < 2:
        return (durations[0], durations[0]) if durations else (math.nan, math.nan)
    cuts = statistics.quantiles(durations, n=100, method="inclusive")
    return statistics.median(durations), cuts[98]


def lora(args: argparse.Namespace, work: Path) -> None:
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    paths = [
        make_adapter(
            model_dir, work / f"v{n}", rank=args.rank, alpha=2 * args.rank, seed=n, scale=1e-3
        )
        for n in range(1, args.syncs + 1)
    ]
    flags = ("--enable-lora", "--max-lora-rank", str(args.rank), "--lora-target-modules",
             *ALL_PROJECTIONS)  # fmt: skip
    with Stack(work, args.model, flags) as stack:
        client = redis.Redis.from_url(stack.redis_url)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "clawrl.trainer.weight_sync.main", "--redis-url",
             stack.redis_url, "--gateways", stack.control, "--engines", stack.engine, "watch"],
            stdout=stack.logs, stderr=subprocess.STDOUT, env=stack.env,
        )  # fmt: skip
        stack.procs.append(launcher)
        rows, windows = [], []
        with Clients(stack.gateway, args.clients, args.max_tokens) as clients:
            time.sleep(args.settle_s)
            for n, path in enumerate(paths, start=1):
                announced = time.time()
                ready = VersionReady(n, str(path), n, announced, adapter=adapter_name(n))
                client.xadd("clawrl:versions", ready.fields())
                result = wait_result(client, n)
                windows.append((announced, result.finished_at))
                time.sleep(args.settle_s)
                served = [start + d for start, d, status, fingerprint in clients.records
                          if fingerprint == f"clawrl-policy-v{n}"]  # fmt: skip
                first = min(served, default=math.nan) - announced
                rows.append((n, result, first))
    during = [d for start, d, _, _ in clients.records if overlaps(start, d, windows)]
    # Outside the syncs, the base model's requests (before the first) and the adapters' apart:
    # what serving an adapter costs is not what a sync costs.
    outside = {
        label: [d for start, d, status, fingerprint in clients.records
                if status == 200 and not overlaps(start, d, windows)
                and (fingerprint == "clawrl-policy-v0") == base]
        for label, base in (("base", True), ("adapter", False))
    }  # fmt: skip
    failed = sum(1 for _, _, status, _ in clients.records if status != 200)
    size_mb = sum(f.stat().st_size for f in paths[0].iterdir()) / 1e6
    print(f"\nLoRA weight syncs of {args.model} (rank {args.rank}, all seven projections, "
          f"adapter {size_mb:.2f} MB) under load: {args.clients} clients, max_tokens "
          f"{args.max_tokens}; {len(clients.records)} requests, {failed} failed")  # fmt: skip
    print(f"{'requests':>26} {'count':>6} {'p50_s':>7} {'p99_s':>7} {'max_s':>7}")
    rows_by = (
        ("outside syncs, base model", outside["base"]),
        ("outside syncs, adapter", outside["adapter"]),
        ("during syncs", during),
    )
    for label, durations in rows_by:
        p50, p99 = percentiles(durations)
        print(f"{label:>26} {len(durations):>6} {p50:>7.3f} {p99:>7.3f} "
              f"{max(durations, default=math.nan):>7.3f}")  # fmt: skip
    print(f"{'sync':>4} {'outcome':>8} {'pause_s':>7} {'load_s':>7} {'switch_s':>8} "
          f"{'unloaded':>8} {'announce_to_first_served_s':>26}")  # fmt: skip
    for version, result, first in rows:
        print(f"{version:>4} {result.outcome:>8} {result.pause_s:>7.3f} {result.load_s:>7.3f} "
              f"{result.switch_s:>8.4f} {result.unloaded:>8} {first:>26.2f}")  # fmt: skip


def overlaps(start: float, duration: float, windows: list[tuple[float, float]]) -> bool:
    return any(start < end and start + duration > begin for begin, end in windows)


def wait_result(client: redis.Redis, version: int, timeout_s: float = 300) -> SyncResult:
    """The first sync result for `version` on the results stream."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, fields in client.xrange("clawrl:weight-syncs"):
            result = SyncResult.from_fields(fields)
            if result.version == version and result.outcome in ("ok", "failed", "inconsistent"):
                return result
        time.sleep(0.05)
    raise TimeoutError(f"no sync result for v{version} in {timeout_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=5.0, help="load before/after a sync")
    parser.add_argument("--lora", action="store_true", help="LoRA versions: no pause")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank with --lora")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    (lora if args.lora else full_weights)(args, work)
    print(f"(servers' log: {work / 'servers.log'})")


if __name__ == "__main__":
    main()
