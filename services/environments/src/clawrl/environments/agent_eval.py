"""`clawrl eval --track terminal`: how often the served policy solves terminal tasks.

- Held-out (default): every task of the held-out split once, greedy (temperature 0), as side
  turns (served, never recorded or trained); the success rate of the version that played them,
  merged into `<out-dir>/terminal-held-out.csv` and its plot, so successive evaluations (and
  the runner's periodic ones, `clawrl agent run --held-out-every`) make a curve by version.
- Base rate (`--base-rate`): `--attempts` episodes per task at `--temperature` (default 3 at
  0.7) over the train and held-out splits: the success rate per task family and split
  (`terminal-base-rate.csv`, `.png`, and a markdown table on stdout).

A policy version is read from each reply's system_fingerprint; an episode split by a sync
counts for no version, and an evaluation that no version played whole scores nothing (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from clawrl.environments import agent_report as report
from clawrl.environments.episode import EpisodeConfig, EpisodeResult
from clawrl.environments.runner import (
    Clients,
    ResultLog,
    add_connection_args,
    add_policy_args,
    add_task_args,
    connect,
    episode_config,
    load_tasks,
    numbered,
    play_all,
)
from clawrl.environments.runner_metrics import RunnerMetrics
from clawrl.environments.tasks import Task, TaskSetError

log = logging.getLogger(__name__)

HELD_OUT_CSV, HELD_OUT_PNG = "terminal-held-out.csv", "terminal-held-out.png"
BASE_RATE_CSV, BASE_RATE_PNG = "terminal-base-rate.csv", "terminal-base-rate.png"
BASE_RATE_TEMPERATURE = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The terminal track's flags beside `clawrl eval`'s own (--base-url, --api-key, --model,
    --max-tokens, --eval-concurrency name the gateway and the requests)."""
    add_connection_args(parser, gateway=False)
    add_task_args(parser, split=None)
    add_policy_args(parser, temperature=None, concurrency=False)
    parser.add_argument(
        "--base-rate",
        action="store_true",
        help="terminal: N attempts per task at --temperature (default "
        f"{BASE_RATE_TEMPERATURE}) over both splits: success rate per family",
    )
    parser.add_argument(
        "--attempts", type=int, default=3, help="terminal --base-rate: episodes per task"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("run/agent"),
        help="terminal: CSV, PNG and the episodes' JSON lines go here",
    )


def resolve(args: argparse.Namespace) -> None:
    """Per-mode defaults: held-out greedy on the held-out split; base rates at 0.7 over both."""
    if args.split is None:
        args.split = ["train", "heldout"] if args.base_rate else ["heldout"]
    if args.temperature is None:
        args.temperature = BASE_RATE_TEMPERATURE if args.base_rate else 0.0
    if args.attempts < 1:
        raise ValueError("--attempts must be at least 1")
    args.concurrency = args.eval_concurrency


async def play_tasks(
    tasks: Sequence[Task],
    attempts: int,
    clients: Clients,
    config: EpisodeConfig,
    concurrency: int,
    results: ResultLog,
    prefix: str,
) -> list[EpisodeResult]:
    """Each task `attempts` times (logged to `results`); their results, in finishing order."""
    played: list[EpisodeResult] = []

    def add(result: EpisodeResult) -> None:
        results.add(result)
        played.append(result)

    jobs = numbered([t for t in tasks for _ in range(attempts)], prefix)
    await play_all(jobs, clients, config, concurrency, add)
    return played


def record_held_out(
    found: Sequence[report.VersionRate], out_dir: Path, title: str
) -> list[report.VersionRate]:
    """Merge into the held-out CSV of out_dir and redraw its plot; every version so far."""
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = report.merge_versions(report.read_versions(out_dir / HELD_OUT_CSV), found)
    report.write_versions(merged, out_dir / HELD_OUT_CSV)
    report.plot_versions(merged, out_dir / HELD_OUT_PNG, title)
    return merged


async def evaluate(args: argparse.Namespace) -> int:
    """`clawrl eval --track terminal`."""
    try:
        resolve(args)
        tasks = load_tasks(args)
    except (TaskSetError, ValueError) as exc:
        print(f"clawrl eval: {exc}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:6]
    jsonl = args.out_dir / f"eval-{run_id}.jsonl"
    with jsonl.open("w") as sink:
        results = ResultLog(sink, RunnerMetrics())
        async with connect(args, results.metrics) as clients:
            config = episode_config(args, clients.model, train=False)
            attempts = args.attempts if args.base_rate else 1
            print(
                f"terminal eval {run_id}: {len(tasks)} tasks x {attempts} at temperature "
                f"{config.temperature} ({clients.model})",
                flush=True,
            )
            played = await play_tasks(
                tasks, attempts, clients, config, args.concurrency, results, f"eval-{run_id}"
            )
    print(results.summary(), f"(episodes: {jsonl})", flush=True)
    if args.base_rate:
        return base_rate_report(played, args, clients.model)
    found = report.version_rates(played, len(tasks))
    print(report.versions_table(found))
    title = f"clawrl terminal held-out: {clients.model}, {len(tasks)} tasks"
    record_held_out(found, args.out_dir, title)
    print(f"wrote {args.out_dir / HELD_OUT_CSV} and .png")
    return 0 if any(r.complete for r in found) else 2


def base_rate_report(played: list[EpisodeResult], args: argparse.Namespace, model: str) -> int:
    rates = report.family_rates(played)
    rates += report.split_totals(rates)
    report.write_families(rates, args.out_dir / BASE_RATE_CSV)
    title = (
        f"{model}: success per family, {args.attempts} attempts per task at "
        f"temperature {args.temperature}"
    )
    report.plot_families(
        [r for r in rates if r.family != "all"], args.out_dir / BASE_RATE_PNG, title
    )
    print(report.families_table(rates))
    print(f"wrote {args.out_dir / BASE_RATE_CSV} and .png")
    return 0 if any(r.attempts for r in rates) else 1


class HeldOutFollower:
    """The runner's periodic held-out evaluation (make run's terminal track): whenever the
    training episodes have seen a version `every` or more past the last one evaluated (v0 at
    the start), every held-out task of the runner's families once, greedy. An evaluation
    split by a sync is tried again at the next new version."""

    def __init__(
        self,
        args: argparse.Namespace,
        clients: Clients,
        config: EpisodeConfig,
        training: ResultLog,
        started: float,
    ) -> None:
        self.args = args
        self.clients = clients
        self.config = config  # greedy side turns
        self.training = training
        self.started = started
        self.every = args.held_out_every
        self.tasks = load_tasks(
            argparse.Namespace(**{**vars(args), "split": ["heldout"], "task_ids": None})
        )
        self.evaluated: list[int] = []  # versions with a complete evaluation
        self.tried = -1  # the newest version when the last evaluation started
        args.eval_dir.mkdir(parents=True, exist_ok=True)
        self.sink = (args.eval_dir / "held-out-episodes.jsonl").open("a")
        self.results = ResultLog(self.sink, clients.metrics)

    def due(self) -> bool:
        newest = max(self.training.newest_version, 0)
        last = max(self.evaluated, default=-self.every)
        return newest > self.tried and newest >= last + self.every

    async def follow(self) -> None:
        """Until cancelled."""
        try:
            while True:
                if self.due():
                    await self.once()
                self.training.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.training.changed.wait(), timeout=5.0)
        finally:
            self.sink.close()

    async def once(self) -> None:
        self.tried = max(self.training.newest_version, 0)
        prefix = f"heldout-{uuid.uuid4().hex[:6]}"
        played = await play_tasks(
            self.tasks, 1, self.clients, self.config, self.args.concurrency, self.results, prefix
        )
        found = report.version_rates(played, len(self.tasks), time.monotonic() - self.started)
        for rate in found:
            print(
                f"held-out success of v{rate.version}: {rate.rate:.3f} ({rate.passed}/"
                f"{rate.episodes}{'' if rate.complete else ', split by a sync'})",
                flush=True,
            )
            if rate.complete:
                self.evaluated.append(rate.version)
                self.clients.metrics.held_out.set(rate.rate)
                self.clients.metrics.held_out_version.set(rate.version)
        title = f"clawrl terminal held-out: {self.clients.model}, {len(self.tasks)} tasks"
        record_held_out(found, self.args.eval_dir, title)
