"""Arithmetic word problems and the scripted user's replies (pure functions).

The user's feedback always names the right number first ("Correct, thanks: the answer is 8." /
"No, that's wrong, the answer is 8."; with an RNG, one of several wordings, the right number
still the first), so a PRM, a hint and the judge's `arithmetic_confirmed` reward all read the
same truth from the next state.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

NUMBER = re.compile(r"-?\d+")

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the word problem and end your reply with the number "
    "that answers it."
)

TEMPLATES = (
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("A box holds {a} pens. {b} pens are taken out. How many pens are left in the box?", "-"),
    ("{name} reads {a} pages a day for {b} days. How many pages does {name} read in all?", "*"),
    ("There are {a} birds on a tree and {b} more land on it. How many birds are on the tree?", "+"),
    ("{name} had {a} coins and spent {b} of them. How many coins does {name} have left?", "-"),
    ("A shelf has {a} rows of {b} books. How many books are on the shelf?", "*"),
)
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Gus", "Hana")


# The varied wordings (`clawrl simulate --remarks varied`); no other number before the answer.
CORRECT_REMARKS = (
    "Correct, thanks: the answer is {answer}.",
    "Yes, {answer} is right.",
    "Right, it's {answer}. Well done.",
    "Perfect, {answer}.",
    "{answer}, exactly.",
    "That's right, {answer}.",
    "Great, {answer} is correct.",
    "Nice work, {answer}.",
)
WRONG_REMARKS = (
    "No, that's wrong, the answer is {answer}.",
    "Not quite: it's {answer}.",
    "Nope, {answer}.",
    "Hmm, I get {answer}. Could you check your working?",
    "That's not it, the answer is {answer}.",
    "Wrong, it should be {answer}.",
    "Can you redo it? It comes to {answer}.",
    "Are you sure? I make it {answer}.",
)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def make_problem(rng: random.Random, max_operand: int = 12) -> Problem:
    """A one-step word problem with a non-negative integer answer."""
    template, op = rng.choice(TEMPLATES)
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(template.format(name=rng.choice(NAMES), a=a, b=b), answer)


def final_number(text: str) -> int | None:
    """The last integer in a reply (the answer it commits to), None when there is none."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def is_correct(reply: str, problem: Problem) -> bool:
    return final_number(reply) == problem.answer


def feedback(reply: str, problem: Problem, rng: random.Random | None = None) -> str:
    """The user's verdict on a reply, naming the right number first (with `rng`, in a wording
    drawn with it)."""
    if is_correct(reply, problem):
        wording = rng.choice(CORRECT_REMARKS) if rng else CORRECT_REMARKS[0]
    else:
        wording = rng.choice(WRONG_REMARKS) if rng else WRONG_REMARKS[0]
    return wording.format(answer=problem.answer)


def next_message(
    reply: str, problem: Problem, following: Problem | None, rng: random.Random | None = None
) -> str:
    """Verdict on the last reply, then the next question (none at the session's end)."""
    text = feedback(reply, problem, rng)
    return f"{text} Next question: {following.question}" if following else text
