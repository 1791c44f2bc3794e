"""The simulated user's personal preference and what they say about each reply (pure functions).

The preference: an answer in one paragraph, with no line breaks and no list. SmolLM2-135M meets
it in 47 % of its replies to open questions at v0 (96 tokens, temperature 0.8; README, "The demo
that trends"), so both kinds of reply come up and a policy can learn which one this user wants.
A reply that meets it only by saying next to nothing does not count: fewer than MIN_WORDS
words, or text that repeats itself (a collapsed policy's loop), is a complaint too, so learning
cannot reach the preference by collapsing into short or degenerate replies.

`verdict` is shared by the simulated user (its next message) and by `clawrl eval` (the held-out
score), so the live reward and the held-out score measure the same thing.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MIN_WORDS = 15
# Share of repeated word trigrams above which a reply is a loop, not prose (natural answers of a
# few sentences repeat next to none; "the cat the cat the cat" repeats nearly all).
MAX_REPEATED_TRIGRAMS = 0.25

WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)
# A list item at the start of the reply: "- x", "* x", "• x", "1. x", "1) x".
LIST_START = re.compile(r"^\s*(?:[-*•]\s|\d+[.)]\s)")


class Verdict(enum.Enum):
    PLEASED = "pleased"  # one paragraph, a real answer
    LAYOUT = "layout"  # line breaks or a list
    TOO_SHORT = "too_short"
    REPETITIVE = "repetitive"
    PARAGRAPH = "paragraph"  # one block of text (the complaint of the user who wants lines)


# What the user says about the reply before their next question. The judge's `stated_preference`
# reward reads these words (the next state), never the reply.
REMARKS = {
    Verdict.PLEASED: "Thanks, one short paragraph is just how I like it.",
    Verdict.LAYOUT: "Please, answer in one paragraph next time, no lists or line breaks.",
    Verdict.TOO_SHORT: "Please, that is too short: give me a real answer, in one paragraph.",
    Verdict.REPETITIVE: "Please, you are repeating yourself: answer in one clear paragraph.",
}


def words(text: str) -> list[str]:
    return WORD.findall(text.casefold())


def repeated_trigram_share(tokens: list[str]) -> float:
    """Share of the word trigrams that already occurred earlier in the text (0 for < 3 words)."""
    trigrams = list(zip(tokens, tokens[1:], tokens[2:], strict=False))
    if not trigrams:
        return 0.0
    return 1.0 - len(set(trigrams)) / len(trigrams)


def verdict(reply: str) -> Verdict:
    """How this user takes a reply: the collapse guards first (too short, a loop), then the
    layout (one paragraph: no line break once trimmed, not a list)."""
    tokens = words(reply)
    if len(tokens) < MIN_WORDS:
        return Verdict.TOO_SHORT
    if repeated_trigram_share(tokens) > MAX_REPEATED_TRIGRAMS:
        return Verdict.REPETITIVE
    text = reply.strip()
    if "\n" in text or LIST_START.match(text):
        return Verdict.LAYOUT
    return Verdict.PLEASED


def lines_verdict(reply: str) -> Verdict:
    """The opposite taste (the second tenant of `clawrl simulate --tenants 2`): the same collapse
    guards, then pleased exactly when the paragraph user would complain of the layout (line
    breaks or a list), so the two users pull one model in opposite directions."""
    found = verdict(reply)
    if found is Verdict.LAYOUT:
        return Verdict.PLEASED
    return Verdict.PARAGRAPH if found is Verdict.PLEASED else found


LINES_REMARKS = {
    Verdict.PLEASED: "Thanks, points on separate lines are just how I like it.",
    Verdict.PARAGRAPH: "Please, break the answer into lines or a list next time, not one block.",
    Verdict.TOO_SHORT: "Please, that is too short: give me a real answer, on separate lines.",
    Verdict.REPETITIVE: "Please, you are repeating yourself: answer in clear separate points.",
}


@dataclass(frozen=True)
class Preference:
    """One simulated user's taste: its verdict on a reply and what it says about each verdict."""

    name: str
    judge: Callable[[str], Verdict]
    remarks: Mapping[Verdict, str]

    def satisfies(self, reply: str) -> bool:
        return self.judge(reply) is Verdict.PLEASED

    def next_message(self, reply: str, following: str | None) -> str:
        """The remark on the last reply, then the next question (none at the session's end)."""
        remark = self.remarks[self.judge(reply)]
        return f"{remark} Next: {following}" if following else remark


PARAGRAPH = Preference("paragraph", verdict, REMARKS)
LINES = Preference("lines", lines_verdict, LINES_REMARKS)


def satisfies(reply: str) -> bool:
    return PARAGRAPH.satisfies(reply)


def next_message(reply: str, following: str | None) -> str:
    """The paragraph user's remark on the last reply, then the next question."""
    return PARAGRAPH.next_message(reply, following)
