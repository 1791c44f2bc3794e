"""Hindsight hints as pure functions: read a hint vote, gather the accepted hint candidates, pick
one by a selection rule (by length, or by how well each hinted teacher's top-K agrees with the
student's, OpenClaw-RL's multi-candidate selection), and append it to the prompt the response was
generated from."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from clawrl.judge.votes import parse_boxed

HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)
HINT_HEADER = "[user's hint / instruction]"


@dataclass(frozen=True)
class HintVote:
    """One hint vote: its verdict (+1 = the next state holds a useful hint, -1 = it does not,
    None = unparsable/failed) and the hint text it gave ("" when none)."""

    score: int | None
    hint: str


def parse_hint_vote(text: str) -> HintVote:
    """Verdict from the last `\\boxed{1|-1}`, hint from the last `[HINT_START]...[HINT_END]`."""
    score = parse_boxed(text, allowed=frozenset({1, -1}))
    hints = HINT.findall(text or "")
    return HintVote(score=score, hint=hints[-1].strip() if hints else "")


def select_hint(votes: Sequence[HintVote], min_chars: int = 10) -> str:
    """The longest hint of a positive vote that is longer than `min_chars`; "" when none
    qualifies (the first of equally long ones wins)."""
    hints = accepted_hints(votes, min_chars)
    return hints[by_length(hints, "longest")] if hints else ""


Selection = Literal["sequence_optimal", "token_optimal", "shortest", "longest"]
# Selections that need every candidate's teacher top-K and the student's (the rest need none).
BY_OVERLAP = frozenset({"sequence_optimal", "token_optimal"})


def accepted_hints(votes: Sequence[HintVote], min_chars: int = 10) -> list[str]:
    """The hints of positive votes longer than `min_chars`, in vote order, without repeats."""
    return candidates([v.hint for v in votes if v.score == 1], min_chars)


def candidates(hints: Sequence[str], min_chars: int = 10, limit: int | None = None) -> list[str]:
    """`hints` stripped, those of at most `min_chars` characters dropped, repeats dropped (case
    and spacing ignored: "Be brief." and "be  brief." are one hint), the first `limit` kept."""
    seen: set[str] = set()
    out: list[str] = []
    for hint in hints:
        hint = hint.strip()
        key = " ".join(hint.casefold().split())
        if len(hint) <= min_chars or key in seen:
            continue
        seen.add(key)
        out.append(hint)
    return out[:limit] if limit is not None else out


def by_length(hints: Sequence[str], select: Selection) -> int:
    """Index of the shortest or the longest hint (the first of equally long ones)."""
    lengths = [len(h) for h in hints]
    target = min(lengths) if select == "shortest" else max(lengths)
    return lengths.index(target)


def topk_overlap(student_ids: Sequence[int], teacher_ids: Sequence[int], k: int) -> list[int]:
    """student_ids, teacher_ids: [T * k] row-major top-K ids -> [T]: how many of the student's
    top-K tokens at each position are also in the teacher's (O[t] = |S_q(t) & S_p(t)|)."""
    if len(student_ids) != len(teacher_ids) or k <= 0 or len(student_ids) % k:
        raise ValueError(f"top-{k} rows of {len(student_ids)} and {len(teacher_ids)} ids differ")
    return [
        len(set(student_ids[i : i + k]) & set(teacher_ids[i : i + k]))
        for i in range(0, len(student_ids), k)
    ]


def sequence_optimal(overlaps: Sequence[Sequence[int]]) -> int:
    """overlaps: [N][T] -> the candidate whose teacher agrees with the student on the most
    top-K tokens over the whole response (k* = argmax_k sum_t O[k, t]; first on ties)."""
    totals = [sum(row) for row in overlaps]
    return totals.index(max(totals))


def token_optimal(overlaps: Sequence[Sequence[int]]) -> list[int]:
    """overlaps: [N][T] -> [T]: at each position the candidate with the largest overlap
    (k*(t) = argmax_k O[k, t]; the first candidate on ties)."""
    n = len(overlaps)
    return [max(range(n), key=lambda k, t=t: (overlaps[k][t], -k)) for t in range(len(overlaps[0]))]


def inject_hint(messages: Sequence[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of `messages` with the hint appended to the last user message
    (`"\\n\\n[user's hint / instruction]\\n{hint}"`); a new user message carries it when there
    is none. Text-part lists get one more text part; the input is not modified."""
    block = f"\n\n{HINT_HEADER}\n{hint}"
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [*content, {"type": "text", "text": block}]
        else:
            message["content"] = (content or "") + block
        return out
    out.append({"role": "user", "content": block.lstrip("\n")})
    return out
