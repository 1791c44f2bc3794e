"""Options the engine would refuse or the gateway cannot honour are refused up front, as OpenAI
errors; top_logprobs are served with the engine's real alternatives."""

from __future__ import annotations

import openai
import pytest

from .helpers import user

pytestmark = pytest.mark.integration

SIDE = {"X-Turn-Type": "side"}


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"top_p": 0}, "top_p"),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            },
            "tool_choice",
        ),
        ({"extra_body": {"top_k": 5}}, "top_k"),  # main turn: top_k is not recorded
    ],
)
def test_refused_options_are_openai_400s(gateway, options, param):
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(
            model="m", messages=[user("x")], max_tokens=2, **options
        )
    assert info.value.param == param and info.value.body["message"]


def test_top_logprobs_come_from_the_engine(gateway):
    for stream in (False, True):
        reply = gateway.openai().chat.completions.create(
            model="m",
            messages=[user("Name a colour.")],
            max_tokens=3,
            logprobs=True,
            top_logprobs=3,
            stream=stream,
            extra_headers=SIDE,
            extra_body={"top_k": 40},  # served on a side turn
        )
        chunks = list(reply) if stream else [reply]
        entries = [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert len(entries) == 3
        for entry in entries:
            assert len(entry.top_logprobs) == 3
            best = max(top.logprob for top in entry.top_logprobs)
            assert entry.logprob <= best + 1e-6
            assert [t.logprob for t in entry.top_logprobs] == sorted(
                (t.logprob for t in entry.top_logprobs), reverse=True
            )
