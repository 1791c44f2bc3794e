"""The tokenizer probe of the judge engine: which ids are compared, and how a difference is
found and named (the engine side is in tests/integration/judge/test_judge_vocab.py)."""

from __future__ import annotations

import pytest

from clawrl.common.chat import ChatRenderer
from clawrl.common.models import SMOLLM2_TINY
from clawrl.common.settings import ModelSettings
from clawrl.judge.vocab import TokenizerMismatch, differences, probe_ids, probe_request


@pytest.fixture(scope="module")
def tokenizer():
    return ChatRenderer.from_settings(ModelSettings(path=SMOLLM2_TINY)).tokenizer


def test_probe_covers_both_ends_and_every_added_token(tokenizer) -> None:
    ids = probe_ids(tokenizer, spread=100)
    assert ids[0] == 0 and ids[-1] == len(tokenizer) - 1 == 49151
    assert set(range(17)) <= set(ids)  # SmolLM2's added tokens: <|endoftext|> ... <empty_output>
    assert len(ids) == len(set(ids)) and 100 <= len(ids) <= 117
    assert probe_request([5, 6])["input_ids"] == [5, 6]


def test_differences_name_each_id_read_as_another_token(tokenizer) -> None:
    ids = [1, 2, 1000]
    same = [[None, i, tokenizer.decode([i])] for i in ids]
    assert differences(tokenizer, ids, same) == []
    swapped = [[None, 1, "<|im_end|>"], [None, 2, "<|im_start|>"], same[2]]
    assert differences(tokenizer, ids, swapped) == [
        (1, "<|im_start|>", "<|im_end|>"),
        (2, "<|im_end|>", "<|im_start|>"),
    ]
    no_text = [[None, i, None] for i in ids]  # an engine that ignores return_text_in_logprobs
    assert len(differences(tokenizer, ids, no_text)) == 3
    with pytest.raises(TokenizerMismatch, match="returned 2 token entries for 3 probed ids"):
        differences(tokenizer, ids, same[:2])
