"""The logprob PRM's pure parts, worked by hand: which ids answer yes/no, and the verdict from
one position's top log-probs."""

from __future__ import annotations

import math

import pytest

from clawrl.common.chat import ChatRenderer
from clawrl.common.settings import ModelSettings
from clawrl.common.sglang_client import EngineRequestError
from clawrl.judge.verdicts import (
    LogprobVerdict,
    YesNoIds,
    first_token_top,
    logprob_request,
    tokenizer_yes_no_ids,
    verdict_from_top,
    yes_no_ids,
)

IDS = YesNoIds(yes=frozenset({1, 4}), no=frozenset({2, 5}))


def test_yes_no_ids_match_the_words_in_any_case_and_spacing() -> None:
    pieces = ["a", " Yes", "no", "yes!", "NO ", "know", "Yesterday", "\tyes", "n", "o"]
    assert yes_no_ids(pieces) == YesNoIds(frozenset({1, 7}), frozenset({2, 4}))


def test_yes_no_ids_refuse_a_tokenizer_without_a_no_token() -> None:
    with pytest.raises(ValueError, match="no single token for no"):
        yes_no_ids(["yes", "maybe"])


def test_the_tiny_models_tokenizer_gives_its_yes_and_no_tokens() -> None:
    tokenizer = ChatRenderer.from_settings(ModelSettings(path="smollm2-tiny")).tokenizer
    ids = tokenizer_yes_no_ids(tokenizer)
    for word in ("Yes", " yes", "yes"):
        (token,) = tokenizer.encode(word, add_special_tokens=False)
        assert token in ids.yes
    for word in ("No", " no"):
        (token,) = tokenizer.encode(word, add_special_tokens=False)
        assert token in ids.no
    assert all(tokenizer.decode([i]).strip().lower() == "yes" for i in ids.yes)
    assert all(tokenizer.decode([i]).strip().lower() == "no" for i in ids.no)


def top(*pairs: tuple[float, int]) -> list[list]:
    """Entries as SGLang returns them: [logprob, token_id, text]."""
    return [[math.log(p), token, None] for p, token in pairs]


def test_the_yes_share_decides_against_the_margin() -> None:
    # p_yes = 0.5 + 0.1 = 0.6, p_no = 0.2: share 0.75 > 0.7 -> +1
    verdict = verdict_from_top(top((0.5, 1), (0.2, 2), (0.1, 4), (0.15, 9)), IDS, 0.2)
    assert verdict.score == 1
    assert verdict.p_yes == pytest.approx(0.6) and verdict.p_no == pytest.approx(0.2)
    assert verdict.yes_share == pytest.approx(0.75)
    # share 0.2 / (0.2 + 0.6) = 0.25 < 0.3 -> -1
    assert verdict_from_top(top((0.2, 1), (0.4, 2), (0.2, 5)), IDS, 0.2).score == -1
    # share 0.6 within 0.5 +- 0.2 -> 0; with margin 0.05 it is +1
    assert verdict_from_top(top((0.3, 1), (0.2, 2)), IDS, 0.2).score == 0
    assert verdict_from_top(top((0.3, 1), (0.2, 2)), IDS, 0.05).score == 1
    # exactly even with margin 0: neither side is above the other
    assert verdict_from_top(top((0.3, 1), (0.3, 2)), IDS, 0.0).score == 0


def test_only_one_side_seen_is_a_verdict_for_that_side() -> None:
    verdict = verdict_from_top(top((0.01, 5), (0.9, 7)), IDS, 0.2)
    assert verdict.score == -1 and verdict.yes_share == 0.0 and verdict.p_yes == 0.0


def test_no_yes_or_no_token_among_the_top_is_no_verdict() -> None:
    verdict = verdict_from_top(top((0.6, 7), (0.3, 8)), IDS, 0.2)
    assert verdict == LogprobVerdict(None, 0.0, 0.0)
    assert verdict.outcome == "invalid" and verdict.yes_share is None
    assert LogprobVerdict(None, 0.0, 0.0, error="rejected").outcome == "failed"
    assert LogprobVerdict(0, 0.3, 0.3).outcome == "valid"
    assert LogprobVerdict(1, 0.8, 0.1).record() == {
        "score": 1, "p_yes": 0.8, "p_no": 0.1, "yes_share": pytest.approx(0.8 / 0.9)
    }  # fmt: skip


def test_the_request_reads_one_greedy_token_with_its_top_logprobs() -> None:
    payload = logprob_request([5, 6, 7], 20)
    assert payload["input_ids"] == [5, 6, 7] and payload["return_logprob"] is True
    assert payload["top_logprobs_num"] == 20
    assert payload["sampling_params"]["max_new_tokens"] == 1
    assert payload["sampling_params"]["temperature"] == 0.0


def test_first_token_top_reads_the_first_position_or_refuses() -> None:
    meta = {"output_top_logprobs": [[[-0.1, 1, None], [-2.5, 2, None]]]}
    assert first_token_top(meta) == [[-0.1, 1, None], [-2.5, 2, None]]
    for bad in ({}, {"output_top_logprobs": []}, {"output_top_logprobs": [None]}):
        with pytest.raises(EngineRequestError, match="no top log-probs"):
            first_token_top(bad)
