"""Vote parsing and majority, hand-worked."""

from __future__ import annotations

import pytest

from clawrl.judge.votes import agreement, majority, parse_boxed, wire_votes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The reply was good. \\boxed{1}", 1),
        ("bad \\boxed{-1}", -1),
        ("unclear \\boxed{0}", 0),
        ("spaces \\boxed{ -1 }", -1),
        ("plus \\boxed{+1}", 1),
        ("first \\boxed{1} then changed my mind \\boxed{-1}", -1),
        # The LAST boxed answer counts even when it is invalid: no fallback to an earlier one.
        ("\\boxed{1} ... final: \\boxed{2}", None),
        ("\\boxed{yes}", None),
        ("no verdict at all", None),
        ("", None),
        ("\\boxed{1.0}", None),
        ("nested \\boxed{\\text{1}}", None),
    ],
)
def test_parse_boxed(text: str, expected: int | None) -> None:
    assert parse_boxed(text) == expected


def test_parse_boxed_with_a_restricted_verdict_set() -> None:
    allowed = frozenset({1, -1})
    assert parse_boxed("\\boxed{0}", allowed) is None
    assert parse_boxed("\\boxed{-1}", allowed) == -1


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([1, 1, -1], 1),
        ([-1, -1, 1], -1),
        ([1, -1], 0),  # tie
        ([1, -1, 0], 0),  # three-way tie
        ([0, 0, 1], 0),  # majority of explicit zeros
        ([1, None, None], 1),  # invalid votes are dropped
        ([None, None, None], 0),  # no valid vote
        ([], 0),
        ([1, 1, -1, -1, 0], 0),  # tie for the top count
        ([-1, None, -1, 1, 1, -1], -1),
    ],
)
def test_majority(votes: list[int | None], expected: int) -> None:
    assert majority(votes) == expected


def test_agreement_and_wire_form() -> None:
    assert agreement([1, 1, -1, None], 1) == pytest.approx(2 / 3)
    assert agreement([None, None], 0) == 0.0
    assert wire_votes([1, None, -1, 0]) == [1, 0, -1, 0]
