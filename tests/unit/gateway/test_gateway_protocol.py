"""Request validation: OpenAI-style 400s with the offending param, session keys stripped."""

import json

import pytest

from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.protocol import parse_chat_request

USER = {"role": "user", "content": "hi"}


def parse(body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_chat_request(raw, headers or {})


def bad(body, param=None, match=None):
    with pytest.raises(InvalidRequest) as info:
        parse(body)
    if param is not None:
        assert info.value.param == param
    if match is not None:
        assert match in info.value.message
    return info.value


def test_minimal_request_defaults():
    req = parse({"messages": [USER]})
    assert req.messages == [USER] and req.render_messages == [USER]
    assert not req.stream and req.max_tokens is None and req.temperature == 1.0
    assert req.session.session_id is None and req.session.turn_type is None


def test_standard_fields_real_clients_send_are_accepted():
    req = parse(
        {
            "model": "anything",
            "messages": [{"role": "developer", "content": "be brief"}, USER],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.2,
            "top_p": 0.9,
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "stop": "END",
            "seed": 3,
            "n": 1,
            "user": "u",
            "metadata": {"k": "v"},
            "parallel_tool_calls": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0,
            "response_format": {"type": "text"},
            "tool_choice": "auto",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "logprobs": False,
        }
    )
    assert req.include_usage and req.max_tokens == 7 and req.stop == ["END"] and req.seed == 3
    assert req.render_messages[0]["role"] == "system"
    assert req.parse_tool_calls


def test_text_parts_are_joined():
    req = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})
    assert req.render_messages[0]["content"] == "a"


def test_session_keys_from_headers_win_and_body_keys_are_stripped():
    body = {"messages": [USER], "session_id": "body", "turn_type": "side", "session_done": True}
    req = parse(body, {"x-session-id": "hdr", "x-turn-type": "MAIN"})
    assert req.session.session_id == "hdr" and req.session.turn_type == "main"
    assert req.session.session_done
    req = parse({"messages": [USER], "session_id": "b", "turn_type": "side"})
    assert req.session.session_id == "b" and req.session.turn_type == "side"
    assert parse({"messages": [USER]}, {"x-session-done": "false"}).session.session_done is False


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"", None, "empty"),
        (b"[1, 2]", None, "JSON object"),
        ({}, "messages", "required"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": "hi"}, "messages", "array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "unknown role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "unknown role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
            "text content",
        ),
        ({"messages": [USER], "max_tokens": -1}, "max_tokens", "at least 1"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"messages": [USER], "max_tokens": "9"}, "max_tokens", "integer"),
        ({"messages": [USER], "temperature": 3}, "temperature", "between"),
        ({"messages": [USER], "top_p": -0.1}, "top_p", "between"),
        ({"messages": [USER], "n": 2}, "n", "n=1"),
        ({"messages": [USER], "stop": [1]}, "stop", None),
        ({"messages": [USER], "stream": "yes"}, "stream", "boolean"),
        ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0]", None),
        ({"messages": [USER], "tool_choice": "sometimes"}, "tool_choice", None),
        ({"messages": [USER], "turn_type": "bogus"}, "turn_type", "main"),
        # Not a header value (the reply's X-Session-Id): a 500, or no answer, before.
        ({"messages": [USER], "session_id": "\u0100"}, "session_id", "Latin-1"),
        ({"messages": [USER], "session_id": "a\nb"}, "session_id", "X-Session-Id"),
        ({"messages": [USER], "session_id": "\x00"}, "session_id", "printable"),
    ],
)
def test_bad_requests(body, param, match):
    bad(body, param, match)


def test_assistant_tool_calls_are_checked():
    msg = {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": 1}}]}
    bad({"messages": [USER, msg]}, "messages[1].tool_calls[0].function")


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        # SGLang refuses top_p = 0: the gateway refuses it first, as a 400 naming the field.
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_k": 0}, "top_k", "-1"),
        ({"top_k": "5"}, "top_k", "integer"),
        ({"temperature": "0.5"}, "temperature", "number"),
        ({"tool_choice": "required"}, "tool_choice", "'required' is not supported"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "named function is not supported",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "requires logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "between 0 and 20"),
        ({"stop": ["a"] * 17}, "stop", "at most 16"),
    ],
)
def test_ranges_and_unsupported_options_are_refused(extra, param, match):
    bad({"messages": [USER], **extra}, param, match)


def test_top_k_and_top_logprobs_are_read():
    req = parse({"messages": [USER], "top_k": 20, "logprobs": True, "top_logprobs": 2})
    assert (req.top_k, req.logprobs, req.top_logprobs) == (20, True, 2)
    assert parse({"messages": [USER]}).top_k == -1


def test_the_caller_scope_comes_from_the_key_and_user_never_the_key_itself():
    a = parse({"messages": [USER]}, {"authorization": "Bearer sk-a"}).session.scope
    b = parse({"messages": [USER]}, {"authorization": "Bearer sk-b"}).session.scope
    u = parse({"messages": [USER], "user": "u1"}, {"authorization": "Bearer sk-a"}).session.scope
    assert len({a, b, u}) == 3 and "sk-a" not in a
    assert parse({"messages": [USER]}).session.scope == "-"
