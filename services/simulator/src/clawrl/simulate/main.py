"""`clawrl simulate`: a scripted user with a personal preference talks to the gateway (official
`openai` client) and says in its next message whether each reply suited it; reports, per policy
version, its own check of the replies, the judge's reward and the held-out score (CSV, PNG,
table). `clawrl eval`: the held-out score of a served version.

The policy version of a reply is read from its `system_fingerprint` (`clawrl-policy-vN`); the
rewards come from the samples stream (the judge's Sample.reward of this run's sessions, by the
weight version that produced each response). Ctrl-C stops starting sessions and reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from pathlib import Path

import openai

from clawrl.common.proto.records_pb2 import Sample
from clawrl.common.records import RecordError, decode_entry
from clawrl.common.redis_client import connect
from clawrl.common.settings import RedisSettings
from clawrl.simulate.evaluation import (
    EvalError,
    HeldOutScore,
    adapter_version,
    complete,
    held_out_answers,
    scores,
)
from clawrl.simulate.report import per_version, plot, table, write_csv
from clawrl.simulate.scenarios import SCENARIOS
from clawrl.simulate.simulation import Progress, Simulation, SimulationConfig

# Long enough for a list to show its line breaks, short enough for a 2-core machine. Measured on
# SmolLM2-135M at v0 (README): 47 % of replies sampled at temperature 0.8 meet the preference at
# 96 tokens (31-41 % at 128, 75-78 % at 64), and 19 % of greedy held-out replies.
MAX_TOKENS = 96
TEMPERATURE = 0.8

log = logging.getLogger(__name__)


def adapter_name(value: str) -> str:
    """--lora's check: the trainer's adapter names, policy-vN, carry the version."""
    try:
        adapter_version(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://localhost:30000/v1", help="OpenAI API")
    parser.add_argument("--api-key", default="local", help="API key")
    parser.add_argument("--model", help="model name (default: the endpoint's first /v1/models)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="max_tokens of a reply")
    parser.add_argument(
        "--eval-concurrency", type=int, default=4, help="held-out questions asked at once"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clawrl", description="clawrl tools")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="a scripted user drives the gateway")
    add_client_args(sim)
    sim.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="preference",
        help="preference: open questions, the user wants one paragraph (judge reward "
        "clawrl.judge.reward_examples:stated_preference); arithmetic: word problems "
        "(arithmetic_confirmed)",
    )
    sim.add_argument("--sessions", type=int, default=20, help="sessions in all (0: no limit)")
    sim.add_argument("--turns", type=int, default=3, help="questions per session")
    sim.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    sim.add_argument(
        "--until-version",
        type=int,
        help="start no new session once a reply comes from this version",
    )
    sim.add_argument("--temperature", type=float, default=TEMPERATURE, help="sampling temperature")
    sim.add_argument("--seed", type=int, default=0, help="seed of the questions")
    sim.add_argument(
        "--held-out",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="score the held-out questions for each new version it sees (default: on with the "
        "preference scenario)",
    )
    sim.add_argument(
        "--redis-url",
        default="redis://localhost:6390/0",
        help="Redis of the stack, to read the judge's rewards ('' to skip)",
    )
    sim.add_argument(
        "--engine-url",
        help="the policy engine (SGLang API): held-out evaluations ask it, pinned to each "
        "version's LoRA adapter policy-vN, so no sync can split one (LoRA runs only)",
    )
    sim.add_argument("--samples-stream", default="clawrl:samples", help="samples stream")
    sim.add_argument(
        "--stream-shards", type=int, default=1, help="the stack's [redis] stream_shards"
    )
    sim.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the stack's Redis is a cluster ([redis] cluster)",
    )
    sim.add_argument("--settle-s", type=float, default=10.0, help="wait for the judge at the end")
    sim.add_argument("--out-dir", type=Path, default=Path("run/simulate"), help="CSV + PNG here")
    ev = commands.add_parser(
        "eval", help="held-out score of a served version against the user's preference"
    )
    add_client_args(ev)
    ev.add_argument(
        "--lora",
        type=adapter_name,
        help="against an engine: the adapter to score (policy-vN, sent as lora_path); unset: "
        "what the endpoint serves (through the gateway: the current version, as side turns)",
    )
    return parser.parse_args(argv)


async def judged_rewards(
    settings: RedisSettings, stream: str, prefix: str, expected: int, settle_s: float
) -> list[tuple[int, float]]:
    """(policy version, reward) of the judged samples of this run's sessions, read from every
    shard of the samples stream; waits up to settle_s for the judge to catch up with `expected`
    samples. Masked samples carry no reward and are left out."""
    redis = connect(settings)
    streams = settings.shards().names(stream)
    deadline = time.monotonic() + settle_s
    try:
        while True:
            samples = []
            entries = [entry for name in streams for entry in await redis.xrange(name)]
            for _, fields in entries:
                try:
                    sample = decode_entry(fields, Sample)
                except RecordError:
                    continue
                if sample.session_id.startswith(prefix):
                    samples.append(sample)
            if len(samples) >= expected or time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
    finally:
        await redis.aclose()
    return [(s.policy_version, s.reward) for s in samples if any(s.loss_mask)]


class Evaluator:
    """Scores the held-out questions whenever the simulation has seen a version newer than the
    last one scored (versions that come and go during an evaluation are skipped), and once more
    at the end for the final version.

    Through the gateway a sync during an evaluation splits it between two versions, and such a
    split scores nothing: when versions come faster than an evaluation takes, only the final one
    is scored. With `--engine-url` (LoRA versions) each evaluation asks the policy engine itself,
    pinned to the newest version's adapter (`policy-vN`; the base model for v0), so every
    version it gets to is scored whole."""

    def __init__(self, client: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> None:
        self.client = client
        self.model = model
        self.args = args
        self.found: dict[int, HeldOutScore] = {}
        self.failures = 0
        self.engine = None
        if getattr(args, "engine_url", None):
            self.engine = openai.AsyncOpenAI(
                base_url=f"{args.engine_url.rstrip('/')}/v1", api_key="none", max_retries=2
            )

    async def once(self, version: int | None = None) -> bool:
        """One evaluation (of `version`, pinned, when an engine is given); False when a
        question got no reply."""
        client, lora = self.client, None
        if self.engine is not None and version is not None:
            client, lora = self.engine, (f"policy-v{version}" if version else None)
        try:
            answers = await held_out_answers(
                client, self.model, max_tokens=self.args.max_tokens, lora=lora,
                concurrency=self.args.eval_concurrency,
            )  # fmt: skip
        except EvalError as exc:
            self.failures += 1
            log.warning("held-out evaluation failed: %s", exc)
            return False
        for score in complete(scores(answers)):
            self.found[score.version] = score
            print(f"held-out score of v{score.version}: {score.score:.3f} ({score.summary()})",
                  flush=True)  # fmt: skip
        return True

    def behind(self, progress: Progress) -> bool:
        """The simulation has seen a version newer than every one scored."""
        return progress.newest_version > max(self.found, default=-1)

    async def follow(self, progress: Progress, done: asyncio.Event) -> None:
        while not done.is_set():
            # After a failure, a pause: the gateway may be down or restarting.
            ok = not self.behind(progress) or await self.once(progress.newest_version)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0 if ok else 5.0)
        if self.behind(progress):
            await self.once(progress.newest_version)


async def first_model(client: openai.AsyncOpenAI, model: str | None) -> str:
    return model or (await client.models.list()).data[0].id


async def simulate(args: argparse.Namespace) -> int:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    model = await first_model(client, args.model)
    run_id = uuid.uuid4().hex[:6]
    scenario = SCENARIOS[args.scenario]
    config = SimulationConfig(
        sessions=args.sessions,
        turns=args.turns,
        concurrency=args.concurrency,
        until_version=args.until_version,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        run_id=run_id,
        scenario=scenario,
    )
    simulation = Simulation(client, model, config)
    loop = asyncio.get_running_loop()
    # Ctrl-C stops starting sessions and still reports.
    loop.add_signal_handler(signal.SIGINT, simulation.stop.set)
    print(f"simulating ({args.scenario}) against {args.base_url} ({model}), run {run_id}",
          flush=True)  # fmt: skip
    held_out = args.held_out if args.held_out is not None else args.scenario == "preference"
    evaluator = Evaluator(client, model, args)
    finished = asyncio.Event()
    following = (
        asyncio.create_task(evaluator.follow(simulation.progress, finished)) if held_out else None
    )
    progress = await simulation.run()
    finished.set()
    if following is not None:
        await following
    rewards = []
    if args.redis_url:
        store = RedisSettings(
            url=args.redis_url, cluster=args.redis_cluster, stream_shards=args.stream_shards
        )
        rewards = await judged_rewards(
            store, args.samples_stream, f"sim-{run_id}-", len(progress.outcomes),
            args.settle_s,
        )  # fmt: skip
    stats = per_version(progress.outcomes, rewards, list(evaluator.found.values()))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    check = scenario.check_name
    write_csv(stats, args.out_dir / f"simulate-{run_id}.csv", check)
    minutes = (time.monotonic() - progress.started) / 60
    turns = len(progress.outcomes)
    title = f"clawrl simulate ({args.scenario}): {model}, {turns} turns in {minutes:.1f} min"
    plot(stats, args.out_dir / f"simulate-{run_id}.png", title, check)
    print(f"\n{table(stats, check)}\n\n{turns} turns, {progress.failures} failed requests, "
          f"{evaluator.failures} failed evaluations, {minutes:.1f} min; wrote "
          f"{args.out_dir}/simulate-{run_id}.csv and .png")  # fmt: skip
    return 1 if progress.failures and not progress.outcomes else 0


async def evaluate(args: argparse.Namespace) -> int:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    model = await first_model(client, args.model)
    try:
        answers = await held_out_answers(
            client, model, max_tokens=args.max_tokens, lora=args.lora,
            concurrency=args.eval_concurrency,
        )  # fmt: skip
    except EvalError as exc:
        print(f"clawrl eval: {exc}", file=sys.stderr)
        return 1
    found = scores(answers)
    for score in found:
        print(f"v{score.version}: held-out score {score.score:.3f} ({score.summary()})")
    # A sync during the evaluation splits it: no version was scored on every question.
    return 0 if complete(found) else 2


COMMANDS = {"simulate": simulate, "eval": evaluate}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    sys.exit(asyncio.run(COMMANDS[args.command](args)))


if __name__ == "__main__":
    main()
