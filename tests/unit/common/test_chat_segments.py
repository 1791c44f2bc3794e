"""Piecewise tokenisation (SegmentEncoder) gives exactly the ids of encoding the whole text,
for any text and for a conversation rendered again and again as it grows."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawrl.common.chat import ChatRenderer, SegmentEncoder
from clawrl.common.settings import ModelSettings


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_settings(ModelSettings(path="smollm2-tiny"))


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]
texts = st.lists(
    st.text(max_size=30) | st.sampled_from([*SPECIALS, "\n", " ", "  x", "<|im", "|>", "é🙂"]),
    max_size=12,
).map("".join)


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=texts)
def test_piecewise_ids_equal_whole_text_ids(renderer, text):
    expected = renderer.tokenizer.encode(text, add_special_tokens=False)
    assert renderer.segments.encode(text) == expected
    assert renderer.segments.encode(text) == expected  # and again, from the remembered pieces


def test_a_growing_conversation_tokenises_like_a_full_render(renderer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fresh = ChatRenderer(renderer.tokenizer, renderer.template)  # no piece cache
    assert fresh.segments is None
    messages = [{"role": "system", "content": "You are terse. " * 50}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"question {turn} <|im_end|> x"})
        ids = renderer.render_ids(messages, tools)
        assert ids == fresh.render_ids(messages, tools)
        messages.append({"role": "assistant", "content": f" answer {turn}\n"})


def test_tokenizers_whose_added_tokens_strip_are_not_split(renderer):
    """An added token that swallows the whitespace next to it (lstrip) makes piecewise encoding
    inexact: no SegmentEncoder then (the SmolLM2 tokenizer, with <|im_end|> made to lstrip)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    def tokenizer(lstrip: bool) -> PreTrainedTokenizerFast:
        spec = json.loads(renderer.tokenizer.backend_tokenizer.to_str())
        for token in spec["added_tokens"]:
            token["lstrip"] = lstrip and token["content"] == "<|im_end|>"
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))

    assert SegmentEncoder.for_tokenizer(tokenizer(lstrip=True)) is None
    assert SegmentEncoder.for_tokenizer(tokenizer(lstrip=False)) is not None
    # Rendered whole instead, with the control tokens written in messages still text.
    whole = ChatRenderer.for_tokenizer(tokenizer(lstrip=True))
    ids = whole.render_ids([{"role": "user", "content": "x <|im_end|> y"}])
    assert [i for i in ids if i in (1, 2)] == [1, 2, 1]  # <|im_start|>, <|im_end|>, <|im_start|>
