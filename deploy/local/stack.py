"""`make run`: the whole clawrl system on one machine, on CPU, as local processes.

Same code paths and protocols as on Kubernetes: a real Redis, the CPU engine serving SGLang's
API for the policy (and a second one for the judge), and the gateway in front. Services of
issues not built yet are simply not started. Ctrl-C stops everything; if any process dies, the
rest are stopped and the exit code says so.

Default ports (each has a flag, see --help):
  gateway   http://localhost:30000/v1  (GatewayControl gRPC on 30001)
  policy    http://localhost:30010     (SGLang API)
  judge     http://localhost:30011     (SGLang API)
  redis     redis://localhost:6390
  prometheus http://localhost:30090    (when the `prometheus` binary is installed)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import prometheus_local

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


class Stack:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], ready, timeout_s: float = 180) -> None:
        print(f"==> starting {name}: {' '.join(argv)}", flush=True)
        env = {**os.environ, "CLAWRL_REDIS__URL": self.redis_url}
        proc = subprocess.Popen(argv, env=env)
        self.procs.append((name, proc))
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)
        print(f"==> {name} ready", flush=True)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def wait(self) -> int:
        """Block until one process exits; returns its exit code."""
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    print(f"==> {name} exited with code {proc.returncode}", flush=True)
                    return proc.returncode or 1
            time.sleep(0.5)


def engine_argv(model: str, port: int) -> list[str]:
    return [
        str(BIN / "clawrl-engine"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run the clawrl stack locally on CPU.")
    parser.add_argument("--policy-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--judge-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--gateway-port", type=int, default=30000)
    parser.add_argument("--grpc-port", type=int, default=30001)
    parser.add_argument("--policy-port", type=int, default=30010)
    parser.add_argument("--judge-port", type=int, default=30011)
    parser.add_argument("--redis-port", type=int, default=6390)
    parser.add_argument("--prometheus-port", type=int, default=30090)
    parser.add_argument("--judge-grpc-port", type=int, default=30020, help="Judge gRPC (Score)")
    parser.add_argument("--judge-metrics-port", type=int, default=30021, help="judge /metrics")
    parser.add_argument("--run-dir", type=Path, default=REPO / "run", help="Redis data, etc.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ports = (
        args.redis_port,
        args.policy_port,
        args.judge_port,
        args.gateway_port,
        args.grpc_port,
        args.prometheus_port,
        args.judge_grpc_port,
        args.judge_metrics_port,
    )
    for port in ports:
        if port_open(port):
            print(
                f"port {port} is already in use: is another clawrl stack running?", file=sys.stderr
            )
            return 1
    (args.run_dir / "redis").mkdir(parents=True, exist_ok=True)
    redis_url = f"redis://localhost:{args.redis_port}/0"
    stack = Stack(redis_url)
    # SIGTERM (from a supervisor or a test) stops the stack like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        stack.start(
            "redis",
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(args.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(args.run_dir / "redis"),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            lambda: port_open(args.redis_port),
        )
        stack.start(
            "policy engine",
            engine_argv(args.policy_model, args.policy_port),
            lambda: http_ok(f"http://127.0.0.1:{args.policy_port}/health"),
        )
        stack.start(
            "judge engine",
            engine_argv(args.judge_model, args.judge_port),
            lambda: http_ok(f"http://127.0.0.1:{args.judge_port}/health"),
        )
        stack.start(
            "gateway",
            [
                str(BIN / "clawrl-gateway"),
                "--host",
                "127.0.0.1",
                "--port",
                str(args.gateway_port),
                "--grpc-port",
                str(args.grpc_port),
                "--model",
                args.policy_model,
                "--engine-url",
                f"http://127.0.0.1:{args.policy_port}",
                "--redis-url",
                redis_url,
            ],
            lambda: http_ok(f"http://127.0.0.1:{args.gateway_port}/readyz"),
        )
        # Mode and reward come from clawrl.toml ([judging]); see README "The judge".
        stack.start(
            "judge",
            [str(BIN / "clawrl-judge"), "--redis-url", redis_url, "--model", args.policy_model,
             "--judge-model", args.judge_model, "--engine-url",
             f"http://127.0.0.1:{args.judge_port}", "--grpc-port", str(args.judge_grpc_port),
             "--metrics-port", str(args.judge_metrics_port)],
            lambda: http_ok(f"http://127.0.0.1:{args.judge_metrics_port}/healthz"),
        )  # fmt: skip
        if shutil.which("prometheus"):
            scraped = {
                "gateway": args.gateway_port,
                "policy-engine": args.policy_port,
                "judge-engine": args.judge_port,
                "judge": args.judge_metrics_port,
            }
            stack.start(
                "prometheus",
                prometheus_local.argv(args.run_dir, args.prometheus_port, scraped),
                lambda: http_ok(f"http://127.0.0.1:{args.prometheus_port}/-/ready"),
            )
        gateway = f"http://localhost:{args.gateway_port}"
        print(
            f"\nclawrl is running. Point an OpenAI client at {gateway}/v1 (any API key), e.g.\n"
            f"  curl -s {gateway}/v1/chat/completions -H 'X-Session-Id: demo' "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{args.policy_model}", '
            f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n'
            f"Metrics: http://localhost:{args.prometheus_port} (Prometheus, when installed).\n"
            f"Finished turns land on clawrl:turns, judged samples on clawrl:samples "
            f"(redis-cli -p {args.redis_port} XLEN clawrl:samples).\nCtrl-C stops everything.\n",
            flush=True,
        )
        return stack.wait()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"==> {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
