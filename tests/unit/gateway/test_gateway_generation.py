"""Reading engine replies: cumulative (SGLang default) and incremental stream events."""

import pytest

from clawrl.gateway.errors import EngineBadReply
from clawrl.gateway.generation import Generation


def event(text, ids, n=None, finish=None):
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "prompt_tokens": 3,
            "completion_tokens": n if n is not None else len(ids),
            "finish_reason": finish,
            "output_token_logprobs": [[-0.5 * i, i, None] for i in ids],
        },
    }


def test_cumulative_events():
    g = Generation()
    assert g.update(event("He", [1])) == "He"
    assert g.update(event("Hello", [1, 2])) == "llo"
    assert g.update(event("Hello!", [1, 2, 3], finish={"type": "stop", "matched": 2})) == "!"
    assert g.ids == [1, 2, 3] and g.logprobs == [-0.5, -1.0, -1.5] and g.finish == "stop"


def test_incremental_events():
    g = Generation()
    assert g.update(event("He", [1], n=1)) == "He"
    assert g.update(event("llo", [2], n=2)) == "llo"
    assert g.update(event("!", [3], n=3, finish={"type": "length"})) == "!"
    assert g.ids == [1, 2, 3] and g.text == "Hello!" and g.finish == "length"


def test_abort_and_malformed_replies_are_engine_errors():
    with pytest.raises(EngineBadReply):
        Generation().update(event("x", [1], finish={"type": "abort"}))
    with pytest.raises(EngineBadReply):
        Generation().update({"text": "x", "meta_info": {}})
