"""`make run`: the whole clawrl learning loop on one machine, on CPU, as local processes.

Same code paths and protocols as on Kubernetes: a real Redis, the CPU engine serving SGLang's
API for the policy (and a second one for the judge), the gateway in front, the judge turning
finished turns into samples, the trainer taking steps and announcing versions, and the
weight-sync launcher running one sync job (a local process instead of a Kubernetes Job) per new
version. Each process logs to <run-dir>/logs/<name>.log; the terminal shows a live status line
(turns, samples waiting, steps, reward mean, policy version, last pause). Ctrl-C stops
everything; if any process dies, the rest are stopped and the exit code says so.

Default ports (each has a flag, see --help):
  gateway   http://localhost:30000/v1  (GatewayControl gRPC on 30001)
  policy    http://localhost:30010     (SGLang API)
  judge     http://localhost:30011     (SGLang API; the judge service on 30020, /metrics 30021)
  trainer   /metrics on 30030; weight-sync launcher /metrics on 30031
  redis     redis://localhost:6390
  prometheus http://localhost:30090    (when the `prometheus` binary is installed)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import prometheus_local
import redis
import status
import terminal
from options import (
    LORA_RANK,
    gateway_env,
    judge_env,
    needs_judge_engine,
    parse_args,
    tenant_env,
    training_env,
)

from clawrl.engine.launcher import CPU_ARGS, sglang_venv

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# The judge, the trainer and the weight-sync launcher resume from Redis and their checkpoints:
# like pods, each is rerun this many times when it exits, instead of ending the whole loop.
RESTARTS = 3
# SGLang's KV pool on CPU, in tokens: two requests of make run's 16k
# context at once; ~0.75 GB in bf16 for SmolLM2-135M.
SGLANG_KV_TOKENS = 32768
# Written by scripts/setup-sglang.sh once the venv is complete.
SGLANG_STAMP = ".clawrl-sglang-stamp"


# The signals that stop the stack (SIGHUP: the terminal closed; the processes, in their own
# sessions, would not get it).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LIBC = ctypes.CDLL(None, use_errno=True)


def die_with(parent_pid: int):
    """A preexec_fn: the child is SIGKILLed when the process that launched it dies, so a
    stack.py killed outright (or crashed) leaves no service running; the trainer's Ray runtime
    goes with the trainer (its reaper). Runs in the child between fork and exec."""

    def preexec() -> None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def stop_on_signals() -> None:
    """SIGTERM, SIGHUP and SIGINT stop the stack like Ctrl-C: the first one raises
    KeyboardInterrupt, and every later one is ignored (a second TERM from a supervisor or an
    impatient second Ctrl-C would otherwise abort the stop halfway and orphan the rest)."""

    def first_stop_signal(*_) -> None:
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, signal.SIG_IGN)
        raise KeyboardInterrupt

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, first_stop_signal)


@contextlib.contextmanager
def stop_signals_ignored():
    """No stop signal interrupts what runs inside (in the main thread, where Python runs
    signal handlers); the handlers before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_ok(url: str) -> bool:
    # A readiness probe may itself wait on a slow peer: the gateway's /readyz asks the engine,
    # and SGLang on this CPU (sleeping when idle) took ~1 s to answer its two questions.
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


class Stack:
    def __init__(
        self,
        redis_url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        stop_timeout_s: float = 30,
    ) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.env = env or {}  # settings every process shares
        self.stop_timeout_s = stop_timeout_s
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # name -> (argv, env, restarts left): what a pod's restart policy would rerun.
        self.restartable: dict[str, tuple[list[str], dict | None, int]] = {}

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name.replace(' ', '-')}.log"

    def start(
        self,
        name: str,
        argv: list[str],
        ready,
        timeout_s: float = 300,
        env: dict | None = None,
        restarts: int = 0,
    ) -> None:
        """Launch and wait until ready; `restarts`: how often wait() reruns it once it is up
        and exits (as Kubernetes restarts a pod: for services that resume from Redis and their
        checkpoints, so one crash does not end the whole loop)."""
        self.launch(name, argv, env)
        self.wait_ready(name, ready, timeout_s)
        if restarts:
            self.restartable[name] = (argv, env, restarts)

    def launch(self, name: str, argv: list[str], env: dict | None = None) -> None:
        """Start a process without waiting for it (wait_ready does)."""
        print(f"==> starting {name}: {' '.join(argv)}", flush=True)
        environment = {
            **os.environ,
            "CLAWRL_REDIS__URL": self.redis_url,
            **self.env,
            **(env or {}),
        }
        log = self.log_path(name).open("ab")
        # Its own process group: stop() can then reach what it starts (the trainer's Ray
        # runtime) as well; and it dies with stack.py.
        proc = subprocess.Popen(
            argv,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with(os.getpid()),
        )
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]

    def wait_ready(self, name: str, ready, timeout_s: float = 300) -> None:
        proc = dict(self.procs)[name]
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} while starting:\n{self.tail(name)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s:.0f}s:\n{self.tail(name)}")
            time.sleep(0.2)
        print(f"==> {name} ready (log: {self.log_path(name)})", flush=True)

    def tail(self, name: str, lines: int = 30) -> str:
        text = self.log_path(name).read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"    {line}" for line in text)

    def stop(self) -> None:
        """SIGTERM to every process; then SIGKILL to what is left of each one's group, once it
        exited or after stop_timeout_s (a trainer killed mid-step left Ray's processes running).
        Stop signals that come meanwhile are ignored: the stop always runs to its end."""
        with stop_signals_ignored():
            self.stop_all()

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait(self, show_status, interval_s: float) -> int:
        """Show the status every interval until one process exits; returns its exit code."""
        live = sys.stdout.isatty()
        next_status = time.monotonic()
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    print(f"\n==> {name} exited with code {proc.returncode}:\n{self.tail(name)}")
                    if not self.restart(name, proc):
                        return proc.returncode or 1
            if time.monotonic() >= next_status:
                line = show_status()
                # On a terminal one line redrawn in place; in a log one line per interval.
                print(f"\r\033[K{line}" if live else line, end="" if live else "\n", flush=True)
                next_status = time.monotonic() + interval_s
            time.sleep(0.5)

    def restart(self, name: str, proc: subprocess.Popen) -> bool:
        """Rerun an exited restartable process (what is left of its group killed first);
        False when it is not restartable or has no restarts left."""
        argv, env, left = self.restartable.get(name, ([], None, 0))
        if left <= 0:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.restartable[name] = (argv, env, left - 1)
        print(f"==> restarting {name} ({left - 1} restart(s) left)", flush=True)
        self.launch(name, argv, env)
        return True


def engine_argv(model: str, port: int, torch_threads: int, lora_rank: int = 0) -> list[str]:
    """The CPU engine's command; with lora_rank it serves the trainer's adapters beside the base
    model (SGLang's LoRA flags), a new version loaded with no pause."""
    lora = ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras-per-batch", "4",
            "--lora-target-modules", "all"]  # fmt: skip
    return [
        str(BIN / "clawrl-engine"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        "--torch-threads",
        str(torch_threads),
        *(lora if lora_rank else []),
    ]


def sglang_engine(model: str, port: int, torch_threads: int) -> tuple[list[str], dict[str, str]]:
    """Real SGLang through the project's launcher (`clawrl-engine --backend sglang`, as the chart
    runs it) on its generic CPU path: the command and its environment."""
    python = sglang_venv() / "bin" / "python"
    argv = [str(BIN / "clawrl-engine"), "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(port), "--model", model,
            "--max-total-tokens", str(SGLANG_KV_TOKENS)]  # fmt: skip
    env = {
        "CLAWRL_SGLANG__PYTHON": str(python),
        "CLAWRL_SGLANG__DTYPE": "bfloat16",
        "CLAWRL_SGLANG__EXTRA_ARGS": json.dumps(list(CPU_ARGS)),
        "OMP_NUM_THREADS": str(torch_threads),
    }
    return argv, env


def engine_command(
    args: argparse.Namespace, model: str, port: int, lora_rank: int = 0
) -> tuple[list[str], dict[str, str]]:
    """The policy's or the judge's engine: the command and its environment."""
    if args.engine == "sglang":
        return sglang_engine(model, port, args.torch_threads)
    return engine_argv(model, port, args.torch_threads, lora_rank), {}


def resolve_lora_rank(args: argparse.Namespace) -> str | None:
    """Settle --lora-rank for the engine; an error message when the two cannot go together."""
    if args.engine != "sglang":
        args.lora_rank = LORA_RANK if args.lora_rank is None else args.lora_rank
        return None
    if args.lora_rank:
        return (
            "--engine sglang trains full weights only (--lora-rank 0): SGLang 0.5.23's LoRA "
            "serving needs a GPU (it pins host memory, which needs a CUDA driver, and fails at "
            "start without one); use the CPU engine for LoRA"
        )
    if args.lora_rank is None:
        print(
            "==> --engine sglang: full fine-tuning (--lora-rank 0; SGLang's LoRA serving needs "
            "a GPU): each new version is a paused full-weight sync from disk",
            flush=True,
        )
    args.lora_rank = 0
    if not (sglang_venv() / SGLANG_STAMP).is_file():
        return f"no SGLang venv at {sglang_venv()}: run `make setup-sglang` first (~7 GB)"
    return None


def start_learning(stack: Stack, args: argparse.Namespace, redis_url: str) -> None:
    """The judge, the trainer and the weight-sync launcher: the loop around serving."""
    stack.start(
        "judge",
        [str(BIN / "clawrl-judge"), "run", "--redis-url", redis_url,
         "--engine-url", f"http://127.0.0.1:{args.judge_port}", "--model", args.policy_model,
         "--judge-model", args.judge_model, "--grpc-port", str(args.judge_grpc_port),
         "--metrics-port", str(args.judge_metrics_port)],
        lambda: http_ok(f"http://127.0.0.1:{args.judge_metrics_port}/healthz"),
        env=judge_env(args),
        restarts=RESTARTS,
    )  # fmt: skip
    stack.start(
        "trainer",
        [str(BIN / "clawrl-trainer"), "--model", args.policy_model, "--redis-url", redis_url,
         "--checkpoint-dir", str(args.run_dir / "checkpoints"),
         "--batch-size", str(args.batch_size), "--sync-interval", str(args.sync_interval),
         "--metrics-port", str(args.trainer_metrics_port)],
        lambda: http_ok(f"http://127.0.0.1:{args.trainer_metrics_port}/metrics"),
        env=training_env(args),
        restarts=RESTARTS,
    )  # fmt: skip
    stack.start(
        "weight sync",
        [sys.executable, "-m", "clawrl.trainer.weight_sync.main", "--redis-url", redis_url,
         "--gateways", f"127.0.0.1:{args.grpc_port}",
         "--engines", f"http://127.0.0.1:{args.policy_port}",
         "watch", "--mode", "local", "--metrics-port", str(args.sync_metrics_port)],
        lambda: http_ok(f"http://127.0.0.1:{args.sync_metrics_port}/metrics"),
        restarts=RESTARTS,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = resolve_lora_rank(args)
    if args.tenants == "per_tenant" and not args.lora_rank:
        problem = "--tenants per_tenant trains an adapter per tenant: it needs LoRA (--lora-rank)"
    if problem:
        print(problem, file=sys.stderr)
        return 2
    ports = (
        args.redis_port,
        args.policy_port,
        args.judge_port,
        args.gateway_port,
        args.grpc_port,
        args.prometheus_port,
        args.judge_grpc_port,
        args.judge_metrics_port,
        args.trainer_metrics_port,
        args.sync_metrics_port,
        *terminal.ports(args),
    )
    for port in ports:
        if port_open(port):
            print(
                f"port {port} is already in use: is another clawrl stack running?", file=sys.stderr
            )
            return 1
    (args.run_dir / "redis").mkdir(parents=True, exist_ok=True)
    (args.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    redis_url = f"redis://localhost:{args.redis_port}/0"
    # One setting for all: engines and trainer must stretch RoPE alike (else PPO's ratios are
    # off) and the gateway must admit what the engines serve.
    shared = (
        {"CLAWRL_MODEL__CONTEXT_LENGTH": str(args.context_length)} if args.context_length else {}
    ) | tenant_env(args)
    stack = Stack(redis_url, args.run_dir / "logs", shared)
    stop_on_signals()
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
        # Both engines load at once: most of a start is single-threaded Python imports. The
        # judge engine only when something asks it (see needs_judge_engine).
        engines = {"policy engine": (args.policy_model, args.policy_port, args.lora_rank)}
        if needs_judge_engine(args):
            engines["judge engine"] = (args.judge_model, args.judge_port, 0)
        for name, (model, port, lora_rank) in engines.items():
            argv, env = engine_command(args, model, port, lora_rank)
            stack.launch(name, argv, env)
        for name, (_, port, _) in engines.items():
            # SGLang answers /health before its scheduler can generate; /health_generate
            # waits for a token (the CPU engine answers both).
            stack.wait_ready(
                name, lambda port=port: http_ok(f"http://127.0.0.1:{port}/health_generate"), 600
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
            env=gateway_env(args),
        )
        start_learning(stack, args, redis_url)
        if terminal.is_terminal(args):
            terminal.start(stack, args, http_ok, RESTARTS)
        if shutil.which("prometheus"):
            scraped = {
                "gateway": args.gateway_port,
                "policy-engine": args.policy_port,
                **({"judge-engine": args.judge_port} if needs_judge_engine(args) else {}),
                "judge": args.judge_metrics_port,
                "trainer": args.trainer_metrics_port,
                "weight-sync": args.sync_metrics_port,
                **terminal.scraped(args),
            }
            stack.start(
                "prometheus",
                prometheus_local.argv(args.run_dir, args.prometheus_port, scraped),
                lambda: http_ok(f"http://127.0.0.1:{args.prometheus_port}/-/ready"),
            )
        gateway = f"http://localhost:{args.gateway_port}"
        context = (
            f"context {args.context_length} tokens"
            if args.context_length
            else "the model's own context"
        )
        print(
            f"\nclawrl is running ({context}). Point an OpenAI client at {gateway}/v1 ("
            f"{'one of the --api-key keys' if args.api_key else 'any API key'}), e.g.\n"
            f"  curl -s {gateway}/v1/chat/completions -H 'X-Session-Id: demo' "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{args.policy_model}", '
            f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n'
            f"or let the simulated user talk (in another terminal):\n"
            f"  {sys.executable} -m clawrl.simulate.main simulate --base-url {gateway}/v1 "
            f"--redis-url {redis_url} --sessions 0\n"
            f"Metrics: http://localhost:{args.prometheus_port} (Prometheus, when installed). "
            f"Logs: {args.run_dir / 'logs'}. Turns land on clawrl:turns, samples on "
            f"clawrl:samples (redis-cli -p {args.redis_port} XLEN clawrl:samples).\n"
            + (terminal.banner(args) if terminal.is_terminal(args) else "")
            + "Ctrl-C stops everything.\n",
            flush=True,
        )
        client = redis.Redis.from_url(redis_url, socket_timeout=2)
        trainer_metrics = f"http://127.0.0.1:{args.trainer_metrics_port}/metrics"
        return stack.wait(
            lambda: status.snapshot(client, trainer_metrics).line(), args.status_interval
        )
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"\n==> {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
