"""Bad input gets OpenAI-style 400s; a dead engine gets 502/503 JSON; a dead Redis only delays
recording (counted, spooled), and what was served meanwhile is recorded when Redis is back."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.conftest import free_port, start_redis

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration


def post(handle, body: bytes | dict, headers=None) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(
        f"{handle.base_url}/chat/completions", headers=headers or {}, timeout=TIMEOUT, **kwargs
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b"{'messages': [}", None, "not valid JSON"),
        ({"model": "m"}, "messages", "required"),
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "unknown role"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "object"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens", "least"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
            "temperature",
            "between",
        ),
    ],
)
def test_bad_input_is_an_openai_400(gateway, body, param, words):
    reply = post(gateway, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    assert "Traceback" not in reply.text


def test_bad_input_through_the_openai_client(gateway):
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=-1
        )
    assert info.value.status_code == 400 and info.value.param == "max_tokens"


def test_chat_route_methods_and_a_chunked_body(gateway):
    """The chat route is served outside FastAPI's router: other methods still get an OpenAI 405,
    and a body sent in chunks is read whole."""
    reply = httpx.get(f"{gateway.base_url}/chat/completions", timeout=TIMEOUT)
    assert reply.status_code == 405 and reply.json()["error"]["type"] == "invalid_request_error"
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    chunks = iter([body[:10], body[10:30], body[30:]])
    reply = httpx.post(
        f"{gateway.base_url}/chat/completions",
        content=chunks,
        headers={"X-Turn-Type": "side", "Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def engine_down(gateways):
    """A gateway whose engine URL has nothing listening."""
    return gateways.ready(
        gateways.start("engine-down", engine_url=f"http://127.0.0.1:{free_port()}")
    )


def test_engine_down_is_a_clear_503(engine_down):
    for stream in (False, True):
        reply = engine_down.chat([user("hello")], stream=stream)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "engine_unavailable" and "engine" in error["message"]
        assert reply.headers["retry-after"] == "3"
    with pytest.raises(openai.APIStatusError) as info:
        engine_down.openai().chat.completions.create(model="m", messages=[user("x")])
    assert info.value.status_code == 503
    assert engine_down.metric("clawrl_gateway_engine_errors_total", kind="unavailable") >= 3
    ready = httpx.get(f"{engine_down.url}/readyz", timeout=TIMEOUT)
    assert ready.status_code == 503 and ready.json()["engine"]["reachable"] is False


def test_redis_down_serving_continues_and_recording_recovers(gateways, log_dir):
    port = free_port()
    handle = gateways.ready(gateways.start("redis-down", redis_url=f"redis://127.0.0.1:{port}/0"))
    session_id = f"nored-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session_id}
    for stream in (False, True):
        reply = handle.chat([user("still there?")], headers=headers, stream=stream)
        assert reply.status_code == 200, reply.text
    reply = handle.openai().chat.completions.create(model="m", messages=[user("x")], max_tokens=2)
    assert reply.choices[0].message.content is not None
    # The first call that found Redis down failed; it and the calls after it wait in the spool.
    assert handle.metric("clawrl_gateway_recording_failures_total") >= 1
    assert handle.metric("clawrl_gateway_spooled_calls_total") >= 3
    ready = httpx.get(f"{handle.url}/readyz", timeout=TIMEOUT).json()
    assert ready["redis"] is False and ready["status"] == "ready"
    # Redis comes back: the next requests are recorded again.
    redis_child = start_redis(port, log_dir, name=f"redis-late-{port}")
    try:
        handle.redis_url = f"redis://127.0.0.1:{port}/0"
        back = f"back-{uuid.uuid4().hex[:8]}"
        assert handle.chat([user("a")], headers={"X-Session-Id": back}).status_code == 200
        reply = handle.chat([user("b")], headers={"X-Session-Id": back, "X-Session-Done": "1"})
        assert reply.status_code == 200
        turns = handle.wait_turns(back, 2)
        assert [t.turn_index for t in turns] == [0, 1]
        # What was served while Redis was down is recorded too, from the spool.
        assert len(handle.wait_turns(session_id, 1)) == 1  # pending until its next request
    finally:
        redis_child.stop()
