"""`make run RUN_ARGS="--track terminal"`: Track 2 on the local stack. Beside the learning loop
stack.py starts, the sandbox service (local bubblewrap backend) and the agent runner, which
plays the train split's tasks over and over as episodes through the gateway (each one's outcome
posted for the judge) and the held-out split greedily every `--held-out-every` versions (CSV
and plot in <run-dir>/agent). The chat track starts neither."""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent

# The 135M PRM judges at chance (docs/judge.md): a terminal turn's reward is its episode's
# outcome alone unless --prm-step-coef says otherwise.
PRM_STEP_COEF = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("terminal track (--track terminal)")
    group.add_argument(
        "--track",
        choices=("chat", "terminal"),
        default="chat",
        help="chat: serve and learn from whoever talks to the gateway (e.g. `clawrl simulate`); "
        "terminal: also start the sandbox service and the agent runner on the terminal tasks",
    )
    group.add_argument("--environments-port", type=int, default=30040, help="sandbox service")
    group.add_argument("--runner-metrics-port", type=int, default=30041, help="runner /metrics")
    group.add_argument(
        "--terminal-families",
        help="comma-separated task families the runner plays (default: all of them)",
    )
    group.add_argument(
        "--terminal-concurrency", type=int, default=2, help="training episodes at once"
    )
    group.add_argument(
        "--terminal-seed", type=int, default=0, help="seed of the runner's task order"
    )
    group.add_argument(
        "--held-out-every",
        type=int,
        default=5,
        help="play the held-out split (greedy) every this many new versions (0: never)",
    )
    group.add_argument(
        "--terminal-advantage",
        choices=("batch", "step_wise"),
        default="batch",
        help="--method rl's advantage on episodes: batch = each turn's reward against the "
        "batch's mean (grpo, --baseline batch); step_wise = OpenClaw-RL's, normalised within "
        "(task, turn index) buckets, which need several attempts at a task in one batch (the "
        "runner plays each task once per pass: its buckets are mostly single turns, kept raw)",
    )
    group.add_argument(
        "--prm-step-coef",
        type=float,
        default=PRM_STEP_COEF,
        help="episodes.prm_step_coef: reward = (2 * outcome - 1) + coef * the turn's step "
        "score (PRM votes, or --reward-fn); 0: the outcome alone (the PRM is not asked)",
    )


def ports(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.environments_port, args.runner_metrics_port) if is_terminal(args) else ()


def is_terminal(args: argparse.Namespace) -> bool:
    return getattr(args, "track", "chat") == "terminal"


def judge_env(args: argparse.Namespace) -> dict[str, str]:
    """How an episode's turn is rewarded: its outcome, plus the step score times the coef."""
    return {"CLAWRL_EPISODES__PRM_STEP_COEF": str(args.prm_step_coef)} if is_terminal(args) else {}


def training_env(args: argparse.Namespace) -> dict[str, str]:
    """rl on episodes with --terminal-advantage step_wise: OpenClaw-RL's advantage, each turn's
    reward normalised among the turns of the same task and turn index. The default (batch)
    leaves the chat track's grpo against the batch's mean: measured on this host, step_wise
    with mostly single-turn buckets trained on raw -1s (most episodes fail) and unlearned the
    tool call (docs/agents.md)."""
    if is_terminal(args) and args.method == "rl" and args.terminal_advantage == "step_wise":
        return {"CLAWRL_ADVANTAGE__ESTIMATOR": "step_wise"}
    return {}


def sandbox_root(run_dir: Path) -> Path:
    """Where the stack's sandboxes live: one directory per run dir under the system's temp dir
    (a restarted stack finds and removes its leftovers there, and two stacks never share one).
    Not under the run dir: a root service runs sandboxes as another uid (sandbox.run_as_uid),
    which must traverse every directory above them, and a run dir may sit under a 0700 one."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"clawrl-sandboxes-{key}"


def sandbox_service(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The sandbox service's command and settings."""
    root = sandbox_root(args.run_dir)
    root.mkdir(exist_ok=True)
    root.chmod(0o711)  # the sandbox uid passes through, lists nothing
    env = {
        "CLAWRL_ENVIRONMENTS_SERVER__HOST": "127.0.0.1",
        "CLAWRL_ENVIRONMENTS_SERVER__PORT": str(args.environments_port),
        "CLAWRL_SANDBOX__ROOT_DIR": str(root),
    }
    return [str(BIN / "clawrl-environments")], env


def runner_argv(args: argparse.Namespace) -> list[str]:
    """`clawrl agent run` over the train split until stopped, the held-out split on the side."""
    argv = [
        str(BIN / "clawrl"), "agent", "run",
        "--gateway-url", f"http://127.0.0.1:{args.gateway_port}/v1",
        "--environments-url", f"http://127.0.0.1:{args.environments_port}",
        "--model", args.policy_model,
        "--split", "train", "--episodes", "0",
        "--concurrency", str(args.terminal_concurrency),
        "--seed", str(args.terminal_seed),
        "--held-out-every", str(args.held_out_every),
        "--metrics-port", str(args.runner_metrics_port),
        "--eval-dir", str(args.run_dir / "agent"),
        "--out", str(args.run_dir / "agent" / "episodes.jsonl"),
    ]  # fmt: skip
    if args.terminal_families:
        argv += ["--families", args.terminal_families]
    if args.api_key:
        argv += ["--api-key", args.api_key[0]]
    return argv


def scraped(args: argparse.Namespace) -> dict[str, int]:
    """Prometheus jobs of the terminal track (deploy/prometheus/prometheus.yml)."""
    if not is_terminal(args):
        return {}
    return {"environments": args.environments_port, "agent-runner": args.runner_metrics_port}


def start(stack, args: argparse.Namespace, http_ok, restarts: int) -> None:
    """The sandbox service, then the runner (once the gateway and the learning loop are up)."""
    argv, env = sandbox_service(args)
    stack.start(
        "environments",
        argv,
        lambda: http_ok(f"http://127.0.0.1:{args.environments_port}/health"),
        env=env,
        restarts=restarts,
    )
    (args.run_dir / "agent").mkdir(parents=True, exist_ok=True)
    stack.start(
        "agent runner",
        runner_argv(args),
        lambda: http_ok(f"http://127.0.0.1:{args.runner_metrics_port}/metrics"),
        restarts=restarts,
    )


def banner(args: argparse.Namespace) -> str:
    return (
        f"The agent runner plays the terminal tasks' train split through the gateway "
        f"(episodes: {args.run_dir / 'agent' / 'episodes.jsonl'}; sandbox service "
        f"http://localhost:{args.environments_port}/status); the held-out success rate per "
        f"version goes to {args.run_dir / 'agent' / 'terminal-held-out.csv'} and .png.\n"
    )
