"""Hindsight hints as pure functions: read a hint vote, pick the best hint, and append it to the
prompt the response was generated from."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    best = ""
    for vote in votes:
        if vote.score == 1 and len(vote.hint) > min_chars and len(vote.hint) > len(best):
            best = vote.hint
    return best


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
