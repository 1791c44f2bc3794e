"""Requests admitted after a SwitchAdapter reach the engine with the adapter as `lora_path`
(whole and streamed); an engine without that adapter (SGLang's 400 "not loaded") becomes a
503 with Retry-After, counted, never a reply from other weights. Against a scripted engine (a
real HTTP server): the real engine is exercised in tests/integration/weight_sync."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from aiohttp import web

from clawrl.common.sglang_client import SGLangClient
from clawrl.gateway.control import PauseGate
from clawrl.gateway.errors import to_http
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.serving import ChatService
from tests.scripted_engine import scripted_engine, sse
from tests.unit.gateway.test_gateway_serving_core import FakeRenderer, engine_events


@pytest.fixture
async def served():
    """A ChatService over an engine that holds `policy-v4` only; the engine's received
    `lora_path`s are listed in `seen`."""
    seen: list[str | None] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body.get("lora_path"))
        if body.get("lora_path") not in (None, "policy-v4"):
            message = (
                f"The following requested LoRA adapters are not loaded: {body['lora_path']}\n"
                "Loaded adapters: odict_keys(['policy-v4'])."
            )
            return web.json_response({"error": {"message": message}}, status=400)
        events = engine_events("hi")
        return await sse(request, events) if body["stream"] else web.json_response(events[-1])

    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(scripted_engine({"/generate": generate}))
        engine = SGLangClient(url)
        stack.push_async_callback(engine.aclose)
        metrics = GatewayMetrics()
        service = ChatService(
            renderer=FakeRenderer(),
            engine=engine,
            gate=PauseGate(metrics, hold_timeout_s=1, retry_after_s=3, policy_version=3),
            metrics=metrics,
            recorder=None,
            model_name="m",
            context_length=8192,
        )
        yield service, seen


def request(**body):
    payload = {"messages": [{"role": "user", "content": "hello"}], **body}
    return parse_chat_request(json.dumps(payload).encode(), {})


async def test_requests_after_a_switch_carry_the_adapter(served):
    service, seen = served
    body, _ = await service.complete(request())
    assert body["system_fingerprint"] == "clawrl-policy-v3"
    service.gate.switch(4, "policy-v4")
    body, _ = await service.complete(request())
    assert body["system_fingerprint"] == "clawrl-policy-v4"
    stream = await service.open_stream(request(stream=True), time.perf_counter())
    lines = [line async for line in stream.lines]
    await stream.release()
    assert b"clawrl-policy-v4" in lines[1]
    assert seen == [None, "policy-v4", "policy-v4"]


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_adapter_the_engine_lacks_is_a_503_with_retry_after(served, streamed):
    service, seen = served
    service.gate.switch(5, "policy-v5")
    with pytest.raises(Exception) as info:
        if streamed:
            await service.open_stream(request(stream=True), time.perf_counter())
        else:
            await service.complete(request())
    answer = to_http(info.value, retry_after_s=3)
    assert (answer.status, answer.headers) == (503, {"Retry-After": "3"})
    assert answer.body["error"]["code"] == "adapter_unavailable"
    assert "policy-v5" in answer.body["error"]["message"]
    count = service.metrics.registry.get_sample_value(
        "clawrl_gateway_engine_errors_total", {"kind": "adapter_not_loaded"}
    )
    assert count == 1 and seen == ["policy-v5"]
    assert service.gate.in_flight == 0
