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
from dataclasses import dataclass, replace
from pathlib import Path

import openai

from clawrl.common.proto.records_pb2 import Sample
from clawrl.common.records import RecordError, decode_entry
from clawrl.common.redis_client import connect
from clawrl.common.settings import RedisSettings
from clawrl.common.tenants import key_tenant
from clawrl.environments import agent_eval, runner
from clawrl.judge import evaluation as judge_eval
from clawrl.simulate.evaluation import (
    EvalError,
    HeldOutScore,
    adapter_version,
    complete,
    exchanges_of,
    held_out_answers,
    scores,
)
from clawrl.simulate.fluency import FluencyError, base_fluency
from clawrl.simulate.preference import LINES, PARAGRAPH, Preference
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


TASTES = {taste.name: taste for taste in (PARAGRAPH, LINES)}


def comma_list(value: str) -> list[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://localhost:30000/v1", help="OpenAI API")
    parser.add_argument("--api-key", default="local", help="API key")
    parser.add_argument("--model", help="model name (default: the endpoint's first /v1/models)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"max_tokens of a reply (default {MAX_TOKENS}; terminal track {runner.MAX_TOKENS})",
    )
    parser.add_argument(
        "--eval-concurrency", type=int, default=4, help="held-out questions asked at once"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="clawrl", description="clawrl tools")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("simulate", help="a scripted user drives the gateway")
    add_client_args(sim)
    add_user_args(sim)
    add_session_args(sim)
    add_stack_args(sim)
    ev = commands.add_parser(
        "eval", help="held-out score of a served version against the user's preference"
    )
    add_client_args(ev)
    add_eval_args(ev)
    ev.add_argument(
        "--track",
        choices=("chat", "terminal"),
        default="chat",
        help="chat: the held-out questions against the user's preference; terminal: the "
        "held-out terminal tasks in sandboxes (see the terminal flags below)",
    )
    agent_eval.add_arguments(ev.add_argument_group("terminal track"))
    agent = commands.add_parser("agent", help="agents that act: terminal tasks in sandboxes")
    agent_commands = agent.add_subparsers(dest="agent_command", required=True)
    run = agent_commands.add_parser(
        "run", help="play tasks of a task set as sessions through the gateway"
    )
    runner.add_arguments(run)
    judge_eval.add_arguments(commands.add_parser(
        "judge-eval", help="measure a judge (PRM accuracy, parse rate, hint yield, latency) on "
        "a labelled set of turns",
    ))  # fmt: skip
    args = parser.parse_args(argv)
    terminal = args.command == "agent" or getattr(args, "track", "chat") == "terminal"
    if args.command in ("simulate", "eval") and args.max_tokens is None:
        args.max_tokens = runner.MAX_TOKENS if terminal else MAX_TOKENS
    if terminal:
        runner.check_args(run if args.command == "agent" else ev, args)
    if args.command == "simulate":
        if args.held_out_every < 1:
            parser.error("--held-out-every must be at least 1")
        check_tenants(parser, args)
    return args


def add_user_args(parser: argparse.ArgumentParser) -> None:
    """simulate: who the simulated users are (scenario, tenants, wording)."""
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="preference",
        help="preference: open questions, the user wants one paragraph (judge reward "
        "clawrl.judge.reward_examples:stated_preference); lines: the same questions, the user "
        "wants points on separate lines (same reward); arithmetic: word problems "
        "(arithmetic_confirmed)",
    )
    parser.add_argument(
        "--tenants",
        type=int,
        default=1,
        help="simulated users, each a tenant of its own (its API key from --tenant-keys, its "
        "scenario from --tenant-scenarios); with the stack in per-tenant mode each learns its "
        "own adapter, and each user's held-out score is also taken under the next user's "
        "adapter",
    )
    parser.add_argument(
        "--tenant-keys",
        type=comma_list,
        default=["tenant-a", "tenant-b"],
        help="the tenants' API keys, comma-separated (the gateway's [serving] api_keys)",
    )
    parser.add_argument(
        "--tenant-scenarios",
        type=comma_list,
        default=["preference", "lines"],
        help="the tenants' scenarios, comma-separated (preference: one paragraph; lines: the "
        "opposite taste, points on separate lines)",
    )
    parser.add_argument(
        "--remarks",
        choices=("fixed", "varied"),
        default="fixed",
        help="the user's wording: fixed (one remark per verdict, opening with Thanks or Please: "
        "the judge reward stated_preference reads it) or varied (at least 8 per verdict, drawn "
        "by --seed; terse ones, questions: the judge reward remark_sentiment reads it)",
    )


def add_session_args(parser: argparse.ArgumentParser) -> None:
    """simulate: how many sessions, how they sample, when the held-out score is taken."""
    parser.add_argument("--sessions", type=int, default=20, help="sessions in all (0: no limit)")
    parser.add_argument("--turns", type=int, default=3, help="questions per session")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    parser.add_argument(
        "--until-version",
        type=int,
        help="start no new session once a reply comes from this version",
    )
    parser.add_argument(
        "--temperature", type=float, default=TEMPERATURE, help="sampling temperature"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the questions")
    parser.add_argument(
        "--held-out",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="score the held-out questions for each new version it sees (default: on with the "
        "preference scenario)",
    )
    parser.add_argument(
        "--held-out-every",
        type=int,
        default=1,
        help="score a version only once it is this many versions past the last one scored "
        "(the final version is always scored): each score asks 32 questions of the engine",
    )


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    """simulate: where the stack's Redis and engine are, and where the report goes."""
    parser.add_argument(
        "--redis-url",
        default="redis://localhost:6390/0",
        help="Redis of the stack, to read the judge's rewards ('' to skip)",
    )
    parser.add_argument(
        "--engine-url",
        help="the policy engine (SGLang API): held-out evaluations ask it, pinned to each "
        "version's LoRA adapter policy-vN, so no sync can split one, and score the replies' "
        "mean NLL per token under its base weights (LoRA runs only)",
    )
    parser.add_argument("--samples-stream", default="clawrl:samples", help="samples stream")
    parser.add_argument(
        "--stream-shards", type=int, default=1, help="the stack's [redis] stream_shards"
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the stack's Redis is a cluster ([redis] cluster)",
    )
    parser.add_argument(
        "--settle-s", type=float, default=10.0, help="wait for the judge at the end"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("run/simulate"), help="CSV + PNG here")


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    """eval: which version to score, and against whose taste."""
    parser.add_argument(
        "--lora",
        type=adapter_name,
        help="against an engine: the adapter to score (policy-vN or tenant-<id>-vN, sent as "
        "lora_path); unset: what the endpoint serves (through the gateway: the current version "
        "of the API key's tenant, as side turns)",
    )
    parser.add_argument(
        "--engine-url",
        help="the policy engine (SGLang API): also score the replies' mean NLL per token under "
        "its base weights (no adapter), so a collapse cannot pass for learning (LoRA runs)",
    )
    parser.add_argument(
        "--taste",
        choices=sorted(TASTES),
        default="paragraph",
        help="whose verdict scores the replies: the paragraph user (--scenario preference) or "
        "the lines user (--scenario lines)",
    )


def check_tenants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tenants N needs N distinct keys and N scenarios, each with a held-out taste."""
    if args.tenants < 1:
        parser.error("--tenants must be at least 1")
    if args.tenants == 1:
        return
    keys, names = args.tenant_keys, args.tenant_scenarios
    if len(set(keys[: args.tenants])) < args.tenants:
        parser.error(f"--tenants {args.tenants} needs as many distinct --tenant-keys: {keys}")
    if len(names) < args.tenants:
        parser.error(f"--tenants {args.tenants} needs as many --tenant-scenarios: {names}")
    for name in names[: args.tenants]:
        if name not in SCENARIOS or SCENARIOS[name].taste is None:
            tasteful = sorted(n for n, s in SCENARIOS.items() if s.taste is not None)
            parser.error(f"--tenant-scenarios: {name!r} is not one of {tasteful}")


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

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        model: str,
        args: argparse.Namespace,
        taste: Preference = PARAGRAPH,
        adapter: str = "policy",
        label: str = "",
    ) -> None:
        self.client = client
        self.model = model
        self.args = args
        self.taste = taste  # whose verdict scores the replies
        self.adapter = adapter  # the adapters' prefix on the engine: policy, or tenant-<id>
        self.label = label  # names the evaluation in its lines
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
            client, lora = self.engine, (f"{self.adapter}-v{version}" if version else None)
        try:
            answers = await held_out_answers(
                client, self.model, max_tokens=self.args.max_tokens, lora=lora,
                concurrency=self.args.eval_concurrency,
            )  # fmt: skip
        except EvalError as exc:
            self.failures += 1
            log.warning("held-out evaluation failed: %s", exc)
            return False
        for score in complete(scores(answers, self.taste.judge)):
            score = await self.with_fluency(score, answers)
            self.found[score.version] = score
            fluency = "" if score.base_nll is None else f", base NLL {score.base_nll:.3f}/token"
            print(f"{self.label}held-out score of v{score.version}: {score.score:.3f} "
                  f"({score.summary()}){fluency}", flush=True)  # fmt: skip
        return True

    async def with_fluency(
        self, score: HeldOutScore, answers: list[tuple[int, str]]
    ) -> HeldOutScore:
        """The score with its replies' base-model NLL, when an engine is given; a failure is
        counted and logged, and the score kept without it."""
        if self.engine is None:
            return score
        try:
            found = await base_fluency(
                self.args.engine_url, self.model, exchanges_of(answers, score.version),
                concurrency=self.args.eval_concurrency,
            )  # fmt: skip
        except FluencyError as exc:
            self.failures += 1
            log.warning("base NLL of v%d failed: %s", score.version, exc)
            return score
        return replace(score, base_nll=found.mean_nll)

    def behind(self, progress: Progress, every: int = 1) -> bool:
        """The simulation has seen a version `every` or more newer than every one scored."""
        return progress.newest_version >= max(self.found, default=-every) + every

    async def follow(self, progress: Progress, done: asyncio.Event) -> None:
        while not done.is_set():
            # After a failure, a pause: the gateway may be down or restarting.
            every = getattr(self.args, "held_out_every", 1)
            ok = not self.behind(progress, every) or await self.once(progress.newest_version)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=1.0 if ok else 5.0)
        if self.behind(progress):
            await self.once(progress.newest_version)


async def first_model(client: openai.AsyncOpenAI, model: str | None) -> str:
    return model or (await client.models.list()).data[0].id


@dataclass
class User:
    """One simulated user: a tenant of its own (its API key) with `clawrl simulate --tenants`."""

    name: str  # "" alone; "a", "b"... as tenants
    scenario: str
    client: openai.AsyncOpenAI
    simulation: Simulation
    held_out: Evaluator  # its taste under the adapter it is served
    cross: Evaluator | None = None  # its taste under the next tenant's adapter


def tenant_adapter_prefix(key: str) -> str:
    """The engine's name of a tenant's adapters, less `-vN`: the gateway's tenant of the key."""
    return f"tenant-{key_tenant(key)}"


def make_users(args: argparse.Namespace, model: str, run_id: str) -> list[User]:
    """One user, or one per tenant (its key, its scenario, the next tenant's adapter crossed)."""
    tenants = args.tenants
    keys = args.tenant_keys[:tenants] if tenants > 1 else [args.api_key]
    names = args.tenant_scenarios[:tenants] if tenants > 1 else [args.scenario]
    users = []
    for index, (key, name) in enumerate(zip(keys, names, strict=True)):
        letter = "abcdefgh"[index] if tenants > 1 else ""
        scenario = SCENARIOS[name]
        client = openai.AsyncOpenAI(base_url=args.base_url, api_key=key, max_retries=2)
        config = SimulationConfig(
            sessions=args.sessions,
            turns=args.turns,
            concurrency=args.concurrency,
            until_version=args.until_version,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed + 7919 * index,  # each user its own questions
            run_id=f"{run_id}{letter}",
            scenario=scenario,
            label=f"tenant {letter} ({name})" if letter else "",
            remarks=args.remarks,
        )
        taste = scenario.taste or PARAGRAPH
        prefix = tenant_adapter_prefix(key) if letter else "policy"
        label = f"tenant {letter} ({name}): " if letter else ""
        own = Evaluator(client, model, args, taste, prefix, label)
        users.append(User(letter, name, client, Simulation(client, model, config), own))
    for index, user in enumerate(users if tenants > 1 else []):
        other = users[(index + 1) % len(users)]
        taste = user.held_out.taste
        label = f"tenant {user.name} ({user.scenario}) under tenant {other.name}'s adapter: "
        user.cross = Evaluator(other.client, model, args, taste, other.held_out.adapter, label)
    return users


async def simulate(args: argparse.Namespace) -> int:
    key = args.tenant_keys[0] if args.tenants > 1 else args.api_key
    first = openai.AsyncOpenAI(base_url=args.base_url, api_key=key, max_retries=2)
    model = await first_model(first, args.model)
    run_id = uuid.uuid4().hex[:6]
    users = make_users(args, model, run_id)
    loop = asyncio.get_running_loop()
    # Ctrl-C stops starting sessions and still reports.
    loop.add_signal_handler(signal.SIGINT, lambda: [u.simulation.stop.set() for u in users])
    who = ", ".join(f"tenant {u.name} ({u.scenario})" for u in users) if args.tenants > 1 else (
        args.scenario)  # fmt: skip
    print(f"simulating ({who}) against {args.base_url} ({model}), run {run_id}", flush=True)
    held_out = args.held_out
    if held_out is None:
        held_out = all(SCENARIOS[u.scenario].taste is not None for u in users)
    finished = asyncio.Event()
    following = []
    if held_out:
        for index, user in enumerate(users):
            following.append(user.held_out.follow(user.simulation.progress, finished))
            if user.cross is not None:
                other = users[(index + 1) % len(users)]
                following.append(user.cross.follow(other.simulation.progress, finished))
    followers = [asyncio.create_task(f) for f in following]
    runs = await asyncio.gather(*(u.simulation.run() for u in users))
    finished.set()
    await asyncio.gather(*followers)
    code = 0
    for user, progress in zip(users, runs, strict=True):
        code = max(code, await report(args, user, progress, run_id))
    return code


async def report(args: argparse.Namespace, user: User, progress: Progress, run_id: str) -> int:
    """The judged rewards of the user's sessions, its per-version table, CSV and PNG."""
    rewards = []
    if args.redis_url:
        store = RedisSettings(
            url=args.redis_url, cluster=args.redis_cluster, stream_shards=args.stream_shards
        )
        rewards = await judged_rewards(
            store, args.samples_stream, f"sim-{user.simulation.config.run_id}-",
            len(progress.outcomes), args.settle_s,
        )  # fmt: skip
    cross = list(user.cross.found.values()) if user.cross else []
    stats = per_version(progress.outcomes, rewards, list(user.held_out.found.values()), cross)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    check = user.simulation.config.scenario.check_name
    name = f"simulate-{run_id}" + (f"-{user.name}" if user.name else "")
    write_csv(stats, args.out_dir / f"{name}.csv", check)
    minutes = (time.monotonic() - progress.started) / 60
    turns = len(progress.outcomes)
    who = f"tenant {user.name}, {user.scenario}" if user.name else user.scenario
    title = f"clawrl simulate ({who}): {user.simulation.model}, {turns} turns in {minutes:.1f} min"
    plot(stats, args.out_dir / f"{name}.png", title, check)
    failures = user.held_out.failures + (user.cross.failures if user.cross else 0)
    print(f"\n{who}:\n{table(stats, check)}\n\n{turns} turns, {progress.failures} failed "
          f"requests, {failures} failed evaluations, {minutes:.1f} min; wrote "
          f"{args.out_dir}/{name}.csv and .png", flush=True)  # fmt: skip
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
    found = scores(answers, TASTES[args.taste].judge)
    for score in found:
        print(f"v{score.version}: held-out score {score.score:.3f} ({score.summary()})")
        if args.engine_url:
            try:
                fluency = await base_fluency(
                    args.engine_url, model, exchanges_of(answers, score.version),
                    concurrency=args.eval_concurrency,
                )  # fmt: skip
            except FluencyError as exc:
                print(f"clawrl eval: base NLL of v{score.version}: {exc}", file=sys.stderr)
                return 1
            print(f"v{score.version}: base NLL per token {fluency.mean_nll:.4f} "
                  f"({fluency.tokens} reply tokens)")  # fmt: skip
    # A sync during the evaluation splits it: no version was scored on every question.
    return 0 if complete(found) else 2


async def evaluate_track(args: argparse.Namespace) -> int:
    return await (agent_eval.evaluate(args) if args.track == "terminal" else evaluate(args))


COMMANDS = {
    "simulate": simulate,
    "eval": evaluate_track,
    "judge-eval": judge_eval.run,
    "agent": runner.run,
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    sys.exit(asyncio.run(COMMANDS[args.command](args)))


if __name__ == "__main__":
    main()
