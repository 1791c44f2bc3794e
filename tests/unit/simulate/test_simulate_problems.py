"""The simulator's arithmetic scenario: problems with exact answers, the user's verdicts (the right
number first, so the judge's arithmetic_confirmed reward reads the truth)."""

from __future__ import annotations

import random
import re

from clawrl.simulate.problems import Problem, feedback, final_number, make_problem, next_message


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
