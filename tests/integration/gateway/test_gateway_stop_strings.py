"""Stop strings on a real gateway and the CPU engine (issue 30): what a client streams, what the
turn records (the text the judge reads, and the assistant message) and what the same request
answers unstreamed are one text, cut before the stop string, also when the stop string spans
two tokens (its first part was sampled before the engine could know it would match)."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration

PROMPT = [user("Tell me a long story about the sea.")]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 24}  # a seed: the same tokens every time


def spanning_stop(tokens: list[str]) -> tuple[str, int]:
    """A stop string made of the end of one sampled token and the start of the next, and where
    it first occurs in the text (so the reply must end there)."""
    text = "".join(tokens)
    end = 0  # where tokens[i] ends in the text
    for i, (first, second) in enumerate(itertools.pairwise(tokens)):
        end += len(first)
        if i < 2 or not (first.isascii() and second.isascii()):
            continue
        if len(first.strip()) < 2 or len(second.strip()) < 2:
            continue
        stop = first[-2:] + second[:2]
        if text.find(stop) == end - 2:
            return stop, end - 2
    pytest.skip(f"no stop string spans two printable tokens in {tokens!r}")


def stream_text(gateway, body: dict, headers: dict) -> str:
    """The concatenated content deltas of a streamed chat completion."""
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body,
                      headers=headers, timeout=TIMEOUT) as reply:  # fmt: skip
        lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: ") :]) for line in lines]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_streamed_recorded_and_whole_text_agree_with_a_stop_string(gateway, session_id):
    probe = gateway.chat(PROMPT, {"X-Turn-Type": "side"}, logprobs=True, **SAMPLED).json()
    tokens = [entry["token"] for entry in probe["choices"][0]["logprobs"]["content"]]
    stop, at = spanning_stop(tokens)
    expected = "".join(tokens)[:at]

    body = {"messages": PROMPT, "stop": [stop], **SAMPLED}
    whole_session, streamed_session = f"{session_id}-whole", f"{session_id}-streamed"
    done = {"X-Session-Done": "true"}
    whole = gateway.chat(PROMPT, {"X-Session-Id": whole_session, **done}, stop=[stop], **SAMPLED)
    assert whole.status_code == 200, whole.text
    streamed = stream_text(gateway, {**body, "stream": True},
                           {"X-Session-Id": streamed_session, **done})  # fmt: skip

    assert whole.json()["choices"][0]["message"]["content"] == expected
    assert whole.json()["choices"][0]["finish_reason"] == "stop"
    assert streamed == expected
    for session in (whole_session, streamed_session):
        (turn,) = gateway.wait_turns(session, 1)
        assert turn.response_text == expected
        assert json.loads(turn.response_message_json)["content"] == expected
