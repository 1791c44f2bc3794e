"""How far a batch the backend was lost on is split: whole while retried, then halved per loss
until the sample that kills the backend is alone, then 0 (dead-letter it)."""

from __future__ import annotations

from clawrl.trainer.intake import step_limit


def test_a_batch_is_retried_whole_then_halved_down_to_one_then_refused() -> None:
    assert [step_limit(n, 16, retries=1) for n in range(8)] == [16, 16, 8, 4, 2, 1, 0, 0]
    assert [step_limit(n, 16, retries=0) for n in range(7)] == [16, 8, 4, 2, 1, 0, 0]


def test_odd_batches_round_up_and_a_batch_of_one_is_refused_after_its_retries() -> None:
    assert [step_limit(n, 5, retries=0) for n in range(6)] == [5, 3, 2, 1, 0, 0]
    assert [step_limit(n, 1, retries=2) for n in range(5)] == [1, 1, 1, 0, 0]
