"""Track 2 learns on a real model: `make run RUN_ARGS="--track terminal"`'s recipe (outcome-only
reward, OpenClaw-RL's step_wise advantage, a LoRA adapter of SmolLM2-135M) on task families the
base model solves sometimes, for `--minutes` of training, and the held-out success rate at v0
and at the end.

The held-out split is played `--attempts` times per task at `--eval-temperature` (sampled:
2 held-out tasks a family would give greedy figures in steps of 0.5) through the gateway as
side turns, with the runner paused, so that the policy cannot change under an evaluation: v0
before the runner's first training episode, the final version after its last. An episode whose
replies came from another version than the one evaluated is left out and counted. Alongside,
the training episodes' success rate per version (from the runner's JSON lines). Prints one
table, writes a CSV and a PNG (to docs/agents-learning-<advantage>-seed<N>.* with --docs).
Asserts nothing.

    .venv/bin/python tests/bench/bench_terminal_learning.py [--minutes 30] [--seed 0] [--docs]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.bench.bench_learning import running_stack, scrape  # noqa: E402
from tests.conftest import free_port  # noqa: E402

FAMILIES = "delete_file,make_dir"  # base rates 0.40 and 0.30 on the train split (docs/agents.md)


def runner_pid(run_dir: Path, metrics_port: int, timeout_s: float = 300.0) -> int:
    """The stack's agent runner, once its /metrics answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            up = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).is_success
        except httpx.HTTPError:
            up = False
        found = subprocess.run(
            ["pgrep", "-f", "--", f"--eval-dir {run_dir / 'agent'}"], capture_output=True, text=True
        ).stdout.split()
        if up and len(found) == 1:
            return int(found[0])
        time.sleep(1)
    sys.exit(f"the agent runner did not start: see {run_dir / 'stack.log'}")


def trainer_version(port: int) -> int:
    metrics = scrape(f"http://127.0.0.1:{port}/metrics")
    return int(metrics.get(("clawrl_trainer_policy_version", ()), 0))


def stream_lag(redis_port: int, stream: str, group: str) -> int:
    """Entries of `stream` its consumer group `group` has not read yet."""
    import redis

    client = redis.Redis(port=redis_port)
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return 0
    finally:
        client.close()
    return sum(int(g.get("lag") or 0) for g in groups if g["name"] in (group, group.encode()))


def settle(ports: dict[str, int], limit_s: float = 900.0) -> int:
    """Wait until what the judge and the trainer still held when the runner paused is trained
    (or masked): no turn left for the judges, no sample left for the trainer, and the
    trainer's version unmoved for longer than one of its steps takes. -> that version."""
    metrics = f"http://127.0.0.1:{ports['trainer-metrics']}/metrics"
    version, since, deadline = -1, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        scraped = scrape(metrics)
        now = int(scraped.get(("clawrl_trainer_policy_version", ()), 0))
        total = (("phase", "total"),)
        count = scraped.get(("clawrl_trainer_step_duration_seconds_count", total), 0)
        step_s = scraped.get(("clawrl_trainer_step_duration_seconds_sum", total), 0) / max(count, 1)
        if now != version:
            version, since = now, time.monotonic()
        drained = not stream_lag(ports["redis"], "clawrl:turns", "judges") and not stream_lag(
            ports["redis"], "clawrl:samples", "trainers"
        )
        if drained and time.monotonic() - since > max(60.0, 1.5 * step_s):
            break
        time.sleep(5)
    time.sleep(10)  # the sync that loads it into the engine the gateway serves
    return version


def held_out(
    ports: dict[str, int], env: dict, args: argparse.Namespace, out: Path
) -> dict[str, object]:
    """`clawrl eval --track terminal --base-rate` over the held-out split through the gateway;
    per family the passes among episodes played whole by the newest version seen."""
    argv = [sys.executable, "-m", "clawrl.simulate.main", "eval", "--track", "terminal",
            "--base-url", f"http://127.0.0.1:{ports['gateway']}/v1",
            "--environments-url", f"http://127.0.0.1:{ports['environments']}",
            "--base-rate", "--split", "heldout", "--families", args.families,
            "--attempts", str(args.attempts), "--temperature", str(args.eval_temperature),
            "--eval-concurrency", "2", "--seed", str(args.seed), "--out-dir", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        sys.exit(f"clawrl eval failed: {done.stdout}{done.stderr}")
    return read_eval(out)


def read_eval(out: Path) -> dict[str, object]:
    """An evaluation's episodes (out/eval-*.jsonl): per family the passes among the episodes
    played whole by the newest version seen, and how many were left out."""
    episodes = [json.loads(line) for p in out.glob("eval-*.jsonl") for line in p.open()]
    seen = [e["policy_version"] for e in episodes if e["policy_version"] is not None]
    version = max(seen, default=None)
    passed: dict[str, list[bool]] = defaultdict(list)
    for e in episodes:
        if e["passed"] is not None and e["policy_version"] == version:
            passed[e["family"]].append(e["passed"])
            passed["all"].append(e["passed"])
    return {"version": version, "episodes": len(episodes),
            "left_out": len(episodes) - len(passed["all"]), "passed": dict(passed)}  # fmt: skip


def train_curve(episodes_jsonl: Path) -> list[tuple[int, int, int]]:
    """(version, training episodes played whole by it, passed) per version."""
    by_version: dict[int, list[bool]] = defaultdict(list)
    for line in episodes_jsonl.open():
        e = json.loads(line)
        if e["split"] == "train" and e["passed"] is not None and e["policy_version"] is not None:
            by_version[e["policy_version"]].append(e["passed"])
    return [(v, len(p), sum(p)) for v, p in sorted(by_version.items())]


def rate(passed: list[bool]) -> str:
    return f"{sum(passed) / len(passed):.3f} ({sum(passed)}/{len(passed)})" if passed else "-"


def report(before: dict, after: dict, curve: list, families: list[str]) -> str:
    lines = [f"| family | held-out v{before['version']} | held-out v{after['version']} | gain |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for family in [*families, "all"]:
        b, a = before["passed"].get(family, []), after["passed"].get(family, [])
        gain = f"{sum(a) / len(a) - sum(b) / len(b):+.3f}" if a and b else "-"
        lines.append(f"| {family} | {rate(b)} | {rate(a)} | {gain} |")
    lines.append("")
    lines.append("| version | training episodes | passed | success |")
    lines.append("|---:|---:|---:|---:|")
    lines += [f"| v{v} | {n} | {p} | {p / n:.3f} |" for v, n, p in curve]
    return "\n".join(lines)


def write_csv(path: Path, before: dict, after: dict, curve: list, run: dict[str, str]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["kind", "policy_version", "family", "episodes", "passed", "rate",
                         *run])  # fmt: skip
        for kind, ev in (("held_out_v0", before), ("held_out_final", after)):
            for family, passed in ev["passed"].items():
                writer.writerow([kind, ev["version"], family, len(passed), sum(passed),
                                 f"{sum(passed) / len(passed):.4f}", *run.values()])  # fmt: skip
        for version, n, p in curve:
            writer.writerow(["train", version, "all", n, p, f"{p / n:.4f}", *run.values()])


def plot(path: Path, before: dict, after: dict, curve: list, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        ax.plot([v for v, _, _ in curve], [p / n for _, n, p in curve], "o-", alpha=0.6,
                label="training episodes (T 0.7), per version")  # fmt: skip
    for ev, marker in ((before, "s"), (after, "D")):
        passed = ev["passed"].get("all", [])
        if passed and ev["version"] is not None:
            ax.plot([ev["version"]], [sum(passed) / len(passed)], marker, markersize=9,
                    label=f"held-out v{ev['version']} ({len(passed)} episodes)")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--minutes", type=float, default=30.0, help="of training (runner on)")
    parser.add_argument("--seed", type=int, default=0, help="the runner's and eval's task order")
    parser.add_argument("--families", default=FAMILIES, help="task families (train and eval)")
    parser.add_argument("--attempts", type=int, default=12, help="held-out episodes per task")
    parser.add_argument("--eval-temperature", type=float, default=0.7)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="training episodes at once (1: the trainer, the slowest part here, keeps up)",
    )
    parser.add_argument(
        "--advantage",
        choices=("batch", "step_wise"),
        default="batch",
        help="the stack's --terminal-advantage",
    )
    parser.add_argument("--stack-args", default="", help="more stack.py flags (e.g. --lr 1e-3)")
    parser.add_argument("--docs", action="store_true", help="copy the CSV and PNG to docs/")
    args = parser.parse_args()
    families = args.families.split(",")
    started = time.monotonic()
    extra = {"environments": free_port(), "runner-metrics": free_port()}
    stack_args = ["--track", "terminal", "--method", "rl", "--terminal-families", args.families,
                  "--terminal-seed", str(args.seed), "--terminal-advantage", args.advantage,
                  "--terminal-concurrency",
                  str(args.concurrency), "--held-out-every", "0",
                  "--environments-port", str(extra["environments"]),
                  "--runner-metrics-port", str(extra["runner-metrics"]),
                  *shlex.split(args.stack_args)]  # fmt: skip
    with running_stack(args.model, "bench-terminal-", None, stack_args) as (ports, run_dir, env):
        ports = {**ports, **extra}
        env = {**env, "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "local")}
        runner = runner_pid(run_dir, extra["runner-metrics"])
        os.kill(runner, signal.SIGSTOP)  # v0 is measured before it trains anything
        up = time.monotonic() - started
        print(f"stack up after {up:.0f}s; runner {runner} paused", flush=True)
        before = held_out(ports, env, args, run_dir / "eval-v0")
        os.kill(runner, signal.SIGCONT)
        print(f"v0 held-out done; training for {args.minutes:g} minutes", flush=True)
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            time.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
            version = trainer_version(ports["trainer-metrics"])
            left = (deadline - time.monotonic()) / 60
            print(f"  v{version}, {left:.1f} min left", flush=True)
        os.kill(runner, signal.SIGSTOP)
        final = settle(ports)
        print(f"runner paused; trainer settled at v{final}", flush=True)
        after = held_out(ports, env, args, run_dir / f"eval-v{final}")
        curve = train_curve(run_dir / "agent" / "episodes.jsonl")
        counts = scrape(f"http://127.0.0.1:{ports['judge-metrics']}/metrics")
        merged = sum(v for (name, labels), v in counts.items()
                     if name == "clawrl_judge_episode_turns_total"
                     and dict(labels).get("result") == "merged")  # fmt: skip
        os.kill(runner, signal.SIGCONT)  # so that the stack's stop ends it like the rest
        print(report(before, after, curve, families))
        print(f"left out (another version): v0 {before['left_out']}, "
              f"final {after['left_out']}; judge merged {merged:.0f} episode turns")  # fmt: skip
        out = run_dir / f"terminal-learning-{args.advantage}-seed{args.seed}"
        title = (f"{args.model}, {args.families}, {args.advantage}, seed {args.seed}, "
                 f"{args.minutes:g} min: "
                 f"held-out v0 vs v{after['version']}")  # fmt: skip
        run = {"families": args.families, "advantage": args.advantage, "seed": str(args.seed),
               "minutes": f"{args.minutes:g}", "concurrency": str(args.concurrency),
               "attempts": str(args.attempts), "model": args.model}  # fmt: skip
        write_csv(out.with_suffix(".csv"), before, after, curve, run)
        plot(out.with_suffix(".png"), before, after, curve, title)
        if args.docs:
            target = REPO / "docs" / f"agents-learning-{args.advantage}-seed{args.seed}"
            for suffix in (".csv", ".png"):
                target.with_suffix(suffix).write_bytes(out.with_suffix(suffix).read_bytes())
            print(f"wrote {target}.csv and .png")
        print(f"run dir {run_dir}; {(time.monotonic() - started) / 60:.1f} min in all")


if __name__ == "__main__":
    main()
