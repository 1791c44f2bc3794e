"""`clawrl judge-eval`: the judge measured before anyone trusts it. Every case of a labelled set
(shipped here as data/judge_eval.jsonl: a conversation, the assistant's reply, what came next,
the gold verdict and whether a hint should come out) goes through the judge core's own PRM and
hint code (`Judge._judged_score`, `Judge._hints`: the prompts, votes, parsers and selection that
judge live turns), and the report gives PRM accuracy, the confusion matrix, parse rate, vote
agreement, hint yield and latency.

Judges: the local SGLang-API engine (`--judge engine`, PRM by votes or by yes/no log-probs), any
OpenAI-compatible API (`--judge openai`), and two scripted ones that check the harness itself:
`scripted:perfect` answers each case from its gold label in the judge's real output format (so
the real parsers run), `scripted:random` flips a seeded coin for every vote."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import orjson

from clawrl.common.chat import ChatRenderer
from clawrl.common.models import context_length, resolve_model_dir
from clawrl.common.records import Sample, Turn
from clawrl.common.settings import ModelSettings
from clawrl.common.sglang_client import EngineUnavailable, SGLangClient
from clawrl.judge.backends import OpenAIVotes, Prepared, SGLangVotes, VoteBackend
from clawrl.judge.core import Judge, Judgement
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.prompts import HINT_SYSTEM, Budget, judge_input, prm_messages
from clawrl.judge.turns import TurnView
from clawrl.judge.verdicts import LogprobPRM, tokenizer_yes_no_ids
from clawrl.judge.votes import agreement

KINDS = ("feedback", "tool_ok", "tool_error", "new_topic", "unclear")
VERDICTS = (1, 0, -1)
LABELS = {1: "+1", 0: "0", -1: "-1"}
NEXT_SECTION = "## WHAT CAME NEXT"
RANDOM_HINT = "Do what the user asks for in their next message."


@dataclass(frozen=True)
class Case:
    """One labelled turn: `messages` before the reply, the assistant's `reply`, the
    `next_state` messages, the gold `verdict` and whether a hint should come out."""

    id: str
    kind: str
    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    next_state: list[dict[str, Any]]
    verdict: int
    hint: bool
    hint_gist: str = ""


def load_cases(text: str | None = None) -> list[Case]:
    """The cases of a JSONL text (default: the shipped set); ValueError naming the line of
    the first bad case."""
    if text is None:
        text = resources.files("clawrl.judge").joinpath("data/judge_eval.jsonl").read_text()
    cases, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = _case(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"judge-eval case on line {number}: {exc}") from exc
        if case.id in seen:
            raise ValueError(f"judge-eval case on line {number}: duplicate id {case.id}")
        seen.add(case.id)
        cases.append(case)
    if not cases:
        raise ValueError("the judge-eval set has no cases")
    return cases


def _case(raw: dict[str, Any]) -> Case:
    case = Case(
        id=str(raw["id"]),
        kind=raw["kind"],
        messages=list(raw["messages"]),
        reply=dict(raw["reply"]),
        next_state=list(raw["next_state"]),
        verdict=raw["verdict"],
        hint=raw["hint"],
        hint_gist=raw.get("hint_gist", ""),
    )
    if case.kind not in KINDS:
        raise ValueError(f"kind {case.kind!r} is not one of {KINDS}")
    if case.verdict not in VERDICTS or not isinstance(case.hint, bool):
        raise ValueError(f"verdict must be 1, 0 or -1 and hint true or false: {raw}")
    if case.reply.get("role") != "assistant" or not case.next_state:
        raise ValueError("reply must be an assistant message and next_state non-empty")
    if case.hint and len(case.hint_gist) <= 10:
        raise ValueError("a case that should give a hint needs its hint_gist")
    return case


def balanced_order(cases: Sequence[Case]) -> list[Case]:
    """The cases interleaved by gold verdict (+1, 0, -1, +1, ...), so that `--limit` keeps a
    balanced subset."""
    groups = [[c for c in cases if c.verdict == v] for v in VERDICTS]
    out: list[Case] = []
    for i in range(max(len(g) for g in groups)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def case_view(case: Case) -> TurnView:
    """The case as a Turn the judge reads (no token ids: the PRM and hints need none)."""
    content = case.reply.get("content")
    turn = Turn(
        turn_id=f"judge-eval-{case.id}",
        session_id="judge-eval",
        messages_json=orjson.dumps(case.messages).decode(),
        response_message_json=orjson.dumps(case.reply).decode(),
        response_text=content if isinstance(content, str) else "",
        next_state_messages_json=[orjson.dumps(m).decode() for m in case.next_state],
    )
    return TurnView(turn)


@dataclass(frozen=True)
class CaseResult:
    case: Case
    predicted: int
    prm_votes: list[int | None]  # each vote's verdict (None: unparsable or failed)
    hint: str  # the selected hint, "" when none
    hint_votes: list[int | None]
    prm_s: float
    hint_s: float
    yes_share: float | None = None  # prm=logprob: p_yes / (p_yes + p_no)


async def run_case(judge: Judge, case: Case) -> CaseResult:
    """The judge's real PRM and hint paths on one case."""
    view = case_view(case)
    j = Judgement(sample=Sample(), audit={})
    started = time.perf_counter()
    score = await judge._judged_score(view, j)
    prm_s = time.perf_counter() - started
    hints = await judge._hints(view, j)  # no feedback, no hint_fn: the judge's hint votes
    hint = hints[0] if hints else ""
    hint_s = time.perf_counter() - started - prm_s
    yes_share = None
    if "prm_logprob" in j.audit:
        prm_votes = [j.audit["prm_logprob"]["score"]]
        yes_share = j.audit["prm_logprob"]["yes_share"]
    else:
        prm_votes = [v["score"] for v in j.audit["votes"]]
    hint_votes = [v["score"] for v in j.audit.get("hint_votes", [])]
    return CaseResult(case, int(score or 0), prm_votes, hint, hint_votes, prm_s, hint_s, yes_share)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def latency(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "p50": percentile(values, 0.5),
        "p95": percentile(values, 0.95),
    }


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """The chance that a random positive scores above a random negative (ties count half):
    how well a score separates them whatever the threshold; None without both."""
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def _share(hits: int, total: int) -> float | None:
    return hits / total if total else None


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    """The figures of a run (pure): accuracy (on the cases whose gold verdict is +1 or -1: what
    a PRM is for; a coin flip scores 0.5), accuracy_all (neutral cases too), by kind, the
    confusion matrix gold x predicted, parse rates, vote agreement, hint yield and false
    hints, latency per case."""
    correct = [r.predicted == r.case.verdict for r in results]
    polar = [ok for ok, r in zip(correct, results, strict=True) if r.case.verdict != 0]
    confusion = {LABELS[g]: {LABELS[p]: 0 for p in VERDICTS} for g in VERDICTS}
    for r in results:
        confusion[LABELS[r.case.verdict]][LABELS[r.predicted]] += 1
    votes = [v for r in results for v in r.prm_votes]
    hint_votes = [v for r in results for v in r.hint_votes]
    multi = [r for r in results if len(r.prm_votes) > 1 and any(v is not None for v in r.prm_votes)]
    should = [r for r in results if r.case.hint]
    should_not = [r for r in results if not r.case.hint]
    shares = {
        v: [r.yes_share for r in results if r.case.verdict == v and r.yes_share is not None]
        for v in (1, -1)
    }
    by_kind = {}
    for kind in KINDS:
        hits = [ok for ok, r in zip(correct, results, strict=True) if r.case.kind == kind]
        if hits:
            by_kind[kind] = {"cases": len(hits), "accuracy": sum(hits) / len(hits)}
    return {
        "cases": len(results),
        "accuracy": _share(sum(polar), len(polar)),
        "accuracy_all": _share(sum(correct), len(results)),
        "confusion": confusion,
        "by_kind": by_kind,
        # prm=logprob: how well the yes share tells the +1 cases from the -1 ones (0.5: chance).
        "yes_share_auc": auc(shares[1], shares[-1]),
        "parse_rate": _share(sum(v is not None for v in votes), len(votes)),
        "votes": len(votes),
        # A verdict made of one vote (prm=logprob, or m=1) agrees with itself: not reported.
        "vote_agreement": statistics.fmean(agreement(r.prm_votes, r.predicted) for r in multi)
        if multi
        else None,
        "hint_yield": _share(sum(bool(r.hint) for r in should), len(should)),
        "false_hint_rate": _share(sum(bool(r.hint) for r in should_not), len(should_not)),
        "hint_cases": len(should),
        "hint_parse_rate": _share(sum(v is not None for v in hint_votes), len(hint_votes)),
        "latency_s": latency([r.prm_s + r.hint_s for r in results]),
        "prm_latency_s": latency([r.prm_s for r in results]),
        "hint_latency_s": latency([r.hint_s for r in results]),
        "results": [
            {
                "id": r.case.id,
                "gold": r.case.verdict,
                "predicted": r.predicted,
                "votes": r.prm_votes,
                "yes_share": r.yes_share,
                "hint": r.hint,
            }
            for r in results
        ],
    }


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def report(summary: dict[str, Any], title: str) -> str:
    """The human-readable report of `summarize`'s figures."""
    s = summary
    lines = [
        title,
        f"PRM accuracy {_fmt(s['accuracy'])} on the +1/-1 cases "
        f"({_fmt(s['accuracy_all'])} over all {s['cases']} cases, neutral ones too)",
        "",
        "confusion (rows: gold, columns: predicted)",
        "gold  " + "".join(f"{LABELS[p]:>5}" for p in VERDICTS),
    ]
    for gold, row in s["confusion"].items():
        lines.append(f"{gold:>4}  " + "".join(f"{n:>5}" for n in row.values()))
    kinds = ", ".join(
        f"{k} {_fmt(v['accuracy'], 2)} ({v['cases']})" for k, v in s["by_kind"].items()
    )
    lat, prm, hint = s["latency_s"], s["prm_latency_s"], s["hint_latency_s"]
    lines += [
        "",
        f"accuracy by kind: {kinds}",
        f"parse rate {_fmt(s['parse_rate'])} of {s['votes']} PRM votes; vote agreement "
        f"{_fmt(s['vote_agreement'])}",
        f"hint yield {_fmt(s['hint_yield'])} of {s['hint_cases']} cases that should give one; "
        f"false hints {_fmt(s['false_hint_rate'])} of the others; hint parse rate "
        f"{_fmt(s['hint_parse_rate'])}",
        f"latency per case: mean {lat['mean']:.2f} s, p50 {lat['p50']:.2f} s, p95 "
        f"{lat['p95']:.2f} s (PRM mean {prm['mean']:.2f} s, hint mean {hint['mean']:.2f} s)",
    ]
    if s["yes_share_auc"] is not None:
        lines.append(f"yes share AUC on the +1/-1 cases {s['yes_share_auc']:.3f} (0.5: chance)")
    return "\n".join(lines)


class ScriptedJudge:
    """A vote backend that knows the cases: it finds the case a prompt is about (by its
    conversation and reply sections) and answers as a judge model would, in the judge's output
    format: `perfect` from the gold label, `random` a seeded coin flip per vote (good or bad;
    a hint or none)."""

    def __init__(self, cases: Sequence[Case], policy: str, seed: int, budget: Budget) -> None:
        if policy not in ("perfect", "random"):
            raise ValueError(f"unknown scripted judge {policy!r}: perfect or random")
        self.policy = policy
        self.seed = seed
        self.calls: Counter[tuple[str, str]] = Counter()
        self.cases: dict[str, Case] = {}
        for case in cases:
            data = judge_input(case.messages, case.reply, case.next_state, budget)
            key = prm_messages(data)[-1]["content"].split(NEXT_SECTION)[0]
            if key in self.cases:
                raise ValueError(f"cases {self.cases[key].id} and {case.id} read the same")
            self.cases[key] = case

    def prepare(self, messages: list[dict[str, str]]) -> Prepared:
        return Prepared(messages=messages)

    async def vote(self, prompt: Prepared) -> str:
        kind = "hint" if prompt.messages[0]["content"] == HINT_SYSTEM else "prm"
        case = self.cases[prompt.messages[-1]["content"].split(NEXT_SECTION)[0]]
        if self.policy == "perfect":
            good, hint = case.verdict, case.hint_gist if case.hint else ""
        else:
            n = self.calls[(case.id, kind)]
            self.calls[(case.id, kind)] += 1
            # Seeded by the vote itself, so the order cases run in changes nothing.
            heads = random.Random(f"{self.seed}:{case.id}:{kind}:{n}").random() < 0.5
            good, hint = (1 if heads else -1), (RANDOM_HINT if heads else "")
        if kind == "prm":
            return f"Judging by what came next, the verdict is:\n\\boxed{{{good}}}"
        if hint:
            return f"\\boxed{{1}} [HINT_START]{hint}[HINT_END]"
        return "Nothing here says how the reply should have been different. \\boxed{-1}"

    async def aclose(self) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`clawrl judge-eval`'s options (the subcommand is registered by `clawrl`'s parser)."""
    parser.add_argument(
        "--judge",
        default="engine",
        help="engine (the SGLang-API judge engine), openai (any OpenAI-compatible "
        "API), scripted:perfect or scripted:random",
    )
    parser.add_argument("--engine-url", default="http://localhost:30011", help="--judge engine")
    parser.add_argument(
        "--judge-model",
        default="SmolLM2-135M-Instruct",
        help="--judge engine: the engine's model (its tokenizer and chat "
        "template render the prompts)",
    )
    parser.add_argument(
        "--prm",
        choices=("votes", "logprob"),
        default="votes",
        help="PRM by m votes or by the yes/no log-probs (--judge engine)",
    )
    parser.add_argument("--prm-margin", type=float, default=0.2, help="--prm logprob's margin")
    parser.add_argument("--top-logprobs", type=int, default=20, help="--prm logprob's top-k")
    parser.add_argument("--base-url", help="--judge openai: the API's base URL (…/v1)")
    parser.add_argument("--model", help="--judge openai: the model to ask")
    parser.add_argument("--api-key", default="EMPTY", help="--judge openai: the API key")
    parser.add_argument("--votes", type=int, default=3, help="m: votes per PRM and per hint")
    parser.add_argument("--temperature", type=float, default=0.6, help="a vote's temperature")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="longest vote")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="longest judge call")
    parser.add_argument("--limit", type=int, help="judge only this many cases (balanced)")
    parser.add_argument("--seed", type=int, default=0, help="scripted:random's coin")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="cases judged at once (latency is per case under this load)",
    )
    parser.add_argument("--cases", type=Path, help="a JSONL set instead of the shipped one")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class UsageError(ValueError):
    """Options that do not go together."""


def build_judge(
    args: argparse.Namespace, cases: Sequence[Case], engine: SGLangClient | None
) -> tuple[Judge, str]:
    """The Judge core over the chosen backend (`engine`: the client of `--judge engine`, made
    in the event loop) and a title. Loads tokenizers: call it in a thread."""
    budget = Budget()
    logprob = None
    if args.prm == "logprob" and args.judge != "engine":
        raise UsageError("--prm logprob reads an engine's log-probs: use --judge engine")
    if args.votes < 1 or (args.limit is not None and args.limit < 1) or args.concurrency < 1:
        raise UsageError("--votes, --limit and --concurrency must be at least 1")
    backend: VoteBackend
    if args.judge.startswith("scripted:"):
        backend = ScriptedJudge(cases, args.judge.split(":", 1)[1], args.seed, budget)
        title = f"{args.judge} (seed {args.seed})"
    elif args.judge == "openai":
        if not (args.base_url and args.model):
            raise UsageError("--judge openai needs --base-url and --model")
        backend = OpenAIVotes(
            base_url=args.base_url,
            model=args.model,
            api_key=args.api_key,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            timeout_s=args.timeout_s,
        )
        title = f"openai {args.base_url} ({args.model})"
    elif args.judge == "engine":
        assert engine is not None
        model = ModelSettings(path=args.judge_model)
        renderer = ChatRenderer.from_settings(model)
        backend = SGLangVotes(
            engine,
            renderer,
            context_tokens=context_length(model, resolve_model_dir(model)),
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
        )
        if args.prm == "logprob":
            ids = tokenizer_yes_no_ids(renderer.tokenizer)
            logprob = LogprobPRM(engine, ids, top_k=args.top_logprobs, margin=args.prm_margin)
        title = f"engine {args.engine_url} ({args.judge_model})"
    else:
        raise UsageError(f"unknown --judge {args.judge!r}")
    prm = (
        f"logprob, margin {args.prm_margin}" if args.prm == "logprob" else f"votes, m={args.votes}"
    )
    judge = Judge(
        mode="rl",
        metrics=JudgeMetrics(),
        votes=args.votes,
        backend=backend,
        budget=budget,
        logprob_prm=logprob,
    )
    return judge, f"judge-eval: {title}, PRM {prm}, hints m={args.votes}"


async def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Every case (or `--limit` of them) through the judge; the summary (with its title)."""
    text = args.cases.read_text() if args.cases else None
    cases = balanced_order(load_cases(text))[: args.limit]
    engine = None
    if args.judge == "engine":
        engine = SGLangClient(args.engine_url, timeout_s=args.timeout_s)
    try:
        judge, title = await asyncio.to_thread(build_judge, args, cases, engine)
    except BaseException:
        if engine is not None:
            await engine.aclose()
        raise
    gate = asyncio.Semaphore(args.concurrency)

    async def one(case: Case) -> CaseResult:
        async with gate:
            return await run_case(judge, case)

    try:
        results = await asyncio.gather(*(one(c) for c in cases))
    finally:
        assert judge.backend is not None
        await judge.backend.aclose()
        if engine is not None:
            await engine.aclose()
    return {"title": title, "judge": args.judge, "prm": args.prm, **summarize(results)}


async def run(args: argparse.Namespace) -> int:
    """`clawrl judge-eval`: 0 when every case was judged, 1 when the judge was unreachable,
    2 on bad options or a bad case file."""
    try:
        summary = await evaluate(args)
    except (UsageError, ValueError, OSError) as exc:
        print(f"clawrl judge-eval: {exc}", file=sys.stderr)
        return 2
    except EngineUnavailable as exc:
        print(f"clawrl judge-eval: the judge is unavailable: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(report(summary, summary["title"]))
    return 0
