"""The simulated user who words things freely (`clawrl simulate --remarks varied`): enough
remarks per verdict, in varied forms, drawn by the seed, and the `remark_sentiment` reward that
reads every one of them right (and the fixed wording as `stated_preference` does)."""

from __future__ import annotations

import random
import re

import pytest

from clawrl.judge.reward_examples import remark_sentiment, stated_preference
from clawrl.simulate import problems
from clawrl.simulate.preference import LINES, PARAGRAPH, REMARKS, Verdict
from clawrl.simulate.questions import TEMPLATES
from clawrl.simulate.scenarios import ARITHMETIC, PREFERENCE
from tests.unit.simulate.test_simulate_preference import LISTED, turn_with
from tests.unit.simulate.test_simulate_preference import PARAGRAPH as ONE_PARAGRAPH

TASTES = [(PARAGRAPH, "paragraph"), (LINES, r"line|list|point")]
NEXT_QUESTIONS = [t.format(topic="DNA") for t in TEMPLATES]


def every_remark() -> list[tuple[str, float]]:
    """(remark, the reward it should read as) for every remark of every varied user."""
    found = [
        (remark, 1.0 if verdict is Verdict.PLEASED else -1.0)
        for taste, _ in TASTES
        for verdict, remarks in taste.varied.items()
        for remark in remarks
    ]
    found += [(r.format(answer=8), 1.0) for r in problems.CORRECT_REMARKS]
    found += [(r.format(answer=8), -1.0) for r in problems.WRONG_REMARKS]
    return found


@pytest.mark.parametrize(("taste", "wish"), TASTES, ids=["paragraph", "lines"])
def test_each_verdict_has_eight_varied_remarks(taste, wish: str) -> None:
    assert set(taste.varied) == set(taste.remarks)  # every verdict the user can reach
    for verdict, remarks in taste.varied.items():
        assert len(set(remarks)) == len(remarks) >= 8, verdict
        openers = [r.split()[0].strip(",.").casefold() for r in remarks]
        assert sum(o in ("thanks", "please") for o in openers) <= 2, verdict
        assert len(set(openers)) >= 6, verdict  # varied openings
        assert any(len(r.split()) <= 6 for r in remarks), verdict  # a terse one
        if verdict is not Verdict.PLEASED:
            assert sum(r.rstrip().endswith("?") or "? " in r for r in remarks) >= 3, verdict
            # Every complaint says what the user wants: a hint is built from it.
            assert all(re.search(wish, r, re.IGNORECASE) for r in remarks), verdict


def test_the_seed_draws_the_remark_and_fixed_stays_fixed() -> None:
    drawn = [PARAGRAPH.remark(LISTED, random.Random(seed)) for seed in range(200)]
    assert drawn == [PARAGRAPH.remark(LISTED, random.Random(seed)) for seed in range(200)]
    assert set(drawn) == set(PARAGRAPH.varied[Verdict.LAYOUT])  # every wording comes up
    assert PARAGRAPH.remark(LISTED) == REMARKS[Verdict.LAYOUT]
    rng = random.Random(3)
    said = PREFERENCE.remark(ONE_PARAGRAPH, "q", "What is DNA?", rng)
    assert said.endswith(" Next: What is DNA?")
    assert said.removesuffix(" Next: What is DNA?") in PARAGRAPH.varied[Verdict.PLEASED]
    assert PREFERENCE.remark(ONE_PARAGRAPH, "q", None) == REMARKS[Verdict.PLEASED]
    problem = problems.Problem("2 + 3?", 5)
    varied = {ARITHMETIC.remark("4", problem, None, random.Random(s)) for s in range(100)}
    assert varied == {r.format(answer=5) for r in problems.WRONG_REMARKS}
    assert ARITHMETIC.remark("4", problem, None) == "No, that's wrong, the answer is 5."


@pytest.mark.parametrize(("remark", "reward"), every_remark())
def test_remark_sentiment_reads_every_remark(remark: str, reward: float) -> None:
    # Whatever the reply and whatever question follows: the remark decides.
    assert remark_sentiment(turn_with(LISTED, remark)) == reward
    for question in NEXT_QUESTIONS:
        assert remark_sentiment(turn_with(ONE_PARAGRAPH, f"{remark} Next: {question}")) == reward


def test_the_arithmetic_wordings_name_the_right_number_first() -> None:
    for wording in (*problems.CORRECT_REMARKS, *problems.WRONG_REMARKS):
        assert problems.NUMBER.findall(wording.format(answer=42))[0] == "42"


def test_remark_sentiment_agrees_with_stated_preference_on_the_fixed_wording() -> None:
    for taste, _ in TASTES:
        for remark in taste.remarks.values():
            said = f"{remark} Next: What is DNA?"
            expected = stated_preference(turn_with(LISTED, said))
            assert expected is not None and remark_sentiment(turn_with(LISTED, said)) == expected


@pytest.mark.parametrize(
    ("said", "reward"),
    [
        (None, None),  # no next message
        ("What about DNA?", None),
        ("Can you explain DNA to me?", None),  # a new question is no complaint
        ("Thanks, but could you keep it shorter?", -1.0),  # a correction wins in its sentence
        ("Nice start. But it needs to be one paragraph.", -1.0),  # "but" reads on
        ("Looks fine to me. Great.", 1.0),  # the first sentence with a cue decides
    ],
)
def test_remark_sentiment_beyond_the_simulator(said: str | None, reward: float | None) -> None:
    assert remark_sentiment(turn_with(LISTED, said)) == reward
