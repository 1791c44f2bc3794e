"""What a request may ask of the gateway by default (the `main` gateway runs the default
settings): a body over serving.max_body_bytes (8 MiB) is a 413 in the API's error shape, counted,
and a request that sets no completion limit gets serving.default_max_tokens (4096) on every
route, not the rest of the context window."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration

LIMIT = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 4096


def oversized_body() -> bytes:
    return b'{"messages": [{"role": "user", "content": "' + b"x" * LIMIT + b'"}]}'


def oversized(gateway, route: str) -> float:
    return gateway.metric("clawrl_gateway_oversized_requests_total", route=route)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(
    "route", ["/v1/chat/completions", "/v1/responses", "/v1/feedback", "/v1/outcomes"]
)
def test_a_body_over_the_limit_is_an_openai_413(gateway, route, chunked):
    body = oversized_body()
    before = oversized(gateway, route)
    content = iter([body[: LIMIT // 2], body[LIMIT // 2 :]]) if chunked else body
    reply = httpx.post(f"{gateway.url}{route}", content=content, timeout=TIMEOUT,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert reply.status_code == 413, reply.text[:200]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(LIMIT) in error["message"] and "serving.max_body_bytes" in error["message"]
    assert oversized(gateway, route) == before + 1


def test_a_body_over_the_limit_is_an_anthropic_413(gateway):
    before = oversized(gateway, "/v1/messages")
    reply = httpx.post(f"{gateway.url}/v1/messages", content=oversized_body(), timeout=TIMEOUT,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert reply.status_code == 413
    assert reply.json()["type"] == "error"
    assert reply.json()["error"]["type"] == "request_too_large"
    assert oversized(gateway, "/v1/messages") == before + 1


def test_a_large_body_under_the_limit_is_read(gateway):
    """A megabyte is read whole (and refused only for what it says: too long a prompt)."""
    filler = "x " * (512 * 1024)
    reply = gateway.chat([user(filler)], headers={"X-Turn-Type": "side"})
    assert len(reply.request.content) < LIMIT
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


def test_a_request_without_a_completion_limit_gets_the_default_one(gateway):
    """Chat completions without max_tokens and Responses with `max_output_tokens: null` stop
    at the default cap (the window, 8192 tokens on the tiny model, leaves room for more)."""
    side = {"X-Turn-Type": "side"}

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{gateway.base_url}{route}", headers=side, timeout=TIMEOUT, json=body)

    # Both at once: the engine decodes them in one batch (4096 tokens each take a while).
    with ThreadPoolExecutor(2) as pool:
        chat_reply = pool.submit(post, "/chat/completions",
                                 {"messages": [user("\x00")], "temperature": 0})  # fmt: skip
        responses_reply = pool.submit(post, "/responses", {"input": "\x00",
                                      "max_output_tokens": None, "temperature": 0})  # fmt: skip
        chat, responses = chat_reply.result(), responses_reply.result()
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"]["output_tokens"] == DEFAULT_MAX_TOKENS
    assert responses.json()["status"] == "incomplete"
