"""Serving through the official openai client: non-stream, real streaming, usage, sampling
parameters, big prompts, the context limit, models/health/metrics routes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration


def test_non_stream_completion(gateway):
    client = gateway.openai()
    reply = client.chat.completions.create(
        model="whatever-the-client-calls-it",
        messages=[{"role": "system", "content": "Be brief."}, user("Hello!")],
        max_tokens=5,
        extra_headers={"X-Turn-Type": "side"},
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "smollm2-tiny"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens <= 5 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stream_completion_arrives_token_by_token(gateway):
    client = gateway.openai()
    stream = client.chat.completions.create(
        model="m",
        messages=[user("Count to ten.")],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Turn-Type": "side"},
    )
    chunks = list(stream)
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    # 24 tokens: under load the engine merges updates queued while the reader lagged, and a
    # short answer could then arrive whole.
    assert len(content) >= 2, "tokens must arrive in separate chunks, not one at the end"
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # Same prompt, greedy, non-stream: same text.
    whole = client.chat.completions.create(
        model="m",
        messages=[user("Count to ten.")],
        max_tokens=24,
        temperature=0,
        extra_headers={"X-Turn-Type": "side"},
    )
    assert "".join(content) == whole.choices[0].message.content


def test_sampling_parameters_are_honoured(gateway):
    client = gateway.openai()

    def ask(**kwargs):
        return client.chat.completions.create(
            model="m",
            messages=[user("Say something random.")],
            extra_headers={"X-Turn-Type": "side"},
            **kwargs,
        )

    a = ask(max_completion_tokens=6, temperature=1.0, top_p=0.9, seed=1234)
    b = ask(max_completion_tokens=6, temperature=1.0, top_p=0.9, seed=1234)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 6
    # A stop string taken from a greedy output cuts the output before it.
    greedy = ask(max_tokens=8, temperature=0).choices[0].message.content
    words = greedy.split()
    if len(words) >= 2:
        cut = ask(max_tokens=8, temperature=0, stop=[words[1]])
        assert cut.choices[0].finish_reason == "stop"
        assert words[1] not in cut.choices[0].message.content
    # Fields real clients send are accepted.
    reply = ask(
        max_tokens=2,
        n=1,
        user="someone",
        presence_penalty=0.0,
        frequency_penalty=0.0,
        metadata={"k": "v"},
        logprobs=True,
    )
    assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens


def big_request() -> tuple[list[dict], list[dict]]:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Performs an operation on the workspace. " * 20,
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"arg{j}": {"type": "string", "description": "an argument " * 8}
                        for j in range(6)
                    },
                    "required": ["arg0"],
                },
            },
        }
        for i in range(12)
    ]
    messages = [{"role": "system", "content": "You are a coding agent. " * 400}, user("Go.")]
    return messages, tools


def test_big_request_with_tools(gateway):
    messages, tools = big_request()
    assert len(json.dumps(messages)) + len(json.dumps(tools)) > 20_000
    reply = gateway.chat(messages, tools=tools, headers={"X-Turn-Type": "side"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > 4000


def test_prompt_longer_than_context_is_context_length_exceeded(gateway):
    messages = [user("word " * 9000)]
    reply = gateway.chat(messages)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert "8192" in error["message"] and "9" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        gateway.openai().chat.completions.create(model="m", messages=messages, stream=True)
    assert info.value.code == "context_length_exceeded"


def test_max_tokens_beyond_the_window_is_clamped(gateway):
    reply = gateway.chat([user("hi")], max_tokens=100_000, stop=["a", "e", "o", " "])
    assert reply.status_code == 200, reply.text


def test_models_health_ready_metrics(gateway):
    models = gateway.openai().models.list()
    assert [m.id for m in models.data] == ["smollm2-tiny"]
    assert httpx.get(f"{gateway.url}/v1/models/smollm2-tiny", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{gateway.url}/v1/models/nope", timeout=TIMEOUT).status_code == 404
    assert httpx.get(f"{gateway.url}/healthz", timeout=TIMEOUT).json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/readyz", timeout=TIMEOUT)
    assert ready.status_code == 200 and ready.json()["engine"]["reachable"] is True
    gateway.chat([user("hi")], headers={"X-Turn-Type": "side"}, stream=True)
    text = httpx.get(f"{gateway.url}/metrics", timeout=TIMEOUT).text
    for name in (
        "clawrl_gateway_requests_total",
        "clawrl_gateway_request_duration_seconds_bucket",
        "clawrl_gateway_time_to_first_token_seconds_bucket",
        "clawrl_gateway_prompt_tokens_total",
        "clawrl_gateway_completion_tokens_total",
        "clawrl_gateway_active_sessions",
        "clawrl_gateway_turns_recorded_total",
        "clawrl_gateway_paused",
        "clawrl_gateway_held_requests",
        "clawrl_gateway_policy_version",
    ):
        assert name in text, name
    assert (
        gateway.metric("clawrl_gateway_requests_total", route="/v1/chat/completions", status="200")
        > 0
    )
    unknown = httpx.get(f"{gateway.url}/nope", timeout=TIMEOUT)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"]
    # The tokenizer, torch and transformers were frozen out of garbage collection at start.
    assert gateway.metric("clawrl_gateway_gc_frozen_objects") > 100_000
    assert "clawrl_gateway_gc_pause_seconds_total{" in text


def test_requests_are_counted_by_route_and_status(gateway):
    """The chat route (answered ahead of FastAPI) and FastAPI's routes alike."""
    chat = {"route": "/v1/chat/completions"}
    requests = "clawrl_gateway_requests_total"

    def counts() -> dict[str, float]:
        return {
            "chat 200": gateway.metric(requests, **chat, status="200"),
            "chat 400": gateway.metric(requests, **chat, status="400"),
            "chat 405": gateway.metric(requests, **chat, status="405"),
            "models 200": gateway.metric(requests, route="/v1/models", status="200"),
            "other 404": gateway.metric(requests, route="other", status="404"),
            "chat latency": gateway.metric("clawrl_gateway_request_duration_seconds_count", **chat),
        }

    before = counts()
    gateway.chat([user("hi")], headers={"X-Turn-Type": "side"})
    url = f"{gateway.url}/v1/chat/completions"
    assert httpx.post(url, json={"messages": []}, timeout=TIMEOUT).status_code == 400
    assert httpx.get(url, timeout=TIMEOUT).status_code == 405
    assert httpx.get(f"{gateway.url}/v1/models", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{gateway.url}/nope", timeout=TIMEOUT).status_code == 404
    after = counts()
    assert {key: after[key] - before[key] for key in before} == {
        "chat 200": 1, "chat 400": 1, "chat 405": 1, "models 200": 1, "other 404": 1,
        "chat latency": 3,
    }  # fmt: skip
