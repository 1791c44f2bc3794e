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

from clawrl.engine.launcher import CPU_ARGS, sglang_venv

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# AdamW's step for LoRA on SmolLM2-135M in the preference demo (README, "The demo that trends").
LORA_LR = 5e-4
LORA_RANK = 16
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


def training_env(args: argparse.Namespace) -> dict[str, str]:
    """The trainer's recipe from stack.py's flags (the trainer reads CLAWRL_* settings). Unset
    flags leave the setting to clawrl.toml or the environment."""
    env = {"CLAWRL_TRAIN__NUM_THREADS": str(args.torch_threads)}
    if args.lora_rank:
        env |= {
            "CLAWRL_LORA__ENABLED": "true",
            "CLAWRL_LORA__RANK": str(args.lora_rank),
            "CLAWRL_LORA__ALPHA": str(args.lora_alpha),
        }
    lr = args.lr if args.lr is not None else (LORA_LR if args.lora_rank else None)
    if lr is not None:
        env["CLAWRL_PPO__LR"] = str(lr)
    if args.baseline == "batch":
        # Live traffic asks each prompt once: the batch's mean reward is the baseline.
        env |= {"CLAWRL_ADVANTAGE__NORMALIZE_GROUPS": "true", "CLAWRL_ADVANTAGE__GROUP_BY": "batch"}
    elif args.baseline == "none":
        env["CLAWRL_ADVANTAGE__NORMALIZE_GROUPS"] = "false"
    if args.method != "config":
        env["CLAWRL_ADVANTAGE__ESTIMATOR"] = ESTIMATORS[args.method]
    if args.method in ("opd", "combine"):
        env["CLAWRL_ADVANTAGE__OPD_CLIP"] = str(OPD_CLIP)
    return env


def tenant_env(args: argparse.Namespace) -> dict[str, str]:
    """[tenants] from stack.py's flags, for every process (the gateway routes by tenant, the
    trainer steps per tenant, the weight-sync job serves each tenant its versions)."""
    env = {}
    if args.tenants != "config":
        env["CLAWRL_TENANTS__MODE"] = args.tenants
    if args.tenant_batch is not None:
        env["CLAWRL_TENANTS__MIN_SAMPLES_PER_STEP"] = str(args.tenant_batch)
    return env


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    """The API keys, for the gateway alone (a JSON list, as its settings read lists)."""
    return {"CLAWRL_SERVING__API_KEYS": json.dumps(args.api_key)} if args.api_key else {}


def default_torch_threads() -> int:
    """The cores split between the three torch processes (two engines, the trainer): each
    defaulting to every core oversubscribes them, and a busy engine then starves the trainer."""
    return max(1, (os.cpu_count() or 1) // 3)


# The learning methods of `--method` (the judge's mode and the trainer's advantage estimator).
ESTIMATORS = {"rl": "grpo", "opd": "on_policy_distillation", "combine": "combine"}
# Hints with no judge model: the corrective sentences of the user's next message (`clawrl
# simulate`'s user writes "<remark> Next: <question>"; the question is not feedback).
HINT_FN = "clawrl.judge.hint_examples:corrective_sentences"
HINT_FN_ARGS = '{"drop_after": "Next:"}'
OPD_CLIP = 2.0  # OpenClaw-RL's bound on a token's teacher - student gap


def needs_judge_engine(args: argparse.Namespace) -> bool:
    """Whether the judge engine has work: PRM votes (rl and combine without a reward plug-in),
    hint votes (opd and combine without a hint plug-in), or teaching (--teacher judge)."""
    if args.method == "config":
        return True
    prm = args.method != "opd" and not args.reward_fn
    hint_votes = args.method != "rl" and not args.hint_fn
    return prm or hint_votes or (args.method != "rl" and args.teacher == "judge")


def judge_env(args: argparse.Namespace) -> dict[str, str]:
    """The judge's recipe from --method and the plug-in flags (the judge reads CLAWRL_*)."""
    if args.method == "config":  # mode and reward from clawrl.toml ([judging])
        return {}
    env = {"CLAWRL_JUDGING__MODE": args.method, "CLAWRL_JUDGING__PRM": args.judge_prm}
    if args.reward_fn:
        env["CLAWRL_JUDGING__REWARD_FN"] = args.reward_fn
    if args.method == "rl":
        return env
    env |= {
        "CLAWRL_TEACHER__ENGINE": args.teacher,
        "CLAWRL_TEACHER__POLICY_ENGINE_URL": f"http://127.0.0.1:{args.policy_port}",
        "CLAWRL_JUDGING__HINT_CANDIDATES": str(args.hint_candidates),
        "CLAWRL_JUDGING__HINT_SELECT": args.hint_select,
    }
    if args.hint_fn:  # the plug-in alone: the 135M judge gives next to no usable hint votes
        env |= {"CLAWRL_JUDGING__HINT_FN": args.hint_fn, "CLAWRL_JUDGING__HINT_VOTES": "false"}
        if args.hint_fn == HINT_FN:
            env["CLAWRL_JUDGING__HINT_FN_ARGS"] = HINT_FN_ARGS
    return env


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
    parser.add_argument("--trainer-metrics-port", type=int, default=30030, help="trainer /metrics")
    parser.add_argument(
        "--sync-metrics-port", type=int, default=30031, help="weight-sync launcher /metrics"
    )
    parser.add_argument(
        "--method",
        choices=("rl", "opd", "combine", "config"),
        default="rl",
        help="how turns become training signal: rl = a reward per turn (--reward-fn, else the "
        "judge's PRM votes), opd = on-policy distillation from a hindsight hint (--hint-fn, "
        "else the judge's hint votes) scored by the teacher, combine = both; config = the "
        "judge's [judging] and the trainer's [advantage] from clawrl.toml",
    )
    parser.add_argument(
        "--hint-fn",
        default=HINT_FN,
        help="opd/combine: hint plug-in module:function (judging.hint_fn); '' = the judge's "
        f"hint votes (default: {HINT_FN}, the corrective sentences of the user's next message)",
    )
    parser.add_argument(
        "--teacher",
        choices=("policy", "judge"),
        default="policy",
        help="opd/combine: who scores the hinted prompt: the policy engine's base weights (no "
        "adapter; one engine for both) or the judge engine",
    )
    parser.add_argument(
        "--hint-candidates", type=int, default=1, help="opd/combine: hint candidates kept per turn"
    )
    parser.add_argument(
        "--hint-select",
        choices=("longest", "shortest", "sequence_optimal", "token_optimal"),
        default="sequence_optimal",
        help="opd/combine with --hint-candidates > 1: how one is picked (judging.hint_select)",
    )
    parser.add_argument(
        "--judge-prm",
        choices=("votes", "logprob"),
        default="votes",
        help="the PRM's verdict when it scores (no --reward-fn): m sampled votes, or the yes/no "
        "log-probs of one forward pass (judging.prm)",
    )
    parser.add_argument(
        "--reward-fn",
        help="rl mode with this reward plug-in (module:function), e.g. "
        "clawrl.judge.reward_examples:stated_preference for `clawrl simulate`; unset: the "
        "judge's mode and reward from clawrl.toml ([judging])",
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="trainable samples per trainer step"
    )
    parser.add_argument(
        "--engine",
        choices=("cpu", "sglang"),
        default="cpu",
        help="policy and judge engines: cpu = clawrl's CPU engine (SGLang's API; LoRA); sglang "
        "= real SGLang on its CPU path through clawrl-engine --backend sglang (`make "
        "setup-sglang` first; full fine-tuning only)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help=f"train and serve a LoRA adapter of this rank on all seven projections (each new "
        f"version loaded by the engines with no pause); 0: full fine-tuning (a paused sync); "
        f"default {LORA_RANK} on the CPU engine, 0 on SGLang",
    )
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha")
    parser.add_argument(
        "--lr",
        type=float,
        help=f"trainer learning rate (ppo.lr); default {LORA_LR} with LoRA, else clawrl.toml's",
    )
    parser.add_argument(
        "--baseline",
        choices=("batch", "none", "config"),
        default="batch",
        help="advantage: batch = each reward minus the batch's mean, over its std (live "
        "traffic samples each prompt once); none = the reward itself; config = clawrl.toml's",
    )
    parser.add_argument(
        "--sync-interval", type=int, default=1, help="steps between policy versions (syncs)"
    )
    parser.add_argument(
        "--tenants",
        choices=("shared", "per_tenant", "config"),
        default="config",
        help="[tenants] mode: shared = one policy for every caller; per_tenant = each caller "
        "(an API key's tenant, see --api-key) trains and is served a LoRA adapter of its own; "
        "config = clawrl.toml's (default shared)",
    )
    parser.add_argument(
        "--tenant-batch",
        type=int,
        help="per_tenant: samples of one tenant per step of its adapter "
        "([tenants] min_samples_per_step; default clawrl.toml's, else 4)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an API key the gateway accepts (repeat for more; each key is a tenant); none: "
        "the API is open (or clawrl.toml's [serving] api_keys)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=16384,
        help="context window of every process (engines, gateway, judge, trainer) as "
        "CLAWRL_MODEL__CONTEXT_LENGTH: OpenClaw's first request alone is ~13k tokens; beyond "
        "the model's trained context (SmolLM2: 8192) engines and trainer stretch RoPE alike "
        "(model.rope_scaling, default yarn); 0: the model's own or clawrl.toml's",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=default_torch_threads(),
        help="torch threads of each engine and of the trainer (default: a third of the cores)",
    )
    parser.add_argument("--status-interval", type=float, default=5.0, help="seconds")
    parser.add_argument("--run-dir", type=Path, default=REPO / "run", help="Redis data, logs...")
    return parser.parse_args(argv)


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
        if shutil.which("prometheus"):
            scraped = {
                "gateway": args.gateway_port,
                "policy-engine": args.policy_port,
                **({"judge-engine": args.judge_port} if needs_judge_engine(args) else {}),
                "judge": args.judge_metrics_port,
                "trainer": args.trainer_metrics_port,
                "weight-sync": args.sync_metrics_port,
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
            f"Ctrl-C stops everything.\n",
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
