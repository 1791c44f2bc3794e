"""What the simulated user talks about: the questions of a session, its own check of each reply,
and its next message (a remark on the reply, then the next question).

- `preference` (the default): open questions; the user wants one paragraph, no lists or line
  breaks, and says so (judge reward: `clawrl.judge.reward_examples:stated_preference`).
- `lines`: the opposite taste (the second user of `clawrl simulate --tenants 2`): points on
  separate lines or a list, never one block of text (same judge reward).
- `arithmetic`: word problems; the user names the right number ("Correct, thanks: the answer is
  8." / "No, that's wrong, ..."; judge reward: `arithmetic_confirmed`).

`remark(reply, item, following, rng=None)`: the fixed wording, or with the session's RNG one of
the varied wordings (`clawrl simulate --remarks varied`; the `remark_sentiment` reward reads it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.simulate import preference, problems, questions


@dataclass(frozen=True)
class Scenario:
    check_name: str  # what the simulator's own check measures, in reports
    system_prompt: str | None
    draw: Callable[[random.Random], Any]  # one question (an item the other functions read)
    text: Callable[[Any], str]  # the question as the user writes it
    check: Callable[[str, Any], bool]  # does the reply to the item pass the user's check
    # Next message: the verdict, then the next question; fixed wording, or varied with an RNG.
    remark: Callable[..., str]
    # The taste the held-out score measures (`clawrl eval`); None: no held-out score.
    taste: preference.Preference | None = None


def open_questions(taste: preference.Preference) -> Scenario:
    """Open questions to a user with this taste, which it never tells the model up front."""
    return Scenario(
        check_name="liked",
        system_prompt=None,  # the model's own default: the preference is the user's, never told
        draw=questions.training_question,
        text=lambda question: question,
        check=lambda reply, _question: taste.satisfies(reply),
        remark=lambda reply, _question, following, rng=None: taste.next_message(
            reply, following, rng
        ),
        taste=taste,
    )


PREFERENCE = open_questions(preference.PARAGRAPH)
LINES = open_questions(preference.LINES)

ARITHMETIC = Scenario(
    check_name="accuracy",
    system_prompt=problems.SYSTEM_PROMPT,
    draw=problems.make_problem,
    text=lambda problem: problem.question,
    check=lambda reply, problem: problems.is_correct(reply, problem),
    remark=problems.next_message,
)

SCENARIOS = {"preference": PREFERENCE, "lines": LINES, "arithmetic": ARITHMETIC}
