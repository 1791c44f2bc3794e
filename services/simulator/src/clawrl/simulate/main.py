"""`clawrl simulate`: a scripted user asks arithmetic word problems through the gateway (official
`openai` client), answers "Correct, thanks: the answer is X" or "No, that's wrong, the answer is
X", and reports accuracy and the judge's reward per policy version (CSV, PNG, table).

The policy version of a reply is read from its `system_fingerprint` (`clawrl-policy-vN`); the
rewards come from the samples stream (the judge's Sample.reward of this run's sessions, by the
weight version that produced each response). Ctrl-C stops starting sessions and reports.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
import uuid
from pathlib import Path

import openai
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import Sample
from clawrl.common.records import RecordError, decode_entry
from clawrl.simulate.report import per_version, plot, table, write_csv
from clawrl.simulate.simulation import Simulation, SimulationConfig

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clawrl", description="clawrl tools")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help=__doc__.split("\n")[0].split(": ", 1)[1])
    sim.add_argument("--base-url", default="http://localhost:30000/v1", help="gateway API")
    sim.add_argument("--api-key", default="local", help="gateway API key")
    sim.add_argument("--model", help="model name (default: the gateway's first /v1/models)")
    sim.add_argument("--sessions", type=int, default=20, help="sessions in all (0: no limit)")
    sim.add_argument("--turns", type=int, default=3, help="questions per session")
    sim.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    sim.add_argument(
        "--until-version",
        type=int,
        help="start no new session once a reply comes from this version",
    )
    sim.add_argument("--max-tokens", type=int, default=48, help="max_tokens of an answer")
    sim.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    sim.add_argument("--seed", type=int, default=0, help="seed of the problems")
    sim.add_argument(
        "--redis-url",
        default="redis://localhost:6390/0",
        help="Redis of the stack, to read the judge's rewards ('' to skip)",
    )
    sim.add_argument("--samples-stream", default="clawrl:samples", help="samples stream")
    sim.add_argument("--settle-s", type=float, default=10.0, help="wait for the judge at the end")
    sim.add_argument("--out-dir", type=Path, default=Path("run/simulate"), help="CSV + PNG here")
    return parser.parse_args(argv)


async def judged_rewards(
    redis_url: str, stream: str, prefix: str, expected: int, settle_s: float
) -> list[tuple[int, float]]:
    """(policy version, reward) of the judged samples of this run's sessions; waits up to
    settle_s for the judge to catch up with `expected` samples. Masked samples carry no reward
    and are left out."""
    redis = Redis.from_url(redis_url)
    deadline = time.monotonic() + settle_s
    try:
        while True:
            samples = []
            for _, fields in await redis.xrange(stream):
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


async def simulate(args: argparse.Namespace) -> int:
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    model = args.model or (await client.models.list()).data[0].id
    run_id = uuid.uuid4().hex[:6]
    config = SimulationConfig(
        sessions=args.sessions,
        turns=args.turns,
        concurrency=args.concurrency,
        until_version=args.until_version,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        run_id=run_id,
    )
    simulation = Simulation(client, model, config)
    loop = asyncio.get_running_loop()
    # Ctrl-C stops starting sessions and still reports.
    loop.add_signal_handler(signal.SIGINT, simulation.stop.set)
    print(f"simulating against {args.base_url} ({model}), run {run_id}", flush=True)
    progress = await simulation.run()
    rewards = []
    if args.redis_url:
        rewards = await judged_rewards(
            args.redis_url, args.samples_stream, f"sim-{run_id}-", len(progress.outcomes),
            args.settle_s,
        )  # fmt: skip
    stats = per_version(progress.outcomes, rewards)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(stats, args.out_dir / f"simulate-{run_id}.csv")
    minutes = (time.monotonic() - progress.started) / 60
    turns = len(progress.outcomes)
    title = f"clawrl simulate: {model}, {turns} turns in {minutes:.1f} min"
    plot(stats, args.out_dir / f"simulate-{run_id}.png", title)
    print(f"\n{table(stats)}\n\n{turns} turns, {progress.failures} failed requests, "
          f"{minutes:.1f} min; wrote {args.out_dir}/simulate-{run_id}.csv and .png")  # fmt: skip
    return 1 if progress.failures and not progress.outcomes else 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    sys.exit(asyncio.run(simulate(args)))


if __name__ == "__main__":
    main()
