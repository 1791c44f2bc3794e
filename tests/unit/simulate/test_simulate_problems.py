"""The simulator's pure parts: problems with exact answers, the user's verdicts (the right
number first, so the judge's arithmetic_confirmed reward reads the truth), per-version figures."""

from __future__ import annotations

import random
import re

from clawrl.simulate.problems import Problem, feedback, final_number, make_problem, next_message
from clawrl.simulate.report import TurnOutcome, per_version, table, write_csv
from clawrl.simulate.simulation import reply_version


def test_problems_have_exact_non_negative_answers():
    rng = random.Random(0)
    for _ in range(200):
        problem = make_problem(rng)
        numbers = [int(n) for n in re.findall(r"\d+", problem.question)]
        a, b = numbers
        assert problem.answer in (a + b, a - b, a * b) and problem.answer >= 0


def test_verdicts_name_the_right_number_first():
    problem = Problem("How many?", 12)
    assert final_number("7 + 5 = 12") == 12 and final_number("no idea") is None
    assert feedback("It is 12.", problem) == "Correct, thanks: the answer is 12."
    assert feedback("12? No: it is 13.", problem) == "No, that's wrong, the answer is 12."
    nxt = next_message("13", problem, Problem("Now 3 apples and 4 more?", 7))
    assert nxt == "No, that's wrong, the answer is 12. Next question: Now 3 apples and 4 more?"


def test_the_judges_arithmetic_reward_reads_the_verdict():
    from clawrl.judge.reward_examples import NUMBER

    problem = Problem("?", 12)
    following = Problem("Ana has 3 apples and buys 4 more?", 7)
    for reply in ("So 12", "So 13"):
        confirmed = NUMBER.findall(next_message(reply, problem, following))
        assert float(confirmed[0]) == 12  # the first number is always the right answer


def test_figures_per_version(tmp_path):
    outcomes = [TurnOutcome(0, False), TurnOutcome(0, True), TurnOutcome(2, True)]
    rewards = [(0, -1.0), (0, 1.0), (0, -1.0), (1, 1.0)]
    stats = per_version(outcomes, rewards)
    assert [(s.version, s.turns, s.accuracy, s.samples) for s in stats] == [
        (0, 2, 0.5, 3), (1, 0, 0.0, 1), (2, 1, 1.0, 0),
    ]  # fmt: skip
    assert round(stats[0].reward_mean, 3) == -0.333 and stats[2].reward_mean is None
    assert table(stats).splitlines()[1].split() == ["0", "2", "0.500", "3", "-0.333"]
    write_csv(stats, tmp_path / "out.csv")
    assert (tmp_path / "out.csv").read_text().splitlines()[1] == "0,2,0.5000,3,-0.3333"
    assert reply_version("clawrl-policy-v12") == 12 and reply_version(None) == 0
