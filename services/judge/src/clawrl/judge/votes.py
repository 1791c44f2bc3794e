"""PRM votes as pure functions: read a vote's verdict from its last `\\boxed{}` and count the
votes by majority."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

# Innermost braces only: `\boxed{1}`, `\boxed{ -1 }`; nested braces are not a verdict.
BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
VERDICTS = {"1": 1, "+1": 1, "-1": -1, "0": 0}


def parse_boxed(text: str, allowed: frozenset[int] = frozenset({1, -1, 0})) -> int | None:
    """The verdict of the LAST `\\boxed{...}` in `text` when it is one of `allowed`; None when
    there is no boxed answer or the last one is not a valid verdict (an earlier valid one does
    not count: the model's final answer is its last)."""
    found = BOXED.findall(text or "")
    if not found:
        return None
    value = VERDICTS.get(found[-1].strip().replace(" ", ""))
    return value if value in allowed else None


def majority(votes: Sequence[int | None]) -> int:
    """The most common valid vote (None = unparsable or failed, dropped); 0 on a tie for the
    top count or when no vote is valid."""
    counts = Counter(v for v in votes if v is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def agreement(votes: Sequence[int | None], result: int) -> float:
    """Share of the valid votes that agree with `result` (0.0 when none is valid)."""
    valid = [v for v in votes if v is not None]
    return sum(v == result for v in valid) / len(valid) if valid else 0.0


def wire_votes(votes: Sequence[int | None]) -> list[int]:
    """Votes as Sample.votes carries them: +1, -1, 0 (0 also for unparsable/failed)."""
    return [v or 0 for v in votes]
