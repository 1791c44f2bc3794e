"""Fluency kept, the pure parts: the request that scores a reply on the base weights (one
position before the reply, see clawrl.simulate.fluency), the NLL read back only when it lines up
with the reply, and the base NLL column of the per-version report."""

from __future__ import annotations

import pytest

from clawrl.simulate.evaluation import HeldOutScore, exchanges_of
from clawrl.simulate.fluency import Fluency, FluencyError, nll_request, reply_nll
from clawrl.simulate.questions import held_out_questions
from clawrl.simulate.report import TurnOutcome, per_version, table, write_csv


def test_the_request_starts_one_position_before_the_reply() -> None:
    payload = nll_request([5, 6, 7], [8, 9])
    assert payload["input_ids"] == [5, 6, 7, 8, 9]
    assert payload["logprob_start_len"] == 2 and payload["return_logprob"] is True
    assert payload["sampling_params"]["max_new_tokens"] == 0
    with pytest.raises(ValueError, match="non-empty prompt"):
        nll_request([], [8])


def test_the_nll_is_read_only_when_it_lines_up_with_the_reply() -> None:
    meta = {"input_token_logprobs": [[None, 7, ""], [-0.5, 8, "a"], [-1.5, 9, "b"]]}
    assert reply_nll(meta, [8, 9]) == 2.0  # the last prompt token's entry is dropped
    with pytest.raises(FluencyError, match="not the 1 reply ids"):
        reply_nll(meta, [8])
    with pytest.raises(FluencyError, match="not the 2 reply ids"):
        reply_nll({"input_token_logprobs": meta["input_token_logprobs"][1:]}, [8, 9])
    with pytest.raises(FluencyError, match="null log-prob"):
        reply_nll({"input_token_logprobs": [[None, 7, ""], [None, 8, "a"]]}, [8])
    assert Fluency(3.0, 4).mean_nll == 0.75 and Fluency(0.0, 0).mean_nll == 0.0


def test_exchanges_pair_each_version_s_replies_with_their_questions() -> None:
    questions = held_out_questions()
    answers = [(2 if i % 2 else 1, f"reply {i}") for i in range(len(questions))]
    assert exchanges_of(answers, 2) == [(questions[i], f"reply {i}") for i in range(1, 32, 2)]
    with pytest.raises(ValueError):
        exchanges_of(answers[:3], 1)  # not one reply per question


def test_the_report_shows_the_base_nll(tmp_path) -> None:
    held_out = [HeldOutScore(0, 32, 0.25, base_nll=2.5), HeldOutScore(3, 32, 0.5)]
    stats = per_version([TurnOutcome(0, True)], [(0, 1.0)], held_out)
    assert [s.base_nll for s in stats] == [2.5, None]
    lines = table(stats).splitlines()
    assert lines[0].split()[-2:] == ["base", "NLL"]
    assert lines[1].split()[-1] == "2.500" and lines[2].split()[-1] == "-"
    write_csv(stats, tmp_path / "out.csv")
    rows = (tmp_path / "out.csv").read_text().splitlines()
    assert rows[0].endswith(",held_out_score,held_out_base_nll")
    assert rows[1:] == ["0,1,1.0000,1,1.0000,0.2500,2.5000", "3,0,0.0000,0,,0.5000,"]
