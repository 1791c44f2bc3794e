"""Property-based fuzzing of the HTTP API (hypothesis, a bounded and reproducible set of
examples): whatever a client sends, the gateway answers in time with a 2xx or a 4xx OpenAI
error, never a 5xx, and a turn recorded before the barrage is still finalised with its next
state afterwards."""

from __future__ import annotations

import json
import string
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawrl.common.proto.records_pb2 import FinalizeReason

from .helpers import user

pytestmark = pytest.mark.integration

# Every request must be answered within this (a hang fails the test).
TIMEOUT = httpx.Timeout(30.0)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
text_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}
    ),
    max_size=2,
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=6),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["get_weather", ""]) | json_values,
                    "arguments": st.sampled_from(['{"city": "Paris"}', "{", "[]"]) | json_values,
                }
            ),
        }
    ),
    max_size=2,
)
messages = st.fixed_dictionaries(
    {"role": roles, "content": st.text(max_size=40) | text_parts | json_values},
    optional={"tool_calls": tool_calls | json_values, "tool_call_id": st.text(max_size=6)},
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "retrieval"]),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["get_weather", ""]),
                    "parameters": st.just({"type": "object"}),
                }
            ),
        }
    )
    | json_values,
    max_size=2,
)
numbers = st.floats(-3, 3) | st.integers(-3, 3) | json_values
bodies = st.fixed_dictionaries(
    {
        "messages": st.lists(messages, min_size=0, max_size=4) | json_values,
        # Always bounded (the tiny random model rarely stops by itself): small ints, or junk.
        "max_tokens": st.integers(-2, 5) | st.text(max_size=3) | st.floats(-1, 5),
    },
    optional={
        "temperature": numbers,
        "top_p": numbers,
        "top_k": st.integers(-3, 50) | json_values,
        "n": st.integers(0, 3) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=20) | json_values,
        "seed": st.integers(-5, 2**31) | json_values,
        "logprobs": st.booleans() | json_values,
        "top_logprobs": st.integers(-1, 25) | json_values,
        "tools": tools | json_values,
        "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"])
        | st.just({"type": "function", "function": {"name": "get_weather"}})
        | json_values,
        "presence_penalty": numbers,
        "user": st.text(max_size=8) | json_values,
        "session_done": json_values,
        "turn_type": st.sampled_from(["main", "side", "other"]) | json_values,
        "model": st.text(max_size=8) | json_values,
    },
)
# Header values a client can send at all (no surrounding whitespace: HTTP forbids it).
header_text = st.text(alphabet=string.ascii_letters + string.digits + "-_.", max_size=24)
headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Session-Id": header_text,
        "X-Turn-Type": st.sampled_from(["main", "side", "MAIN", "nope"]),
        "X-Session-Done": st.sampled_from(["true", "0", "yes", "maybe"]),
        "Authorization": st.just("Bearer") | header_text.map(lambda t: f"Bearer {t}".strip()),
    },
)
payloads = st.one_of(
    bodies.map(lambda b: json.dumps(b, allow_nan=True).encode()),
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    st.binary(max_size=40),
)


def send(url: str, payload: bytes, extra: dict[str, str], keep: str) -> httpx.Response:
    """POST one fuzzed payload with its headers, never under the kept session's id."""
    if extra.get("X-Session-Id", "").strip() == keep:
        extra = {**extra, "X-Session-Id": "other"}
    headers = {"Content-Type": "application/json", **extra}
    return httpx.post(url, content=payload, headers=headers, timeout=TIMEOUT)


def check_answer(reply: httpx.Response) -> None:
    assert reply.status_code < 500, reply.text
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        # A stream ends with [DONE], or with an error event when the engine broke it.
        assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), events[-3:]
    else:
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_no_input_gives_a_5xx_a_hang_or_a_lost_turn(gateway):
    keep = f"fuzz-keep-{uuid.uuid4().hex[:8]}"
    opening = [user("remember this turn")]
    first = gateway.chat(opening, headers={"X-Session-Id": keep})
    assert first.status_code == 200

    @settings(
        max_examples=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(payload=payloads, extra=headers)
    def one_request(payload: bytes, extra: dict[str, str]) -> None:
        check_answer(send(f"{gateway.base_url}/chat/completions", payload, extra, keep))

    one_request()
    # The turn recorded before the barrage still gets its next state.
    history = [*opening, first.json()["choices"][0]["message"], user("still here")]
    reply = gateway.chat(history, headers={"X-Session-Id": keep, "X-Session-Done": "1"})
    assert reply.status_code == 200
    turns = gateway.wait_turns(keep, 2)
    assert turns[0].finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(turns[0].next_state_json) == user("still here")
