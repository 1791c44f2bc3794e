"""The SGLang client maps engine failures to two exception types and parses streams."""

import httpx
import pytest

from clawrl.common.sglang_client import (
    EngineRequestError,
    EngineUnavailable,
    SGLangClient,
    sampling_params,
)


def client_for(handler) -> SGLangClient:
    return SGLangClient("http://engine", transport=httpx.MockTransport(handler))


def test_sampling_params_use_sglang_names() -> None:
    params = sampling_params(max_new_tokens=8, temperature=0.0, stop=["\n"], seed=7)
    assert params == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "skip_special_tokens": True,
        "stop": ["\n"],
        "sampling_seed": 7,
    }


async def test_a_4xx_is_a_request_error_with_the_engines_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "input_ids out of vocab"}})

    client = client_for(handler)
    with pytest.raises(EngineRequestError, match="input_ids out of vocab") as info:
        await client.generate({"input_ids": [10**9]})
    assert info.value.status_code == 400
    await client.aclose()


async def test_a_5xx_and_a_refused_connection_are_unavailable() -> None:
    client = client_for(lambda request: httpx.Response(503, text="overloaded"))
    with pytest.raises(EngineUnavailable, match="503"):
        await client.generate({"text": "hi"})

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client = client_for(refuse)
    with pytest.raises(EngineUnavailable, match="unreachable"):
        await client.generate({"text": "hi"})
    assert await client.health() is False


async def test_stream_yields_events_until_done() -> None:
    body = b'data: {"text": "a"}\n\ndata: {"text": "ab"}\n\ndata: [DONE]\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        assert b'"stream":true' in request.content.replace(b" ", b"")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = client_for(handler)
    events = [event async for event in client.generate_stream({"text": "x"})]
    assert events == [{"text": "a"}, {"text": "ab"}]


async def test_failed_weight_update_is_returned_not_raised() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"success": False, "message": "no such dir"})

    result = await client_for(handler).update_weights_from_disk("/nope", weight_version="3")
    assert result == {"success": False, "message": "no such dir"}
