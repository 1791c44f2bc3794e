"""`make run`: the whole clawrl system on one machine, on CPU, as local processes.

Same code paths and protocols as on Kubernetes: a real Redis, the CPU engine serving SGLang's
API for the policy (and a second one for the judge), and the gateway in front. Services of
issues not built yet are simply not started. Ctrl-C stops everything; if any process dies, the
rest are stopped and the exit code says so.

Ports (override with the environment variables of each service):
  gateway   http://localhost:30000/v1  (GatewayControl gRPC on 30001)
  policy    http://localhost:30010     (SGLang API)
  judge     http://localhost:30011     (SGLang API)
  redis     redis://localhost:6390
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = REPO / "run"
BIN = Path(sys.executable).parent

REDIS_PORT = 6390
POLICY_PORT, JUDGE_PORT = 30010, 30011
GATEWAY_PORT, GATEWAY_GRPC_PORT = 30000, 30001
POLICY_MODEL = os.environ.get("CLAWRL_LOCAL_POLICY_MODEL", "SmolLM2-135M-Instruct")
JUDGE_MODEL = os.environ.get("CLAWRL_LOCAL_JUDGE_MODEL", "SmolLM2-135M-Instruct")


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
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], ready, timeout_s: float = 180) -> None:
        print(f"==> starting {name}: {' '.join(argv)}", flush=True)
        env = {**os.environ, "CLAWRL_REDIS__URL": f"redis://localhost:{REDIS_PORT}/0"}
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


def main() -> int:
    for port in (REDIS_PORT, POLICY_PORT, JUDGE_PORT, GATEWAY_PORT, GATEWAY_GRPC_PORT):
        if port_open(port):
            print(
                f"port {port} is already in use: is another clawrl stack running?", file=sys.stderr
            )
            return 1
    (RUN_DIR / "redis").mkdir(parents=True, exist_ok=True)
    stack = Stack()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        stack.start(
            "redis",
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(REDIS_PORT),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(RUN_DIR / "redis"),
                "--appendonly",
                "yes",
                "--save",
                "",
            ],
            lambda: port_open(REDIS_PORT),
        )
        stack.start(
            "policy engine",
            engine_argv(POLICY_MODEL, POLICY_PORT),
            lambda: http_ok(f"http://127.0.0.1:{POLICY_PORT}/health"),
        )
        stack.start(
            "judge engine",
            engine_argv(JUDGE_MODEL, JUDGE_PORT),
            lambda: http_ok(f"http://127.0.0.1:{JUDGE_PORT}/health"),
        )
        stack.start(
            "gateway",
            [
                str(BIN / "clawrl-gateway"),
                "--host",
                "127.0.0.1",
                "--port",
                str(GATEWAY_PORT),
                "--grpc-port",
                str(GATEWAY_GRPC_PORT),
                "--model",
                POLICY_MODEL,
                "--engine-url",
                f"http://127.0.0.1:{POLICY_PORT}",
                "--redis-url",
                f"redis://localhost:{REDIS_PORT}/0",
            ],
            lambda: http_ok(f"http://127.0.0.1:{GATEWAY_PORT}/readyz"),
        )
        print(
            f"\nclawrl is running. Point an OpenAI client at http://localhost:{GATEWAY_PORT}/v1"
            f" (any API key), e.g.\n"
            f"  curl -s localhost:{GATEWAY_PORT}/v1/chat/completions -H 'X-Session-Id: demo' "
            f'-d \'{{"model": "{POLICY_MODEL}", "messages": '
            f'[{{"role": "user", "content": "Hello!"}}]}}\'\n'
            f"Finished turns land on clawrl:turns (redis-cli -p {REDIS_PORT} XLEN clawrl:turns)."
            f"\nCtrl-C stops everything.\n",
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
