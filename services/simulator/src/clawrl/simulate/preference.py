"""The simulated user's personal preference and what they say about each reply (pure functions).

The preference: an answer in one paragraph, with no line breaks and no list. SmolLM2-135M meets
it in 47 % of its replies to open questions at v0 (96 tokens, temperature 0.8; README, "The demo
that trends"), so both kinds of reply come up and a policy can learn which one this user wants.
A reply that meets it only by saying next to nothing does not count: fewer than MIN_WORDS
words, or text that repeats itself (a collapsed policy's loop), is a complaint too, so learning
cannot reach the preference by collapsing into short or degenerate replies.

`verdict` is shared by the simulated user (its next message) and by `clawrl eval` (the held-out
score), so the live reward and the held-out score measure the same thing.

What the user says comes in two wordings: fixed (`REMARKS`, one sentence per verdict that opens
with "Thanks" or "Please", which `reward_examples:stated_preference` reads) and varied
(`VARIED_REMARKS`, `clawrl simulate --remarks varied`: at least 8 remarks per verdict as a person
might write them, drawn by the session's seeded RNG; terse ones, questions, few opening with
"thanks" or "please"). Every complaint still says what the user wants (a hint is built from it),
and praise sounds like praise.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

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


VARIED_REMARKS = {
    Verdict.PLEASED: (
        "Perfect.",
        "Great answer, one tidy paragraph is exactly what I like.",
        "That's just right: a single clear paragraph.",
        "Nice, short and all in one paragraph.",
        "Exactly the kind of answer I was after.",
        "Love it, plain prose in one block.",
        "Thanks, that reads really well as one paragraph.",
        "Spot on, that's the format I like.",
        "Good one.",
    ),
    Verdict.LAYOUT: (
        "Could you keep it to one paragraph?",
        "Please, answer in one paragraph next time, no lists or line breaks.",
        "Too many line breaks. One paragraph, please.",
        "Can you write that as a single paragraph instead of a list?",
        "I'd rather have plain prose in one paragraph, not bullet points.",
        "Hmm, that's a list. I like my answers in one paragraph.",
        "Don't split it up: one paragraph is all I want.",
        "Why the list? Just one paragraph.",
        "That's hard to read with all those breaks; one paragraph would be better.",
        "Would you mind putting it all in one paragraph?",
    ),
    Verdict.TOO_SHORT: (
        "Too short. A real paragraph.",
        "Please, that is too short: give me a real answer, in one paragraph.",
        "Could you say a bit more? A full paragraph would be good.",
        "That's barely an answer; I'd like a real paragraph.",
        "Can you expand on that in one proper paragraph?",
        "Not enough detail. One full paragraph next time.",
        "Hmm, is that all? Give me a real answer in one paragraph.",
        "You can do better than that: a full paragraph.",
        "Why so short? One full paragraph would help.",
    ),
    Verdict.REPETITIVE: (
        "You're going in circles. One clear paragraph, please.",
        "Please, you are repeating yourself: answer in one clear paragraph.",
        "Could you stop repeating the same thing and give me one clear paragraph?",
        "That says the same thing over and over; one clear paragraph instead.",
        "Why do you keep repeating yourself? Just answer in one clear paragraph.",
        "Too repetitive. One clear paragraph.",
        "Can you say it once, in one clear paragraph?",
        "Enough with the repeats: one clear paragraph would do.",
        "Hmm, that loops. Say it once, in a paragraph.",
    ),
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


LINES_VARIED_REMARKS = {
    Verdict.PLEASED: (
        "Perfect.",
        "Great, separate lines make it easy to scan.",
        "That's just right: one point per line.",
        "Nice, I like the list.",
        "Exactly the layout I like.",
        "Thanks, points on separate lines are just how I like it.",
        "Love the bullet points.",
        "Spot on, easy to read line by line.",
        "Good one.",
    ),
    Verdict.PARAGRAPH: (
        "Could you break that into separate lines?",
        "Too dense. A list, please.",
        "Can you put each point on its own line?",
        "I'd rather have a list than one block of text.",
        "Please, break the answer into lines or a list next time, not one block.",
        "Hmm, a wall of text. Bullet points next time.",
        "Why one big block? Split it into points on separate lines.",
        "That's hard to scan; separate lines would be better.",
        "Would you mind listing the points instead?",
    ),
    Verdict.TOO_SHORT: (
        "Too short. A real list.",
        "Please, that is too short: give me a real answer, on separate lines.",
        "Could you say a bit more, a few points on separate lines?",
        "That's barely an answer; I'd like a real list.",
        "Can you expand on that, one point per line?",
        "Not enough detail. A few points on separate lines next time.",
        "Hmm, is that all? Give me a real answer as a list.",
        "You can do better than that: a proper list.",
        "Why so short? A few separate points would help.",
    ),
    Verdict.REPETITIVE: (
        "You're going in circles. Clear separate points, please.",
        "Please, you are repeating yourself: answer in clear separate points.",
        "Could you stop repeating the same thing and list clear points?",
        "That says the same thing over and over; distinct points instead.",
        "Why do you keep repeating yourself? Just list clear separate points.",
        "Too repetitive. Clear separate points.",
        "Can you say each thing once, one point per line?",
        "Enough with the repeats: distinct points on separate lines would do.",
        "Hmm, that loops. Each point once, on its own line.",
    ),
}


@dataclass(frozen=True)
class Preference:
    """One simulated user's taste: its verdict on a reply and what it says about each verdict
    (one fixed remark, or one of several varied ones)."""

    name: str
    judge: Callable[[str], Verdict]
    remarks: Mapping[Verdict, str]
    varied: Mapping[Verdict, Sequence[str]] = field(default_factory=dict)

    def satisfies(self, reply: str) -> bool:
        return self.judge(reply) is Verdict.PLEASED

    def remark(self, reply: str, rng: random.Random | None = None) -> str:
        """What the user says about the reply: the fixed remark, or with `rng` a varied one
        drawn with it."""
        found = self.judge(reply)
        return self.remarks[found] if rng is None else rng.choice(self.varied[found])

    def next_message(
        self, reply: str, following: str | None, rng: random.Random | None = None
    ) -> str:
        """The remark on the last reply, then the next question (none at the session's end)."""
        remark = self.remark(reply, rng)
        return f"{remark} Next: {following}" if following else remark


PARAGRAPH = Preference("paragraph", verdict, REMARKS, VARIED_REMARKS)
LINES = Preference("lines", lines_verdict, LINES_REMARKS, LINES_VARIED_REMARKS)


def satisfies(reply: str) -> bool:
    return PARAGRAPH.satisfies(reply)


def next_message(reply: str, following: str | None) -> str:
    """The paragraph user's remark on the last reply, then the next question."""
    return PARAGRAPH.next_message(reply, following)
