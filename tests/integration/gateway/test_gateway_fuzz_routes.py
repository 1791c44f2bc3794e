"""Property-based fuzzing of /v1/responses, /v1/messages, /v1/feedback and /v1/outcomes
(hypothesis, bounded and reproducible; /v1/chat/completions is test_gateway_fuzz.py's): whatever a
client sends, the gateway answers in time with a 2xx or a 4xx in the route's own error shape
(OpenAI's on /v1/responses, /v1/feedback and /v1/outcomes, Anthropic's on /v1/messages), never a
5xx, and a turn recorded before the barrage is still finalised with its next state afterwards.

Derandomized by default; CLAWRL_FUZZ_SEED=N runs the examples of seed N instead, and
CLAWRL_FUZZ_EXAMPLES the number of examples per route (default 100)."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from clawrl.common.proto.records_pb2 import FinalizeReason

from .helpers import GatewayHandle, user
from .test_gateway_fuzz import header_text, json_values, scalars, send
from .test_gateway_fuzz import headers as chat_headers

pytestmark = pytest.mark.integration

SEED = os.environ.get("CLAWRL_FUZZ_SEED") or None
EXAMPLES = int(os.environ.get("CLAWRL_FUZZ_EXAMPLES", "100"))
TIMEOUT = httpx.Timeout(30.0)  # every request is answered within this (a hang fails the test)
ROUTES = ("/v1/responses", "/v1/messages", "/v1/feedback", "/v1/outcomes")
INCLUDES = ["message.output_text.logprobs", "reasoning.encrypted_content"]

junk = json_values


def usually(good: st.SearchStrategy, bad: st.SearchStrategy = junk, odds: int = 6):
    """`good`, else one time in `odds` `bad` (of the wrong type or shape): most requests are
    well-formed enough to reach the engine, and every field is sometimes wrong."""
    return st.sampled_from(range(odds)).flatmap(lambda i: bad if i == odds - 1 else good)


def sometimes(body: st.SearchStrategy, extra: st.SearchStrategy) -> st.SearchStrategy:
    """The body, with (one time in six) `extra`'s fields, which get it refused, merged in."""
    return st.tuples(body, usually(st.just({}), extra)).map(lambda both: {**both[0], **both[1]})


# Junk that is never an integer: an integer limit is kept small, or the tiny random model (which
# rarely stops by itself) would generate up to the context window.
not_int = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=False),
    st.text(max_size=4),
    st.lists(scalars, max_size=2),
    st.dictionaries(st.text(max_size=4), scalars, max_size=2),
)
limits = usually(st.integers(1, 4), st.integers(-2, 0) | not_int, odds=10)
numbers = usually(st.floats(0.05, 1) | st.just(1), st.floats(-3, 3) | junk)
texts = usually(st.text(max_size=20))
ids = usually(st.text(max_size=6))
names = usually(st.sampled_from(["get_weather", "search"]), st.just("") | junk)
arguments = usually(st.sampled_from(['{"city": "Paris"}', "{", "[]"]))
booleans = usually(st.booleans())
stops = usually(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5))
session_keys = {
    "session_id": usually(st.text(max_size=8)),
    "turn_type": usually(st.sampled_from(["main", "side"]), st.just("x") | junk),
    "session_done": booleans,
}
schema = st.just({"type": "object", "properties": {"city": {"type": "string"}}})

# --- /v1/responses ----------------------------------------------------------------------------
parts = usually(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "text"]), "text": texts}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["refusal", "input_image"]) | junk},
        optional={"refusal": texts, "text": texts},
    )
    | junk,
)
contents = usually(st.text(max_size=30) | st.lists(parts, max_size=2))
items = usually(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": usually(st.sampled_from(["user", "assistant", "system", "developer"])),
                "content": contents,
            },
            optional={"type": usually(st.just("message"))},
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": ids,
                "name": names,
                "arguments": arguments,
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": ids, "output": contents}
        ),
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["item_reference", "reasoning", "web_search_call"]) | junk},
        optional={"id": st.text(max_size=6)},
    )
    | junk,
)
response_tools = st.lists(
    usually(
        st.fixed_dictionaries(
            {"type": usually(st.just("function"), st.just("web_search") | junk), "name": names},
            optional={"parameters": usually(schema), "description": texts, "strict": booleans},
        )
    ),
    max_size=2,
)


def responses_bodies(previous_ids: list[str]) -> st.SearchStrategy[dict]:
    body = st.fixed_dictionaries(
        {"input": usually(st.text(max_size=40) | st.lists(items, min_size=1, max_size=4))},
        optional={
            # null (or none): the gateway's default_max_tokens, small on the fuzzed gateway.
            "max_output_tokens": st.none() | limits,
            "instructions": texts,
            "model": texts,
            "stream": booleans,
            "store": booleans,
            "tools": usually(response_tools),
            "tool_choice": usually(
                st.sampled_from(["auto", "none"]),
                st.sampled_from(["required", "bogus", {"type": "function", "name": "x"}]) | junk,
            ),
            "previous_response_id": usually(st.sampled_from(previous_ids), st.text(max_size=8)),
            "temperature": numbers,
            "top_p": numbers,
            "top_logprobs": usually(st.integers(0, 5), st.integers(-1, 25) | junk),
            "include": usually(st.lists(st.sampled_from(INCLUDES), max_size=2)),
            "parallel_tool_calls": booleans,
            "metadata": usually(st.dictionaries(st.text(max_size=4), texts, max_size=2)),
            "user": texts,
            "stop": stops,
            "text": usually(st.just({"format": {"type": "text"}})),
            "reasoning": usually(st.just({"effort": None})),
            "truncation": usually(st.just("disabled"), st.just("auto") | junk),
            **session_keys,
        },
    )
    refused = st.fixed_dictionaries(
        {},
        optional={
            "background": booleans,
            "conversation": junk,
            "prompt": junk,
            "max_tool_calls": junk,
            "text": st.just({"format": {"type": "json_schema"}}),
            "include": st.just(["file_search_call.results"]),
        },
    )
    return sometimes(body, refused)


# --- /v1/messages -----------------------------------------------------------------------------
text_blocks = usually(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
blocks = usually(
    st.one_of(
        text_blocks,
        st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": ids, "name": names, "input": usually(schema)}
        ),
        st.fixed_dictionaries(
            {"type": st.just("tool_result"), "tool_use_id": ids},
            optional={
                "content": usually(st.text(max_size=10) | st.lists(text_blocks, max_size=2)),
                "is_error": booleans,
            },
        ),
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "document", "thinking", "server_tool_use"]) | junk},
        optional={"text": st.text(max_size=6)},
    )
    | junk,
)
anthropic_messages = st.fixed_dictionaries(
    {
        "role": usually(st.sampled_from(["user", "assistant"]), st.just("system") | junk),
        "content": usually(st.text(max_size=30) | st.lists(blocks, max_size=3)),
    }
)
anthropic_tools = st.lists(
    usually(
        st.fixed_dictionaries(
            {"name": names, "input_schema": usually(schema)},
            optional={
                "type": usually(st.just("custom"), st.just("web_search_20250305") | junk),
                "description": texts,
            },
        )
    ),
    max_size=2,
)
messages_bodies = sometimes(
    st.fixed_dictionaries(
        {
            "model": usually(st.just("smollm2-tiny"), odds=10),
            "max_tokens": limits,
            "messages": usually(st.lists(anthropic_messages, min_size=1, max_size=3), odds=10),
        },
        optional={
            "system": usually(st.text(max_size=20) | st.lists(text_blocks, max_size=2)),
            "stream": booleans,
            "temperature": numbers,
            "top_p": numbers,
            "stop_sequences": stops,
            "tools": usually(anthropic_tools),
            "tool_choice": usually(
                st.sampled_from([{"type": "auto"}, {"type": "none"}]),
                st.sampled_from([{"type": "any"}, {"type": "tool", "name": "x"}]) | junk,
            ),
            "metadata": usually(st.fixed_dictionaries({}, optional={"user_id": texts})),
            "thinking": usually(st.just({"type": "disabled"})),
            **session_keys,
        },
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "top_k": usually(st.integers(1, 50), st.integers(-2, 0)),  # side turns only
            "thinking": st.just({"type": "enabled", "budget_tokens": 1024}),
            "mcp_servers": junk,
            "container": junk,
            "output_config": st.sampled_from([{"effort": "low"}, {"format": {}}]) | junk,
        },
    ),
)


# --- /v1/feedback -----------------------------------------------------------------------------
def feedback_bodies(session_ids: list[str], response_ids: list[str]) -> st.SearchStrategy[dict]:
    response_id = usually(st.sampled_from(response_ids), st.text(max_size=8))
    session_id = usually(st.sampled_from(session_ids), st.text(max_size=8))
    turn_index = usually(st.integers(0, 1), st.integers(-2, 3) | junk)
    target = usually(
        st.fixed_dictionaries({"response_id": response_id})
        | st.fixed_dictionaries({"session_id": session_id}, optional={"turn_index": turn_index}),
        st.fixed_dictionaries(
            {},
            optional={
                "response_id": response_id,
                "session_id": session_id,
                "turn_index": turn_index,
            },
        ),
    )
    reward = usually(st.floats(-1, 1) | st.integers(-1, 1), st.floats(1.01, 9) | junk)
    thumbs = usually(st.sampled_from(["up", "down"]), st.just("sideways") | junk)
    rating = usually(
        st.fixed_dictionaries({"reward": reward}, optional={"thumbs": thumbs, "comment": texts})
        | st.fixed_dictionaries({"thumbs": thumbs}, optional={"comment": texts})
        | st.fixed_dictionaries({"comment": texts}),
        st.fixed_dictionaries({}, optional={"comment": st.just(" ")}),
    )
    ids = st.fixed_dictionaries({}, optional={"feedback_id": usually(header_text), "user": texts})
    # Not fields of the API (a 400): what a client might guess.
    guessed = st.fixed_dictionaries({}, optional={"turn_id": junk, "score": junk})
    both = st.tuples(target, rating, ids).map(lambda b: {**b[0], **b[1], **b[2]})
    return sometimes(both, guessed)


# --- /v1/outcomes -----------------------------------------------------------------------------
def outcome_bodies(session_ids: list[str]) -> st.SearchStrategy[dict]:
    outcome = usually(
        st.floats(0, 1) | st.integers(0, 1), st.floats(1.01, 9) | st.floats(-9, -0.01) | junk
    )
    body = st.fixed_dictionaries(
        {"outcome": outcome},
        optional={
            "session_id": usually(st.sampled_from(session_ids), st.text(max_size=8)),
            "task_id": texts,
            "detail": texts,
            "user": texts,
        },
    )
    # Not fields of the API (a 400): what a client might guess.
    return sometimes(body, st.fixed_dictionaries({}, optional={"reward": junk, "score": junk}))


# The chat fuzzer's session and key headers, with Anthropic's and feedback's own.
headers = st.tuples(
    chat_headers,
    st.fixed_dictionaries(
        {},
        optional={
            "x-api-key": header_text,
            "anthropic-version": st.sampled_from(["2023-06-01", "bogus"]),
            "Idempotency-Key": header_text,
        },
    ),
).map(lambda both: {**both[0], **both[1]})


def payloads(bodies: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """Mostly the route's bodies; sometimes any JSON, or not JSON at all."""
    return st.sampled_from(["body", "body", "body", "json", "bytes"]).flatmap(
        lambda kind: {
            "body": bodies.map(lambda b: json.dumps(b, allow_nan=True).encode()),
            "json": junk.map(lambda v: json.dumps(v, allow_nan=True).encode()),
            "bytes": st.binary(max_size=40),
        }[kind]
    )


# --- what a reply must be ---------------------------------------------------------------------
def events(reply: httpx.Response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of an SSE body that names its events."""
    out = []
    for block in reply.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def openai_error(reply: httpx.Response) -> None:
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], reply.text


def check_responses(reply: httpx.Response) -> None:
    if reply.status_code >= 400:
        return openai_error(reply)
    if reply.headers["content-type"].startswith("text/event-stream"):
        kinds = [kind for kind, _ in events(reply)]
        assert kinds[0] == "response.created", kinds
        # It ends with the response, or with response.failed when the engine broke it.
        assert kinds[-1] in ("response.completed", "response.incomplete", "response.failed")
    else:
        body = reply.json()
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")


def check_messages(reply: httpx.Response) -> None:
    if reply.status_code >= 400:
        body = reply.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, reply.text
        assert body["error"]["message"]
        return
    if reply.headers["content-type"].startswith("text/event-stream"):
        kinds = [kind for kind, _ in events(reply)]
        assert kinds[0] == "message_start" and kinds[-1] in ("message_stop", "error"), kinds
    else:
        body = reply.json()
        assert body["type"] == "message" and body["role"] == "assistant", body


def check_feedback(reply: httpx.Response) -> None:
    if reply.status_code >= 400:
        return openai_error(reply)
    body = reply.json()
    assert body["object"] == "feedback" and body["status"] in ("accepted", "late"), body


def check_outcome(reply: httpx.Response) -> None:
    if reply.status_code >= 400:
        return openai_error(reply)
    body = reply.json()
    assert body["object"] == "episode.outcome" and body["status"] in ("accepted", "late"), body


CHECKS = {"/v1/responses": check_responses, "/v1/messages": check_messages,
          "/v1/feedback": check_feedback, "/v1/outcomes": check_outcome}  # fmt: skip


@pytest.fixture(scope="module")
def fuzzed(gateways) -> GatewayHandle:
    """A default gateway whose default completion limit is small: a request that sets none
    (max_output_tokens null) is answered as quickly as one that sets a small one."""
    return gateways.ready(gateways.start("fuzz-routes", CLAWRL_SERVING__DEFAULT_MAX_TOKENS="4"))


def respond(gateway: GatewayHandle, body: dict, session_id: str, **extra: str) -> httpx.Response:
    reply = httpx.post(f"{gateway.base_url}/responses", json={"max_output_tokens": 4, **body},
                       headers={"X-Session-Id": session_id, **extra}, timeout=TIMEOUT)  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply


def test_no_request_to_the_other_routes_gives_a_5xx_a_hang_or_a_lost_turn(fuzzed):
    keep = f"fuzz-keep-{uuid.uuid4().hex[:8]}"
    first = respond(fuzzed, {"input": "remember this turn"}, keep)
    # Real ids for the fuzzed requests to continue and rate (never the kept session's).
    target = f"fuzz-target-{uuid.uuid4().hex[:8]}"
    rated = respond(fuzzed, {"input": "rate me"}, target).json()["id"]
    played = f"fuzz-episode-{uuid.uuid4().hex[:8]}"  # an episode, for outcomes to be accepted
    respond(fuzzed, {"input": "play me"}, played, **{"X-Episode": "true"})
    strategies = {
        "/v1/responses": payloads(responses_bodies([rated])),
        "/v1/messages": payloads(messages_bodies),
        "/v1/feedback": payloads(feedback_bodies([target], [rated])),
        "/v1/outcomes": payloads(outcome_bodies([played])),
    }
    sent: Counter[tuple[str, int]] = Counter()

    def barrage(route: str):
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=SEED is None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(payload=strategies[route], extra=headers)
        def one_request(payload: bytes, extra: dict[str, str]) -> None:
            reply = send(f"{fuzzed.url}{route}", payload, extra, keep)
            sent[route, reply.status_code // 100] += 1
            assert reply.status_code < 500, (route, payload, extra, reply.text)
            CHECKS[route](reply)

        return one_request if SEED is None else seed(int(SEED))(one_request)

    try:
        for route in ROUTES:
            barrage(route)()
    finally:
        for route in ROUTES:
            counts = {f"{c}xx": n for (r, c), n in sorted(sent.items()) if r == route}
            print(f"fuzz seed={SEED or 'derandomized'} {route}: {counts}")
    # The turn recorded before the barrage still gets its next state.
    previous = first.json()["id"]
    respond(fuzzed, {"input": "still here", "previous_response_id": previous}, keep,
            **{"X-Session-Done": "1"})  # fmt: skip
    turns = fuzzed.wait_turns(keep, 2)
    assert turns[0].finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(turns[0].next_state_json) == user("still here")
