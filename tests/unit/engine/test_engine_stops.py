"""Finish reasons, SGLang-shaped."""

from clawrl.engine.cpu.stops import find_stop_string, token_finish
from clawrl.engine.generation import StopCriteria


def test_length_is_checked_first():
    criteria = StopCriteria(max_new_tokens=2, eos_token_ids=frozenset({2}))
    assert token_finish(criteria, [5]) is None
    assert token_finish(criteria, [5, 2]) == {"type": "length", "length": 2}


def test_eos_and_stop_token_ids_match_the_token_id():
    criteria = StopCriteria(
        max_new_tokens=10, stop_token_ids=frozenset({7}), eos_token_ids=frozenset({2})
    )
    assert token_finish(criteria, [5, 2]) == {"type": "stop", "matched": 2}
    assert token_finish(criteria, [7]) == {"type": "stop", "matched": 7}


def test_ignore_eos_keeps_stop_token_ids():
    criteria = StopCriteria(
        max_new_tokens=10,
        stop_token_ids=frozenset({7}),
        eos_token_ids=frozenset({2}),
        ignore_eos=True,
    )
    assert token_finish(criteria, [2]) is None
    assert token_finish(criteria, [7]) == {"type": "stop", "matched": 7}


def test_the_earliest_stop_string_wins():
    assert find_stop_string("a, b. c", (".", ",")) == (",", 1)
    assert find_stop_string("abc", ("x",)) is None
