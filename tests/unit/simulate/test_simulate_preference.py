"""The preference scenario's pure parts: the user's verdict on a reply (one paragraph, and not by
collapsing into short or looping replies), what the user says, the judge's reward read from those
words only, the held-out questions kept out of training, and the per-version figures."""

from __future__ import annotations

import json
import random

import pytest

from clawrl.common.records import Turn
from clawrl.judge.reward_examples import stated_preference
from clawrl.judge.turns import TurnView
from clawrl.simulate.evaluation import (
    HeldOutScore,
    adapter_version,
    complete,
    reply_version,
    scores,
)
from clawrl.simulate.preference import (
    REMARKS,
    Verdict,
    next_message,
    repeated_trigram_share,
    verdict,
)
from clawrl.simulate.questions import HELD_OUT_TOPICS, held_out_questions, training_question
from clawrl.simulate.report import TurnOutcome, per_version, table, write_csv
from clawrl.simulate.scenarios import ARITHMETIC, PREFERENCE

PARAGRAPH = (
    "Photosynthesis is how plants turn sunlight, water and carbon dioxide into sugar and "
    "oxygen, which feeds the plant and most life on Earth."
)  # 23 words
LISTED = (
    "Photosynthesis has two stages:\n1. The light reactions make energy carriers.\n"
    "2. The Calvin cycle uses them to build sugar from carbon dioxide in the leaves."
)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (PARAGRAPH, Verdict.PLEASED),
        (f"\n  {PARAGRAPH}\n", Verdict.PLEASED),  # surrounding blank lines are not a break
        (LISTED, Verdict.LAYOUT),
        (PARAGRAPH.replace(", which", ".\n\nThis"), Verdict.LAYOUT),
        (f"- {PARAGRAPH}", Verdict.LAYOUT),  # a one-item list
        (f"1) {PARAGRAPH}", Verdict.LAYOUT),
        ("", Verdict.TOO_SHORT),
        ("Plants make sugar from light.", Verdict.TOO_SHORT),
        (" ".join(["word"] * 14), Verdict.TOO_SHORT),
        ("plants make sugar " * 8, Verdict.REPETITIVE),
        ("The the the the the the the the the the the the the the the the", Verdict.REPETITIVE),
    ],
)
def test_verdict(reply: str, expected: Verdict) -> None:
    assert verdict(reply) is expected


def test_the_word_bound_and_the_loop_bound() -> None:
    fifteen = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    assert verdict(fifteen) is Verdict.TOO_SHORT  # 14 words
    assert verdict(fifteen + " fifteen") is Verdict.PLEASED
    assert repeated_trigram_share("a b c a b c".split()) == 0.25  # abc bca cab abc: 1 of 4 seen
    assert repeated_trigram_share("a b".split()) == 0.0


def test_what_the_user_says() -> None:
    assert next_message(PARAGRAPH, "What is DNA?") == (
        "Thanks, one short paragraph is just how I like it. Next: What is DNA?"
    )
    assert next_message(LISTED, "What is DNA?") == (
        "Please, answer in one paragraph next time, no lists or line breaks. Next: What is DNA?"
    )
    assert next_message("Yes.", None) == REMARKS[Verdict.TOO_SHORT]


def turn_with(reply: str, next_user: str | None) -> TurnView:
    turn = Turn(turn_id="s:0", session_id="s", response_text=reply, messages_json="[]")
    if next_user is not None:
        turn.next_state_messages_json.append(json.dumps({"role": "user", "content": next_user}))
    return TurnView(turn)


def test_the_judge_reads_the_reward_from_what_the_user_said() -> None:
    for verdict_, reward in [(Verdict.PLEASED, 1.0), (Verdict.LAYOUT, -1.0),
                             (Verdict.TOO_SHORT, -1.0), (Verdict.REPETITIVE, -1.0)]:  # fmt: skip
        said = f"{REMARKS[verdict_]} Next: What is DNA?"
        # Whatever the reply was: the reward is the user's word, not a check of the reply.
        assert stated_preference(turn_with(LISTED, said)) == reward
        assert stated_preference(turn_with(PARAGRAPH, said)) == reward
    assert stated_preference(turn_with(PARAGRAPH, None)) is None  # no next state
    assert stated_preference(turn_with(PARAGRAPH, "What about DNA?")) is None
    assert stated_preference(turn_with(PARAGRAPH, "Correct, thanks: the answer is 8.")) is None
    assert stated_preference(turn_with(PARAGRAPH, "  THANK YOU!"), displeased=()) == 1.0
    assert stated_preference(turn_with(PARAGRAPH, "Meh."), displeased=["meh"]) == -1.0


def test_scenarios_remark_and_check_alike() -> None:
    rng = random.Random(0)
    question = PREFERENCE.draw(rng)
    assert PREFERENCE.text(question) == question and PREFERENCE.system_prompt is None
    assert PREFERENCE.check(PARAGRAPH, question) and not PREFERENCE.check(LISTED, question)
    assert PREFERENCE.remark(LISTED, question, None) == REMARKS[Verdict.LAYOUT]
    problem = ARITHMETIC.draw(rng)
    assert ARITHMETIC.check(f"It is {problem.answer}.", problem)
    assert ARITHMETIC.remark("0", problem, None).startswith("No, that's wrong")


def test_the_held_out_questions_are_fixed_and_never_asked_in_training() -> None:
    held_out = held_out_questions()
    assert len(held_out) == 32 == len(set(held_out)) and held_out == held_out_questions()
    rng = random.Random(7)
    asked = {training_question(rng) for _ in range(5000)}
    assert len(asked) > 250  # many templates x topics
    assert not any(topic in q for q in asked for topic in HELD_OUT_TOPICS)


def test_held_out_scores_by_version() -> None:
    answers = [(3, PARAGRAPH), (3, LISTED), (3, PARAGRAPH), (4, "short")]
    found = scores(answers)
    assert found == [HeldOutScore(3, 3, pytest.approx(2 / 3)), HeldOutScore(4, 1, 0.0)]
    # Why the others missed: the complaint each reply got.
    assert [s.misses for s in found] == [{"layout": 1}, {"too_short": 1}]
    assert [s.summary() for s in found] == ["2/3; missed: layout 1", "0/1; missed: too_short 1"]
    assert complete(found) == []  # neither covers all 32 questions
    every = scores([(5, PARAGRAPH)] * 32)
    assert complete(every) == every == [HeldOutScore(5, 32, 1.0)]
    assert every[0].summary() == "32/32"
    assert reply_version("clawrl-policy-v12") == 12 and reply_version(None) == 0
    assert adapter_version("policy-v7") == 7 and adapter_version(None) == 0
    with pytest.raises(ValueError, match="policy-vN"):
        adapter_version("mine")


def test_figures_per_version(tmp_path) -> None:
    outcomes = [TurnOutcome(0, False), TurnOutcome(0, True), TurnOutcome(2, True)]
    rewards = [(0, -1.0), (0, 1.0), (0, -1.0), (1, 1.0)]
    held_out = [HeldOutScore(0, 32, 0.25), HeldOutScore(3, 32, 0.5)]
    stats = per_version(outcomes, rewards, held_out)
    assert [(s.version, s.turns, s.passed, s.samples, s.held_out) for s in stats] == [
        (0, 2, 0.5, 3, 0.25), (1, 0, 0.0, 1, None), (2, 1, 1.0, 0, None), (3, 0, 0.0, 0, 0.5),
    ]  # fmt: skip
    assert round(stats[0].reward_mean, 3) == -0.333 and stats[2].reward_mean is None
    lines = table(stats).splitlines()
    assert lines[0].split() == ["version", "turns", "liked", "samples", "reward", "held-out"]
    assert lines[1].split() == ["0", "2", "0.500", "3", "-0.333", "0.250"]
    assert lines[3].split() == ["2", "1", "1.000", "0", "-", "-"]
    write_csv(stats, tmp_path / "out.csv", "accuracy")
    rows = (tmp_path / "out.csv").read_text().splitlines()
    assert rows[0] == "policy_version,turns,accuracy,samples,reward_mean,held_out_score"
    assert rows[1:3] == ["0,2,0.5000,3,-0.3333,0.2500", "1,0,0.0000,1,1.0000,"]


def test_eval_refuses_an_adapter_name_without_a_version(capsys) -> None:
    from clawrl.simulate.main import parse_args

    assert parse_args(["eval", "--lora", "policy-v4"]).lora == "policy-v4"
    with pytest.raises(SystemExit):
        parse_args(["eval", "--lora", "mine"])
    assert "not named policy-vN" in capsys.readouterr().err
