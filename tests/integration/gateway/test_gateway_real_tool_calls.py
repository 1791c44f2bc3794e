"""A real tool-call round trip with the real SmolLM2-135M-Instruct: greedy decoding after a few
worked examples makes it answer with `<tool_call>`, which the gateway returns as OpenAI
`tool_calls` (whole and streamed); the tool result sent back is the turn's next state."""

from __future__ import annotations

import json

import pytest

from clawrl.common.proto.records_pb2 import FinalizeReason

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REAL = "SmolLM2-135M-Instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def few_shot() -> list[dict]:
    messages = [
        {"role": "system", "content": "You answer weather questions by calling get_weather."}
    ]
    for i, city in enumerate(["London", "Berlin", "Rome"]):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": f"call_{i}",
                "content": json.dumps({"temp_c": 20 + i}),
            },
            {"role": "assistant", "content": f"It is {20 + i} degrees in {city}."},
        ]
    return [*messages, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def real_gateway(gateways, engine_factory):
    url = engine_factory(REAL)
    return gateways.ready(gateways.start("real", engine_url=url, CLAWRL_MODEL__PATH=REAL))


def test_real_model_tool_call_round_trip(real_gateway, session_id):
    client = real_gateway.openai()
    history = few_shot()
    reply = client.chat.completions.create(
        model=REAL,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=40,
        extra_headers={"X-Session-Id": session_id},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The same request streamed: the call arrives as delta.tool_calls.
    stream = client.chat.completions.create(
        model=REAL,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=40,
        stream=True,
        extra_headers={"X-Turn-Type": "side"},
    )
    chunks = list(stream)
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_weather"]
    assert json.loads(streamed[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The tool result goes back; it is the next state of the recorded tool-call turn.
    history += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 24})},
    ]
    client.chat.completions.create(
        model=REAL,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=20,
        extra_headers={"X-Session-Id": session_id, "X-Session-Done": "true"},
    )
    turns = real_gateway.wait_turns(session_id, 2)
    first = turns[0]
    assert first.finish_reason == "tool_calls"
    assert json.loads(first.response_message_json)["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )
    assert "<tool_call>" in first.response_text or first.response_text.strip().startswith("{")
    assert first.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(first.next_state_json)["role"] == "tool"
    assert not first.history_mismatch
    assert turns[1].finalize_reason == FinalizeReason.FINALIZE_REASON_SESSION_DONE
