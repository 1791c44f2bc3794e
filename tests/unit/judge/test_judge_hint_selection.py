"""Hint candidates and their selection as pure functions (hand-worked numbers), the teacher
signals' narrowing and per-token merge, the hint plug-in's result check, and the two example hint
plug-ins."""

from __future__ import annotations

import json

import pytest

from clawrl.common.proto.records_pb2 import Turn
from clawrl.judge.hint_examples import corrective_sentences, next_message
from clawrl.judge.hint_fns import HintFnFailed, check_hints, load_hint_fn
from clawrl.judge.hints import (
    HintVote,
    accepted_hints,
    by_length,
    candidates,
    sequence_optimal,
    token_optimal,
    topk_overlap,
)
from clawrl.judge.rewards import RewardFnError
from clawrl.judge.teacher import TeacherSignal, merge_signals, narrow_topk
from clawrl.judge.turns import TurnView


def test_candidates_drop_short_ones_and_repeats_keeping_order() -> None:
    hints = ["Be brief.", "Answer in one line.", "answer in  ONE line.", "  Use a list.  ", "ok"]
    assert candidates(hints, min_chars=5) == ["Be brief.", "Answer in one line.", "Use a list."]
    assert candidates(hints, min_chars=9) == ["Answer in one line.", "Use a list."]
    assert candidates(hints, min_chars=5, limit=2) == ["Be brief.", "Answer in one line."]


def test_accepted_hints_are_those_of_positive_votes() -> None:
    votes = [HintVote(1, "Give the number."), HintVote(-1, "Use a table here."),
             HintVote(None, "Unparsable one."), HintVote(1, "give the  number.")]  # fmt: skip
    assert accepted_hints(votes, min_chars=5) == ["Give the number."]


def test_by_length_picks_the_first_of_equals() -> None:
    hints = ["abcd", "ab", "abcdef", "cd", "uvwxyz"]
    assert by_length(hints, "shortest") == 1
    assert by_length(hints, "longest") == 2


def test_topk_overlap_counts_shared_ids_per_position() -> None:
    student = [1, 2, 3, 4, 5, 6]  # T = 2, K = 3
    teacher = [3, 9, 1, 7, 8, 9]
    assert topk_overlap(student, teacher, 3) == [2, 0]
    with pytest.raises(ValueError, match="top-3"):
        topk_overlap(student, teacher[:3], 3)


def test_sequence_and_token_optimal() -> None:
    overlaps = [[3, 0, 1], [1, 2, 2], [3, 2, 0]]  # N = 3 candidates, T = 3 tokens
    assert sequence_optimal(overlaps) == 1  # sums 4, 5, 5: the first of the best
    assert token_optimal(overlaps) == [0, 1, 1]  # ties go to the earlier candidate


def test_narrow_and_merge_teacher_signals() -> None:
    ids, lps = narrow_topk([1, 2, 3, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], 3, 2)
    assert ids == [1, 2, 4, 5] and lps == [-0.1, -0.2, -0.4, -0.5]
    with pytest.raises(ValueError):
        narrow_topk([1, 2], [-1.0, -2.0], 1, 2)
    a = TeacherSignal([-1.0, -2.0], 1, [10, 20], [-0.1, -0.2])
    b = TeacherSignal([-3.0, -4.0], 1, [30, 40], [-0.3, -0.4])
    merged = merge_signals([a, b], [1, 0])
    assert merged == TeacherSignal([-3.0, -2.0], 1, [30, 20], [-0.3, -0.2])


def test_check_hints_accepts_text_and_lists_only() -> None:
    assert check_hints(None, "m:f") == [] and check_hints("x", "m:f") == ["x"]
    assert check_hints(("a", "b"), "m:f") == ["a", "b"]
    for bad in (42, ["a", 1], {"hint": "a"}):
        with pytest.raises(HintFnFailed, match="m:f"):
            check_hints(bad, "m:f")


async def test_a_raising_hint_fn_is_a_hint_fn_failure() -> None:
    fn = load_hint_fn("tests.integration.judge.plugins:hint_by_next_message")
    with pytest.raises(HintFnFailed, match="RuntimeError: hint plug-in bug"):
        await fn(view("crash"))
    assert await fn(view("plugin please")) == [
        "Hint from the plug-in: answer with the number only."
    ]
    assert fn.source == "hint_fn:tests.integration.judge.plugins:hint_by_next_message"
    with pytest.raises(RewardFnError, match="hint_fn must be 'module:function'"):
        load_hint_fn("no_colon")


def view(next_text: str) -> TurnView:
    turn = Turn(messages_json='[{"role": "user", "content": "Hi"}]')
    turn.next_state_messages_json.append(json.dumps({"role": "user", "content": next_text}))
    return TurnView(turn)


def test_next_message_is_the_feedback_before_the_next_request() -> None:
    said = "Too long, keep it to one paragraph. Next: what is Redis?"
    assert next_message(view(said)) == said
    assert next_message(view(said), drop_after="Next:") == "Too long, keep it to one paragraph."
    assert next_message(view("")) is None


def test_corrective_sentences_keep_corrections_only() -> None:
    said = ("Nice topic. No, that was far too long. Could you drop the bullet points? "
            "Next: why is the sky blue? Keep it short.")  # fmt: skip
    assert corrective_sentences(view(said), drop_after="Next:") == [
        "No, that was far too long.",
        "Could you drop the bullet points?",
        "No, that was far too long. Could you drop the bullet points?",
    ]
    assert (
        corrective_sentences(view("Perfect, thank you. Next: and Kafka?"), drop_after="Next:")
        is None
    )
    assert corrective_sentences(view("Please use one paragraph.")) == ["Please use one paragraph."]
