"""Incremental detokenisation gives the same text as decoding the whole output at once."""

import random

import pytest
from transformers import AutoTokenizer

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelSettings(path="smollm2-tiny")))


def decoder(tokenizer, calls: list[int]):
    def decode(ids: list[int], skip: bool) -> str:
        calls.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=skip)

    return decode


@pytest.mark.parametrize("skip", [True, False])
def test_pushed_one_by_one_equals_a_whole_decode(tokenizer, skip):
    text = "Grüße, 世界! 🎉🎉 naïve café — ok\n\tdef f(x): return x**2  # ünïcödé"
    ids = [*tokenizer.encode(text), 0, 1, 2]  # special tokens at the end
    rng = random.Random(0)
    ids += [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    detok = IncrementalDetokenizer(decoder(tokenizer, []), skip)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    # an emoji split over several byte tokens is never shown half-done
    assert all("\ufffd" not in piece for piece in pieces[: len(tokenizer.encode(text))])


def test_each_step_decodes_a_short_window_not_the_whole_output(tokenizer):
    calls: list[int] = []
    ids = tokenizer.encode("word " * 2000)
    detok = IncrementalDetokenizer(decoder(tokenizer, calls), True)
    for i in ids:
        detok.push([i])
    assert detok.text == tokenizer.decode(ids)
    assert max(calls) <= 4
