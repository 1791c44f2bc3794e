"""Benchmark of the gateway's overhead: the same load sent through the gateway and straight to
the engine (CPU engine, tiny model, short generations), p50/p99 latency and requests/s of
each and their difference. Prints a table; asserts nothing.

Like is compared with like: the gateway's /v1/chat/completions against the engine's own
/v1/chat/completions (both render the chat template and tokenise, both return an OpenAI body).
The engine's /generate with pre-rendered ids is shown as the floor. Gateway rows: `main`
records every request as a turn in Redis (the default), `side` serves only.

With `--instant-engine` the engine is a stand-in (tests/bench/instant_engine.py, real HTTP) that
answers /generate at once, so only the gateway's own cost shows: the gateway rows are compared
with the stand-in's /generate called directly. A `null proxy` row (tests/bench/null_proxy.py: the
gateway's server and client stack forwarding bytes, doing no work) shows what the extra hop alone
costs, the floor under any gateway; `null proxy + Redis SET` also writes each reply to Redis
before answering, the floor under a gateway that stores a main turn before its response ends.

    .venv/bin/python tests/bench/bench_gateway.py [--requests 400] [--concurrency 32]
        [--max-tokens 6] [--rounds 2] [--instant-engine] [--baseline main]
        [--serial-requests 150] [--client httpx|raw] [--serial-only]

The 1-client comparison (the gateway's own time per request) has the targets take turns every
10 requests and ends with the figures of record: direct, a side turn, a recorded main turn,
p50 and p99 and what each adds to the direct call. `--client raw` sends them over a bare
kept-alive socket (httpx costs ~1 ms a request of its own); `--serial-only` skips the
concurrent rounds.

`--baseline GIT_REF` adds `base` rows: a second gateway running that ref's code, against the same
engine and Redis, in the same interleaved rounds (before and after of a change in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.bench.gateway_stages import render_costs, stage_costs  # noqa: E402
from tests.conftest import free_port, wait_http  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "smollm2-tiny"
# The floors of --instant-engine: process name -> extra null_proxy.py arguments, row label.
NULL_PROXIES = {"null-proxy": [], "null-proxy-redis": ["--redis-url", "{redis_url}"]}
NULL_PROXY_LABELS = {
    "null-proxy": "null proxy /generate",
    "null-proxy-redis": "null proxy + Redis SET",
}
QUESTIONS = [
    "Write a haiku about the sea.",
    "What is two plus two?",
    "Name a colour.",
    "Say hello.",
]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until the local server on `port` accepts connections."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def extract_baseline(ref: str, dest: Path) -> Path:
    """The `services/` tree of git `ref` (e.g. `main`), unpacked under `dest`: a gateway run from
    it is the "before" of a change, measured in the same run as the "after"."""
    repo = Path(__file__).resolve().parents[2]
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", ref, "services"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def source_path(tree: Path) -> str:
    """PYTHONPATH that makes the installed console scripts import `tree`'s packages."""
    return os.pathsep.join(str(src) for src in sorted((tree / "services").glob("*/src")))


class Stack:
    """redis-server, the engine (CPU or instant) and the gateway(s) as child processes."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []
        self.named: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.redis_url = ""
        self.baseline_url: str | None = None
        self.null_proxies: dict[str, str] = {}  # process name -> URL (instant engine only)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.procs.append(proc)
        self.named[name] = proc
        return proc

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by the engine and the gateway."""
        return {name: process_cpu_s(proc.pid) for name, proc in self.named.items()}

    def start(self, instant: bool = False, baseline: Path | None = None) -> tuple[str, str]:
        """Start everything; (engine URL, gateway URL). With `baseline` (a source tree) a second
        gateway, `gateway-base`, runs that tree's code against the same engine and Redis."""
        redis_url = self.start_redis()
        engine_port = free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        engine = self.spawn(
            "engine",
            [
                sys.executable,
                str(Path(__file__).with_name("instant_engine.py")),
                "--port",
                str(engine_port),
            ]
            if instant
            else [
                *(str(BIN / "clawrl-engine"), "--host", "127.0.0.1"),
                *("--port", str(engine_port), "--model", MODEL),
            ],
        )
        gateway_url = self.spawn_gateway("gateway", engine_url, redis_url)
        if instant:
            for name, extra in NULL_PROXIES.items():
                extra = [arg.format(redis_url=redis_url) for arg in extra]
                proxy_port = free_port()
                proxy = self.spawn(
                    name,
                    [sys.executable, str(Path(__file__).with_name("null_proxy.py")),
                     "--port", str(proxy_port), "--engine-url", engine_url, *extra],
                )  # fmt: skip
                wait_port(proxy_port, proxy)
                self.null_proxies[name] = self.urls[name] = f"http://127.0.0.1:{proxy_port}"
        if baseline is not None:
            self.baseline_url = self.spawn_gateway(
                "gateway-base", engine_url, redis_url, {"PYTHONPATH": source_path(baseline)}
            )
        wait_http(f"{engine_url}/health", engine, "engine")
        for name, proc in self.named.items():
            if name.startswith("gateway"):
                wait_http(f"{self.urls[name]}/readyz", proc, name)
        return engine_url, gateway_url

    def start_redis(self) -> str:
        port = free_port()
        server = shutil.which("redis-server") or "redis-server"
        redis = self.spawn(
            "redis", [server, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        )
        wait_port(port, redis, timeout_s=10)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        return self.redis_url

    def spawn_gateway(
        self, name: str, engine_url: str, redis_url: str, env: dict | None = None
    ) -> str:
        port, grpc_port = free_port(), free_port()
        self.spawn(
            name,
            [
                *(str(BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(port)),
                *("--grpc-port", str(grpc_port), "--model", MODEL, "--engine-url", engine_url),
                *("--redis-url", redis_url),
            ],
            env={
                "CLAWRL_CONFIG": "/nonexistent",
                "CLAWRL_SESSIONS__KEY_PREFIX": name,
                **(env or {}),
            },
        )
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


async def load(
    url: str,
    bodies: list[dict],
    headers: dict[str, str],
    concurrency: int,
    failure_marks: tuple[bytes, ...] = (),
) -> tuple[list[float], float]:
    """Send every body with `concurrency` workers, reading streams to their end; (per-request
    seconds, wall seconds). A status other than 200, or one of `failure_marks` in the last
    bytes (a stream that failed after its 200), stops the run."""
    latencies: list[float] = []
    queue = list(reversed(bodies))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                async with client.stream("POST", url, json=body, headers=headers) as response:
                    payload = await response.aread()
                latencies.append(time.perf_counter() - start)
                tail = payload[-400:]
                if response.status_code != 200 or any(mark in tail for mark in failure_marks):
                    raise RuntimeError(f"{url}: {response.status_code} {tail!r}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(
    args: argparse.Namespace, engine_url: str, gateway_url: str, stack: Stack | None = None
) -> None:
    from clawrl.common.chat import ChatRenderer
    from clawrl.common.settings import ModelSettings

    renderer = ChatRenderer.from_settings(ModelSettings(path=MODEL))
    chats = [
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "max_tokens": args.max_tokens,
            "temperature": 0.7,
        }
        for i in range(max(args.requests, args.serial_requests))
    ]
    generates = [
        {
            "input_ids": renderer.render_ids(chat["messages"]),
            "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0.7},
            "return_logprob": True,
        }
        for chat in chats
    ]
    chat_path = "/v1/chat/completions"
    gateways = {"gateway": gateway_url}
    if stack is not None and stack.baseline_url:
        gateways = {"base": stack.baseline_url, **gateways}
    # name: (url, bodies, headers, the gateway process that serves it)
    targets = {
        "engine /generate (ids)": (f"{engine_url}/generate", generates, {}, ""),
        **(
            {}
            if args.instant_engine
            else {"engine /v1/chat": (f"{engine_url}{chat_path}", chats, {}, "")}
        ),
    }
    for process, url in (stack.null_proxies if stack else {}).items():
        targets[NULL_PROXY_LABELS[process]] = (f"{url}/generate", generates, {}, process)
    for label, url in gateways.items():
        process = "gateway-base" if label == "base" else "gateway"
        targets[f"{label} /v1/chat main"] = (f"{url}{chat_path}", chats, {}, process)
        targets[f"{label} /v1/chat side"] = (
            f"{url}{chat_path}",
            chats,
            {"X-Turn-Type": "side"},
            process,
        )
    for url, bodies, headers, _ in targets.values():  # warm every path up
        await load(url, bodies[: args.concurrency * 2], headers, args.concurrency)
    if not args.serial_only:
        await concurrent_comparison(args, targets, stack)
    # One client at a time: no queueing in the engine, so the difference is the gateway's own
    # time per request (at 32 clients the engine is saturated and latency is queueing). The
    # gateway asks the engine for log-probs, which the engine's /v1/chat row does not compute:
    # the /generate (ids) row is the engine work a gateway request really triggers.
    await serial_comparison(args, targets)


async def concurrent_comparison(
    args: argparse.Namespace, targets: dict, stack: Stack | None
) -> None:
    """Every target at `--concurrency` clients, rounds interleaving the targets so drift (CPU
    frequency, caches) hits all of them alike: req/s, latency and CPU per request."""
    results: dict[str, tuple[list[float], float, int]] = {name: ([], 0.0, 0) for name in targets}
    cpu: dict[str, dict[str, float]] = {name: {} for name in targets}
    for _ in range(args.rounds):
        for name, (url, bodies, headers, _) in targets.items():
            cpu_before = stack.cpu_seconds() if stack else {}
            latencies, wall = await load(url, bodies[: args.requests], headers, args.concurrency)
            for proc, seconds in (stack.cpu_seconds() if stack else {}).items():
                cpu[name][proc] = cpu[name].get(proc, 0.0) + seconds - cpu_before[proc]
            before = results[name]
            results[name] = (before[0] + latencies, before[1] + wall, before[2] + args.requests)

    print(
        f"\n{args.requests} requests x {args.rounds} rounds, {args.concurrency} concurrent "
        f"clients, max_tokens {args.max_tokens}, model {MODEL}, {os.cpu_count()} CPUs\n"
    )
    print(
        f"{'target':<24} {'req/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
        "   CPU ms/req: engine gateway redis"
    )
    rows = {}
    for name, (latencies, wall, count) in results.items():
        rows[name] = (
            count / wall,
            percentile(latencies, 0.5) * 1e3,
            percentile(latencies, 0.9) * 1e3,
            percentile(latencies, 0.99) * 1e3,
        )
        rps, p50, p90, p99 = rows[name]
        per_request = {proc: 1e3 * seconds / count for proc, seconds in cpu[name].items()}
        serving = targets[name][3] or "gateway"
        cpu_columns = "".join(
            f" {per_request.get(proc, float('nan')):7.2f}" for proc in ("engine", serving, "redis")
        )
        print(f"{name:<24} {rps:8.1f} {p50:8.1f} {p90:8.1f} {p99:8.1f}            {cpu_columns}")
    base_name = "engine /generate (ids)" if args.instant_engine else "engine /v1/chat"
    base = rows[base_name]
    print(f"\ngateway vs {base_name} (goal: +<=2 ms p50, +<=10 ms p99, >=90% throughput)")
    for name in [name for name in rows if targets[name][3]]:
        rps, p50, _, p99 = rows[name]
        print(
            f"  {name:<22} p50 {p50 - base[1]:+6.1f} ms   p99 {p99 - base[3]:+6.1f} ms   "
            f"throughput {100 * rps / base[0]:5.1f}%"
        )


class RawClient:
    """HTTP/1.1 over one kept-alive socket, blocking, nothing else: a client whose own cost is
    a few microseconds, so that the 1-client rows show the server's (httpx's is ~1 ms)."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = f"POST {self.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        self.pending = b""

    def post(self, body: bytes, headers: dict[str, str]) -> float:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"{self.head}Content-Type: application/json\r\nContent-Length: {len(body)}"
                   f"\r\n{extra}\r\n").encode() + body  # fmt: skip
        start = time.perf_counter()
        self.sock.sendall(request)
        data = self.pending
        while b"\r\n\r\n" not in data:
            data += self.sock.recv(65536)
        head, rest = data.split(b"\r\n\r\n", 1)
        fields = head.lower().split(b"\r\n")
        length = [int(f.split(b":", 1)[1]) for f in fields if f.startswith(b"content-length:")]
        if length:
            while len(rest) < length[0]:
                rest += self.sock.recv(65536)
            body, self.pending = rest[: length[0]], rest[length[0] :]
        else:  # chunked: the last chunk ends it
            while not rest.endswith(b"0\r\n\r\n"):
                rest += self.sock.recv(65536)
            body, self.pending = rest, b""
        elapsed = time.perf_counter() - start
        if not fields[0].startswith(b"http/1.1 200"):
            raise RuntimeError(f"{self.path}: {fields[0]!r} {body[:300]!r}")
        return elapsed


SERIAL_BATCH = 10  # requests of one target in a row at one client, before the next target's


async def serial_comparison(args: argparse.Namespace, targets: dict) -> None:
    """Every target at one client, taking turns every SERIAL_BATCH requests (drift on a shared
    host hits them alike), with httpx (the figures so far) or the raw client (blocking: nothing
    else runs meanwhile); then each row's difference from the direct rows, and the summary."""
    print(f"\n1 client ({args.client}), {args.serial_requests} requests x {args.rounds} rounds, "
          f"targets taking turns every {SERIAL_BATCH}")  # fmt: skip
    names = tuple(targets)
    serial: dict[str, list[float]] = {name: [] for name in names}
    n = args.serial_requests
    raw = {name: RawClient(targets[name][0]) for name in names} if args.client == "raw" else {}
    payloads = {name: [orjson.dumps(b) for b in targets[name][1][:n]] for name in raw}
    for _ in range(args.rounds):
        for start in range(0, n, SERIAL_BATCH):
            for name, (url, bodies, headers, _) in targets.items():
                if raw:
                    for body in payloads[name][start : start + SERIAL_BATCH]:
                        serial[name].append(raw[name].post(body, headers))
                else:
                    part = bodies[start : min(n, start + SERIAL_BATCH)]
                    serial[name].extend((await load(url, part, headers, 1))[0])
    direct = [name for name in names if name.startswith("engine")]  # fmt: skip
    for name in direct:
        values = serial[name]
        p50, p99, mean = (1e3 * v for v in (percentile(values, 0.5), percentile(values, 0.99),
                                           statistics.mean(values)))  # fmt: skip
        print(f"  {name:<22} p50 {p50:6.2f} ms   p99 {p99:6.2f} ms   mean {mean:6.2f}")
    for base_name in direct:
        floor = serial[base_name]
        print(f"  vs {base_name}:")
        for name in names[len(direct) :]:
            values = serial[name]
            p50 = (percentile(values, 0.5) - percentile(floor, 0.5)) * 1e3
            p99 = (percentile(values, 0.99) - percentile(floor, 0.99)) * 1e3
            mean = (statistics.mean(values) - statistics.mean(floor)) * 1e3
            print(f"    {name:<22} p50 {p50:+6.2f} ms   p99 {p99:+6.2f} ms   mean {mean:+6.2f} ms")
    summary(serial, direct[0])


def summary(serial: dict[str, list[float]], direct: str) -> None:
    """The gateway's figures of record: direct, a side turn, a recorded main turn (and the
    baseline's, with --baseline), p50 and p99, and what each adds to the direct call."""
    print(f"\n  {'':<24} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8}")
    floor = serial[direct]
    rows = {"direct": direct}
    for label in ("base", "gateway"):
        for turn in ("side", "main"):
            name = f"{label} /v1/chat {turn}"
            if name in serial:
                rows[f"{label} {turn} turn" if label == "base" else f"{turn} turn"] = name
    floor_p50, floor_p99 = (1e3 * percentile(floor, q) for q in (0.5, 0.99))
    for label, name in rows.items():
        p50, p99 = (1e3 * percentile(serial[name], q) for q in (0.5, 0.99))
        added = "" if name == direct else f" {p50 - floor_p50:+8.2f} {p99 - floor_p99:+8.2f}"
        print(f"  {label:<24} {p50:7.2f} {p99:7.2f}{added}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--serial-requests", type=int, default=150, help="requests of the 1-client comparison"
    )
    parser.add_argument(
        "--instant-engine",
        action="store_true",
        help="a stand-in engine that answers at once: measures the gateway's own cost",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="only the prompt-rendering comparison"
    )
    parser.add_argument(
        "--stages-only", action="store_true", help="only the per-stage CPU costs (starts Redis)"
    )
    parser.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run a gateway from this git ref's code (e.g. main), side by side in one run",
    )
    parser.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="the 1-client comparison's client: httpx, or a raw socket (a few us of its own)",
    )
    parser.add_argument(
        "--serial-only", action="store_true", help="only the 1-client comparison (and warm-up)"
    )
    parser.add_argument("--engine-url", help="use a running engine (with --gateway-url)")
    parser.add_argument("--gateway-url", help="use a running gateway (with --engine-url)")
    args = parser.parse_args()
    if args.render_only:
        render_costs(MODEL)
        return
    if args.stages_only:
        with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
            stack = Stack(Path(tmp))
            try:
                stage_costs(stack.start_redis(), MODEL)
            finally:
                stack.stop()
        return
    if args.engine_url and args.gateway_url:
        asyncio.run(run(args, args.engine_url, args.gateway_url))
        return
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        stack = Stack(Path(tmp))
        try:
            baseline = None
            if args.baseline:
                baseline = extract_baseline(args.baseline, Path(tmp) / "baseline")
            engine_url, gateway_url = stack.start(instant=args.instant_engine, baseline=baseline)
            asyncio.run(run(args, engine_url, gateway_url, stack))
            stage_costs(stack.redis_url, MODEL, stack)
        finally:
            stack.stop()
    render_costs(MODEL)


if __name__ == "__main__":
    main()
