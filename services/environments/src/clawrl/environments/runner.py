"""`clawrl agent run`: the agent runner. Plays tasks of a task set, each as one session through
the gateway (episode.py) in a sandbox leased from the sandbox service, `--concurrency` at once,
and writes one JSON line per episode (task id, family, split, steps, passed, policy version).

    clawrl agent run --split train --families write_file,count_lines --episodes 40 \\
        --gateway-url http://localhost:30000/v1 --environments-url http://localhost:8090

`--episodes 0` runs until stopped (make run's terminal track); with `--held-out-every K` it
also plays the held-out split greedily whenever the policy is K versions past the last one
evaluated (agent_eval.py) and keeps the per-version CSV and plot up to date. SIGTERM, SIGINT and
SIGHUP stop it: the episodes in flight are cancelled, their leases closed, and it exits 143
(130 for SIGINT); a runner killed outright leaves its leases to the service's TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import openai
from prometheus_client import start_http_server

from clawrl.common.logs import configure_logging
from clawrl.common.settings import ClawrlSettings
from clawrl.environments.client import SandboxClient
from clawrl.environments.episode import Episode, EpisodeConfig, EpisodeResult
from clawrl.environments.prompting import PROMPT_STYLES
from clawrl.environments.runner_metrics import RunnerMetrics
from clawrl.environments.tasks import SPLITS, Task, TaskSet, TaskSetError, load_taskset

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# A step's reply: a call with its opening sentence is ~45 tokens; a longer reply is SmolLM2-135M
# rambling in prose or code blocks, which a cut at 128 keeps from costing seconds of CPU each.
MAX_TOKENS = 128


def comma_list(value: str) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def add_connection_args(parser: argparse.ArgumentParser, *, gateway: bool = True) -> None:
    """Where the gateway and the sandbox service are (`gateway=False`: the caller's parser
    already names the gateway as --base-url, --api-key and --model)."""
    if gateway:
        parser.add_argument(
            "--gateway-url",
            "--base-url",
            dest="base_url",
            default="http://localhost:30000/v1",
            help="the gateway's OpenAI API",
        )
        parser.add_argument(
            "--api-key",
            default=os.environ.get("OPENAI_API_KEY") or "local",
            help="the gateway's API key (default: $OPENAI_API_KEY, else 'local')",
        )
        parser.add_argument("--model", help="model name (default: the gateway's first model)")
    parser.add_argument(
        "--environments-url",
        default="http://localhost:8090",
        help="the sandbox service's lease API",
    )
    parser.add_argument(
        "--environments-token",
        default=os.environ.get("CLAWRL_ENVIRONMENTS_SERVER__TOKEN"),
        help="its bearer token, if it has one",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=10.0,
        help="seconds between a lease's heartbeats (below the service's leases.ttl_s)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=180.0,
        help="a model request's limit (tried 3 times): a hung engine fails the episode at the "
        "'model' stage instead of holding it (the openai client's own default is 600 s)",
    )


def add_task_args(parser: argparse.ArgumentParser, split: str) -> None:
    """Which tasks: the set, the split, the families."""
    parser.add_argument("--tasks-dir", type=Path, help="a task set directory (default: shipped)")
    parser.add_argument(
        "--terminal-bench", type=Path, help="add the Terminal-Bench tasks under this directory"
    )
    parser.add_argument(
        "--split",
        default=split,
        type=comma_list,
        help=f"split(s), comma-separated: {', '.join(SPLITS)}",
    )
    parser.add_argument("--families", type=comma_list, help="only these task families")
    parser.add_argument("--task", dest="task_ids", type=comma_list, help="only these task ids")


def add_policy_args(
    parser: argparse.ArgumentParser, temperature: float | None, concurrency: bool = True
) -> None:
    """How the model is asked (and, with `concurrency`, how many episodes at once)."""
    parser.add_argument("--temperature", type=float, default=temperature, help="sampling")
    parser.add_argument(
        "--prompt",
        choices=PROMPT_STYLES,
        default="few-shot",
        help="few-shot: three worked episodes before the task (SmolLM2-135M "
        "calls no tool without them); plain: the system message alone",
    )
    parser.add_argument(
        "--max-observation-chars",
        type=int,
        default=2000,
        help="a longer tool output is cut to its head and tail",
    )
    if concurrency:
        parser.add_argument("--concurrency", type=int, default=2, help="episodes at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task order")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`clawrl agent run`'s flags."""
    add_connection_args(parser)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="a reply's limit")
    add_task_args(parser, "train")
    add_policy_args(parser, 0.7)
    parser.add_argument(
        "--episodes",
        type=int,
        help="episodes in all (default: each selected task once; 0: until "
        "stopped, the tasks over and over)",
    )
    parser.add_argument(
        "--no-outcome",
        dest="post_outcome",
        action="store_false",
        help="post no outcome (the judge masks the episodes' turns once its "
        "outcome_timeout_s passes)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON lines, one per episode (default: run/agent/episodes-<run id>.jsonl)",
    )
    parser.add_argument(
        "--transcripts",
        action="store_true",
        help="keep each episode's messages (from the instruction on) in its JSON line",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="serve /metrics (0: off)")
    parser.add_argument(
        "--held-out-every",
        type=int,
        default=0,
        help="with --episodes 0: play the held-out split greedily for every K "
        "new policy versions (0: never)",
    )
    parser.add_argument(
        "--eval-dir", type=Path, default=Path("run/agent"), help="the held-out CSV and PNG go here"
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("concurrency", "eval_concurrency", "max_tokens", "max_observation_chars"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "heartbeat_s", 1.0) <= 0:
        parser.error("--heartbeat-s must be positive")
    bad = [s for s in args.split or () if s not in SPLITS]
    if bad:
        parser.error(f"--split: {bad[0]!r} is not one of {', '.join(SPLITS)}")
    if getattr(args, "episodes", None) is not None and args.episodes < 0:
        parser.error("--episodes must be 0 (no limit) or more")
    if getattr(args, "held_out_every", 0) < 0:
        parser.error("--held-out-every must be 0 (never) or more")


# --- tasks ------------------------------------------------------------------------------------


def select_tasks(
    taskset: TaskSet,
    splits: Sequence[str],
    families: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
) -> list[Task]:
    """The tasks of `splits` (in the families, with the ids, when given), by id; TaskSetError
    for an unknown family or id, or when nothing is left."""
    known = set(taskset.families())
    unknown = sorted(set(families or ()) - known)
    if unknown:
        raise TaskSetError(
            f"unknown family {unknown[0]!r}; the families: {', '.join(sorted(known))}"
        )
    tasks = [t for split in splits for t in taskset.split(split)]
    if families:
        tasks = [t for t in tasks if t.family in families]
    if task_ids:
        missing = sorted(set(task_ids) - {t.id for t in tasks})
        if missing:
            raise TaskSetError(f"no task {missing[0]!r} in the selected splits and families")
        tasks = [t for t in tasks if t.id in task_ids]
    if not tasks:
        raise TaskSetError("no task matches the split and families given")
    return sorted(tasks, key=lambda t: (t.split, t.id))


def schedule(tasks: Sequence[Task], seed: int, limit: int | None) -> Iterator[Task]:
    """The tasks in a fresh seeded order each pass over them (every task once per pass), for
    `limit` episodes (None: one pass; 0: no end)."""
    rng = random.Random(seed)

    def passes() -> Iterator[Task]:
        while True:
            order = list(tasks)
            rng.shuffle(order)
            yield from order

    if limit is None:
        limit = len(tasks)
    return passes() if limit == 0 else itertools.islice(passes(), limit)


def load_tasks(args: argparse.Namespace) -> list[Task]:
    """The selected tasks of the shipped set (or --tasks-dir), plus --terminal-bench's."""
    taskset = load_taskset(args.tasks_dir)
    if getattr(args, "terminal_bench", None) is not None:
        from clawrl.environments.terminal_bench import load_tasks as load_bench

        converted = load_bench(args.terminal_bench)
        for skipped in converted.skipped:
            log.info("Terminal-Bench task %s skipped: %s", skipped.name, skipped.reason)
        taskset = TaskSet.of([*taskset.tasks, *converted.tasks])
    return select_tasks(taskset, args.split, args.families, args.task_ids)


# --- playing ----------------------------------------------------------------------------------


@dataclass
class Clients:
    """The runner's connections, shared by all its episodes."""

    gateway: openai.AsyncOpenAI
    sandbox: SandboxClient
    model: str
    metrics: RunnerMetrics


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, metrics: RunnerMetrics) -> AsyncIterator[Clients]:
    gateway = openai.AsyncOpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        max_retries=2,
        timeout=getattr(args, "request_timeout_s", 180.0),
    )
    sandbox = SandboxClient(args.environments_url, token=args.environments_token)
    try:
        model = args.model or (await gateway.models.list()).data[0].id
        yield Clients(gateway, sandbox, model, metrics)
    finally:
        await sandbox.aclose()
        await gateway.close()


async def play_all(
    jobs: Iterable[tuple[Task, str]],
    clients: Clients,
    config: EpisodeConfig,
    concurrency: int,
    on_result: Callable[[EpisodeResult], None],
) -> None:
    """Play (task, session id) jobs, `concurrency` at once, until they run out; each result
    goes to `on_result` as it finishes. Cancelling it cancels the episodes in flight (their
    leases are closed on the way out)."""
    queue = iter(jobs)

    async def worker() -> None:
        pause = 0.0
        for task, session_id in queue:  # one shared iterator: each job is taken once
            episode = Episode(task, session_id, sandbox=clients.sandbox, gateway=clients.gateway,
                              config=config, metrics=clients.metrics)  # fmt: skip
            result = await episode.play()
            on_result(result)
            # A gateway or sandbox service that is down fails every episode at once: back off
            # (1 s, doubling to 30 s) instead of spinning through the tasks.
            pause = 0.0 if result.passed is not None else min(30.0, max(1.0, 2 * pause))
            await asyncio.sleep(pause)

    # A task group, not gather: cancelled, it waits for every worker to close its lease
    # (gather returns as soon as the first child is cancelled, and the clients close under the
    # others).
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


def numbered(tasks: Iterable[Task], prefix: str) -> Iterator[tuple[Task, str]]:
    """Each task with its episode's session id: `<prefix>-<n>-<task id>`."""
    for n, task in enumerate(tasks):
        yield task, f"{prefix}-{n:06d}-{task.id}"[:256]


def episode_config(args: argparse.Namespace, model: str, *, train: bool = True) -> EpisodeConfig:
    """The episodes' settings from the command line; `train=False`: side turns (evaluations),
    nothing recorded, trained or posted, every transcript kept."""
    return EpisodeConfig(
        model=model,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        prompt=args.prompt,
        train=train,
        post_outcome=train and getattr(args, "post_outcome", True),
        max_observation_chars=args.max_observation_chars,
        transcript=getattr(args, "transcripts", False) or not train,
        heartbeat_s=getattr(args, "heartbeat_s", 10.0),
    )


class ResultLog:
    """The episodes' JSON lines (flushed one by one: a killed runner keeps what it wrote), and
    what the run saw: counts (not the results: a runner may run for days) and the newest
    policy version."""

    def __init__(self, out: TextIO, metrics: RunnerMetrics) -> None:
        self.out = out
        self.metrics = metrics
        self.counts = {True: 0, False: 0, None: 0}  # passed, failed, broke off
        self.newest_version = -1
        self.changed = asyncio.Event()

    def add(self, result: EpisodeResult) -> None:
        self.counts[result.passed] += 1
        self.out.write(json.dumps(result.record()) + "\n")
        self.out.flush()
        if result.versions and max(result.versions) > self.newest_version:
            self.newest_version = max(result.versions)
            self.metrics.policy_version.set(self.newest_version)
        self.changed.set()
        verdict = {True: "passed", False: "failed", None: "error"}[result.passed]
        log.info(
            "%s %s in %d step(s), v%s (%s)",
            result.task_id,
            verdict,
            result.steps,
            result.policy_version,
            result.ended,
            extra={"session_id": result.session_id},
        )

    @property
    def broke_off_only(self) -> bool:
        """Some episodes, none of them checked."""
        return self.counts[None] > 0 and not (self.counts[True] or self.counts[False])

    def summary(self) -> str:
        passed, checked = self.counts[True], self.counts[True] + self.counts[False]
        rate = f"{passed / checked:.3f}" if checked else "-"
        return (
            f"{checked + self.counts[None]} episodes: {passed} passed of {checked} checked "
            f"({rate}), {self.counts[None]} broke off"
        )


def stop_on_signals(task: asyncio.Task, caught: list[int]) -> None:
    """The first stop signal cancels `task` (its episodes close their leases); later ones are
    ignored, so a second Ctrl-C cannot cut the closing short."""
    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        if not caught:
            caught.append(signum)
            log.warning(
                "stopping on %s: closing the leases of the episodes in flight",
                signal.Signals(signum).name,
            )
            task.cancel()

    for signum in EXIT_CODES:
        loop.add_signal_handler(signum, stop, signum)


async def run(args: argparse.Namespace) -> int:
    """`clawrl agent run`."""
    configure_logging(ClawrlSettings().logging, "agent-runner")
    # The openai client's own httpx copy logs every request at INFO, as httpx would.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    try:
        tasks = load_tasks(args)
    except TaskSetError as exc:
        print(f"clawrl agent run: {exc}", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:6]
    out = args.out or Path("run/agent") / f"episodes-{run_id}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    metrics = RunnerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    caught: list[int] = []
    with out.open("a") as sink:
        results = ResultLog(sink, metrics)
        main = asyncio.ensure_future(_play(args, tasks, run_id, results, metrics))
        stop_on_signals(main, caught)
        try:
            await main
        except asyncio.CancelledError:
            if not caught:
                raise
        except (openai.APIError, OSError) as exc:
            print(f"clawrl agent run: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    print(f"{results.summary()}; wrote {out}", flush=True)
    if caught:
        return EXIT_CODES[signal.Signals(caught[0])]
    return 1 if results.broke_off_only else 0


async def _play(
    args: argparse.Namespace,
    tasks: list[Task],
    run_id: str,
    results: ResultLog,
    metrics: RunnerMetrics,
) -> None:
    async with connect(args, metrics) as clients:
        config = episode_config(args, clients.model)
        families = ", ".join(sorted({t.family for t in tasks}))
        print(
            f"agent run {run_id}: {len(tasks)} tasks ({'/'.join(args.split)}: {families}) "
            f"against {args.base_url} ({clients.model}), {args.concurrency} at once",
            flush=True,
        )
        jobs = numbered(schedule(tasks, args.seed, args.episodes), f"agent-{run_id}")
        following = []
        if args.episodes == 0 and args.held_out_every:
            from clawrl.environments.agent_eval import HeldOutFollower

            held_out = replace(episode_config(args, clients.model, train=False), temperature=0.0)
            follower = HeldOutFollower(args, clients, held_out, results, time.monotonic())
            following.append(follower.follow())
        async with asyncio.TaskGroup() as group:  # see play_all: it waits for every lease
            group.create_task(play_all(jobs, clients, config, args.concurrency, results.add))
            for follow in following:
                group.create_task(follow)
