"""The serving core against a scripted engine (a real HTTP server speaking SGLang's /generate):
tool calls come back as OpenAI `tool_calls` (whole) and `delta.tool_calls` (streamed), and
responses carry usage and finish reasons. The real engine is exercised by the integration
tests; here the model's output has to be a tool call, which the tiny random model never emits."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from aiohttp import web

from clawrl.common.sglang_client import SGLangClient
from clawrl.gateway.control import PauseGate
from clawrl.gateway.errors import ContextLengthExceeded
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.serving import ChatService
from tests.scripted_engine import scripted_engine, sse

OUTPUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


class FakeRenderer:
    eos_token_ids = [2]

    def render_ids(self, messages, tools=None):
        return list(range(10, 10 + 3 * len(messages)))


def engine_events(text: str) -> list[dict]:
    """Cumulative events, one character per token (enough to split every tag)."""
    events = []
    for n in range(1, len(text) + 1):
        events.append(
            {
                "text": text[:n],
                "output_ids": list(range(n)),
                "meta_info": {
                    "prompt_tokens": 3,
                    "completion_tokens": n,
                    "finish_reason": {"type": "stop", "matched": 2} if n == len(text) else None,
                    "output_token_logprobs": [[-0.1, i, None] for i in range(n)],
                },
            }
        )
    return events


def generate_route(text: str):
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["return_logprob"] is True and body["sampling_params"]["stop_token_ids"] == [2]
        events = engine_events(text)
        if not body["stream"]:
            return web.json_response(events[-1])
        return await sse(request, events)

    return generate


@pytest.fixture
async def service():
    """`await make(text)` -> a ChatService whose engine answers `text`, a character a token."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(text: str = OUTPUT, context_length: int = 8192) -> ChatService:
            return await scripted_service(stack, generate_route(text), context_length)

        yield make


async def scripted_service(
    stack: contextlib.AsyncExitStack, generate, context_length: int = 8192
) -> ChatService:
    """A ChatService (no recorder) in front of a scripted engine whose /generate is
    `generate`; both are closed with `stack`."""
    url = await stack.enter_async_context(scripted_engine({"/generate": generate}))
    engine = SGLangClient(url)
    stack.push_async_callback(engine.aclose)
    metrics = GatewayMetrics()
    return ChatService(
        renderer=FakeRenderer(),
        engine=engine,
        gate=PauseGate(metrics, hold_timeout_s=1, retry_after_s=1),
        metrics=metrics,
        recorder=None,
        model_name="m",
        context_length=context_length,
    )


def request(**body):
    payload = {"messages": [{"role": "user", "content": "weather?"}], **body}
    return parse_chat_request(json.dumps(payload).encode(), {})


async def test_tool_call_in_a_whole_response(service):
    body, _ = await (await service()).complete(request(tools=TOOLS))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert body["usage"]["completion_tokens"] == len(OUTPUT)


async def test_without_tools_the_text_is_returned_as_is(service):
    body, _ = await (await service()).complete(request())
    assert body["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT}
    assert body["choices"][0]["finish_reason"] == "stop"
    body, _ = await (await service()).complete(request(tools=TOOLS, tool_choice="none"))
    assert "tool_calls" not in body["choices"][0]["message"]


async def test_streamed_tool_call_arrives_as_delta_tool_calls(service):
    svc = await service()
    stream = await svc.open_stream(request(tools=TOOLS, stream=True), time.perf_counter())
    raw = [line async for line in stream.lines]
    await stream.release()
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in raw[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert "<tool_call>" not in content and content.strip() == "Let me look."
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert svc.gate.in_flight == 0


async def test_prompt_beyond_the_context_is_refused_before_the_engine(service):
    with pytest.raises(ContextLengthExceeded) as info:
        await (await service(context_length=3)).complete(request())
    assert "maximum context length is 3 tokens" in info.value.message
    assert "resulted in 3 tokens" in info.value.message
