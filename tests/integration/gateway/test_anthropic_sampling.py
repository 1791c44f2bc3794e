"""Sampling parameters from the official `anthropic` client (2.x) through /v1/messages.

The client dropped `temperature`, `top_p` and `top_k` from `messages.create` and `.stream`
(since 1.0; a `TypeError` before any request is sent): it is the client, not the gateway, that
refuses them. The client's own way is `extra_body`, which it writes into the JSON as is; the
gateway must then hand them to the engine and record them with the turn."""

from __future__ import annotations

import anthropic
import pytest

from .test_gateway_apis import ScriptedEngine, anthropic_client

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine(scripted) -> ScriptedEngine:
    return scripted[0]  # shared with test_gateway_apis (conftest.py)


@pytest.fixture(scope="module")
def scripted_gateway(scripted):
    return scripted[1]


def test_the_client_refuses_sampling_keywords_before_sending(scripted_gateway, engine):
    client = anthropic_client(scripted_gateway)
    sent = len(engine.requests)
    for param in ("temperature", "top_p", "top_k"):
        with pytest.raises(TypeError, match=param):
            client.messages.create(model="m", max_tokens=4, messages=QUESTION, **{param: 0.5})
    assert len(engine.requests) == sent


@pytest.mark.parametrize("stream", [False, True])
def test_sampling_params_in_extra_body_reach_the_engine_and_the_turn(
    scripted_gateway, engine, session_id, stream
):
    engine.script("Blue")
    client = anthropic_client(scripted_gateway)
    request = {
        "model": "m",
        "max_tokens": 4,
        "messages": QUESTION,
        "extra_body": {"temperature": 0.25, "top_p": 0.5},
        "extra_headers": {"X-Session-Id": session_id, "X-Session-Done": "true"},
    }
    if stream:
        with client.messages.stream(**request) as events:
            text = events.get_final_text()
    else:
        text = "".join(block.text for block in client.messages.create(**request).content)
    assert text == "Blue"
    params = engine.requests[-1]["sampling_params"]
    assert (params["temperature"], params["top_p"]) == (0.25, 0.5)
    (turn,) = scripted_gateway.wait_turns(session_id, 1)
    assert (turn.temperature, turn.top_p) == (0.25, 0.5)


def test_top_k_in_extra_body_reaches_the_engine_on_a_side_turn(scripted_gateway, engine):
    engine.script("Red")
    anthropic_client(scripted_gateway).messages.create(
        model="m",
        max_tokens=4,
        messages=QUESTION,
        extra_body={"temperature": 0.0, "top_k": 7},
        extra_headers={"X-Turn-Type": "side"},
    )
    params = engine.requests[-1]["sampling_params"]
    assert (params["temperature"], params["top_k"]) == (0.0, 7)


def test_top_k_on_a_main_turn_is_an_anthropic_400(scripted_gateway):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(scripted_gateway).messages.create(
            model="m", max_tokens=4, messages=QUESTION, extra_body={"top_k": 7}
        )
    assert "top_k" in str(info.value)
