"""The held-out score (`clawrl eval`): the fixed held-out questions, answered greedily by a served
version, scored against the simulated user's preference (the same `verdict` as in sessions).

Through the gateway the questions are side turns (`X-Turn-Type: side`: served, never recorded or
trained) and each reply's version is read from its `system_fingerprint`; against an engine,
`lora` names the adapter (`policy-vN`, sent as SGLang's `lora_path`) and so the version.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import openai

from clawrl.simulate.preference import Verdict, verdict
from clawrl.simulate.questions import held_out_questions

log = logging.getLogger(__name__)

FINGERPRINT = re.compile(r"clawrl-policy-v(\d+)")
# The shared policy's adapters and a tenant's own (`tenant-<id>-vN`, per-tenant mode).
ADAPTER = re.compile(r"(?:policy|tenant-[A-Za-z0-9][A-Za-z0-9_.-]*)-v(\d+)")


@dataclass(frozen=True)
class HeldOutScore:
    version: int
    replies: int
    score: float  # share of the replies that meet the preference
    # How many replies got each complaint (layout, too_short, repetitive): why the rest missed.
    misses: dict[str, int] = field(default_factory=dict, compare=False)
    # The base model's mean NLL per token of these replies (`clawrl eval --engine-url`).
    base_nll: float | None = field(default=None, compare=False)

    def summary(self) -> str:
        met = round(self.score * self.replies)
        why = ", ".join(f"{name} {count}" for name, count in sorted(self.misses.items()))
        return f"{met}/{self.replies}" + (f"; missed: {why}" if why else "")


class EvalError(RuntimeError):
    """A held-out question got no reply."""


def reply_version(fingerprint: str | None) -> int:
    """The policy version named by a gateway reply's system_fingerprint (0: the initial one)."""
    match = FINGERPRINT.fullmatch(fingerprint or "")
    return int(match.group(1)) if match else 0


def adapter_version(lora: str | None) -> int:
    """policy-vN or tenant-<id>-vN -> N; no adapter -> 0 (the base model)."""
    if not lora:
        return 0
    match = ADAPTER.fullmatch(lora)
    if match is None:
        raise ValueError(f"adapter {lora!r} is not named policy-vN or tenant-<id>-vN")
    return int(match.group(1))


def scores(
    answers: list[tuple[int, str]], judge: Callable[[str], Verdict] = verdict
) -> list[HeldOutScore]:
    """(version, reply) pairs -> the score of each version that produced some, by version, as
    the user whose verdict is `judge` takes them (default: the paragraph user)."""
    by_version: dict[int, list[Verdict]] = defaultdict(list)
    for version, reply in answers:
        by_version[version].append(judge(reply))
    found = []
    for version, verdicts in sorted(by_version.items()):
        met = verdicts.count(Verdict.PLEASED)
        misses = Counter(v.value for v in verdicts if v is not Verdict.PLEASED)
        found.append(HeldOutScore(version, len(verdicts), met / len(verdicts), dict(misses)))
    return found


async def held_out_answers(
    client: openai.AsyncOpenAI,
    model: str,
    *,
    max_tokens: int,
    lora: str | None = None,
    concurrency: int = 4,
) -> list[tuple[int, str]]:
    """(version, reply) for every held-out question, greedy; raises EvalError when a question
    gets no reply (a score over fewer questions would not compare with the others)."""
    gate = asyncio.Semaphore(concurrency)
    session = f"eval-{uuid.uuid4().hex[:8]}"
    fixed_version = adapter_version(lora) if lora else None

    async def ask(index: int, question: str) -> tuple[int, str]:
        async with gate:
            try:
                reply = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": question}],
                    max_tokens=max_tokens,
                    temperature=0.0,
                    # Each question its own side session: never recorded, never trained.
                    extra_headers={"X-Session-Id": f"{session}-{index}", "X-Turn-Type": "side"},
                    extra_body={"lora_path": lora} if lora else None,
                )
            except openai.APIError as exc:
                raise EvalError(f"held-out question {index} failed: {exc}") from exc
        version = (
            fixed_version if fixed_version is not None else reply_version(reply.system_fingerprint)
        )
        return version, reply.choices[0].message.content or ""

    questions = held_out_questions()
    return list(await asyncio.gather(*(ask(i, q) for i, q in enumerate(questions))))


def exchanges_of(answers: list[tuple[int, str]], version: int) -> list[tuple[str, str]]:
    """(held-out question, reply) of one version, from `held_out_answers`' (version, reply)
    pairs (in the questions' order)."""
    return [(question, reply) for question, (v, reply) in zip(held_out_questions(), answers,
            strict=True) if v == version]  # fmt: skip


def complete(found: list[HeldOutScore]) -> list[HeldOutScore]:
    """The scores over every held-out question (a sync in the middle of an evaluation splits it
    between two versions; neither part compares with a whole evaluation)."""
    return [s for s in found if s.replies == len(held_out_questions())]
