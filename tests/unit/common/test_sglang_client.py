"""The SGLang client maps engine failures to two exception types and parses streams; exercised
over real HTTP against a scripted server."""

import asyncio

import pytest
from aiohttp import web

from clawrl.common.sglang_client import (
    EngineRequestError,
    EngineUnavailable,
    SGLangClient,
    sampling_params,
)
from tests.conftest import free_port
from tests.scripted_engine import scripted_engine, sse


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
    async def reject(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "input_ids out of vocab"}}, status=400)

    async with scripted_engine({"/generate": reject}) as url:
        client = SGLangClient(url)
        with pytest.raises(EngineRequestError, match="input_ids out of vocab") as info:
            await client.generate({"input_ids": [10**9]})
        assert info.value.status_code == 400
        await client.aclose()


async def test_a_5xx_and_a_refused_connection_are_unavailable() -> None:
    async def overloaded(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    async with scripted_engine({"/generate": overloaded, "/health": overloaded}) as url:
        client = SGLangClient(url)
        with pytest.raises(EngineUnavailable, match="503"):
            await client.generate({"text": "hi"})
        assert await client.health() is False
        await client.aclose()

    client = SGLangClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(EngineUnavailable, match="unreachable"):
        await client.generate({"text": "hi"})
    assert await client.health() is False
    await client.aclose()


async def test_stream_yields_events_until_done() -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        assert (await request.json())["stream"] is True
        return await sse(request, [{"text": "a"}, {"text": "ab"}])

    async with scripted_engine({"/generate": stream}) as url:
        client = SGLangClient(url)
        events = [event async for event in client.generate_stream({"text": "x"})]
        await client.aclose()
    assert events == [{"text": "a"}, {"text": "ab"}]


async def test_failed_weight_update_is_returned_not_raised() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": "no such dir"}, status=400)

    async with scripted_engine({"/update_weights_from_disk": refuse}) as url:
        client = SGLangClient(url)
        result = await client.update_weights_from_disk("/nope", weight_version="3")
        await client.aclose()
    assert result == {"success": False, "message": "no such dir"}


async def test_stream_events_of_any_length_are_read_whole() -> None:
    """A cumulative event of ~20k tokens is one line of several hundred KB."""
    long_ids = list(range(20_000))
    events = [{"text": "x" * 300_000, "output_ids": long_ids}, {"text": "end"}]

    async def stream(request: web.Request) -> web.StreamResponse:
        return await sse(request, events)

    async with scripted_engine({"/generate": stream}) as url:
        client = SGLangClient(url)
        got = [event async for event in client.generate_stream({"text": "x"})]
        await client.aclose()
    assert got == events


async def test_a_stream_cut_before_done_is_unavailable() -> None:
    async def truncated(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": "a"}\n\n')
        await response.write_eof()
        return response

    async with scripted_engine({"/generate": truncated}) as url:
        client = SGLangClient(url)
        got = []
        with pytest.raises(EngineUnavailable, match="without \\[DONE\\]"):
            async for event in client.generate_stream({"text": "x"}):
                got.append(event)
        await client.aclose()
    assert got == [{"text": "a"}]


async def test_unexpected_client_failures_are_mapped_and_logged(caplog) -> None:
    async def never(request: web.Request) -> web.Response:
        raise AssertionError("not reached")

    async with scripted_engine({"/generate": never}) as url:
        client = SGLangClient(url)
        unserialisable = {"input_ids": [object()]}
        with pytest.raises(EngineUnavailable, match="failed"):
            await client.generate(unserialisable)
        with pytest.raises(EngineUnavailable, match="failed"):
            async for _ in client.generate_stream(unserialisable):
                pass
        await client.aclose()
    logged = [r for r in caplog.records if r.name == "clawrl.common.sglang_client"]
    assert len(logged) == 2 and all(r.exc_info for r in logged)


async def test_idle_connections_are_dropped_before_the_server_closes_them() -> None:
    # SGLang's uvicorn closes a keep-alive connection idle for 5 s; reusing one it is closing
    # failed a request as "engine unreachable". The client must open a fresh connection after
    # an idle spell shorter than the server's limit but longer than its own.
    from clawrl.common.sglang_client import IDLE_CONNECTION_S, UVICORN_KEEP_ALIVE_S

    assert IDLE_CONNECTION_S < UVICORN_KEEP_ALIVE_S
    peers: list[tuple] = []

    async def generate(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"text": "", "output_ids": [], "meta_info": {}})

    async with scripted_engine({"/generate": generate}) as url:
        client = SGLangClient(url)
        await client.generate({"text": "a"})
        await client.generate({"text": "b"})  # at once: the connection is reused
        await asyncio.sleep(IDLE_CONNECTION_S + 1.0)
        await client.generate({"text": "c"})  # after an idle spell: a fresh connection
        await client.aclose()
    assert peers[0] == peers[1]
    assert peers[2] != peers[1]


async def test_lora_calls_return_sglangs_reply_and_raise_its_refusal() -> None:
    # SGLang's bodies: LoRAUpdateOutput on both routes (400 when success is false), and
    # /v1/models lists each adapter as a card whose parent is the base model.
    loaded = {"a1": "/ckpt/a1"}

    async def load(request: web.Request) -> web.Response:
        body = await request.json()
        if body["lora_name"] in loaded:
            message = f"LoRA adapter {body['lora_name']} is already loaded"
            return web.json_response({"success": False, "error_message": message}, status=400)
        loaded[body["lora_name"]] = body["lora_path"]
        return web.json_response({"success": True, "loaded_adapters": loaded})

    async def models(request: web.Request) -> web.Response:
        cards = [{"id": "base", "root": "base", "parent": None}]
        cards += [{"id": n, "root": p, "parent": "base"} for n, p in loaded.items()]
        return web.json_response({"object": "list", "data": cards})

    async with scripted_engine({"/load_lora_adapter": load, "/v1/models": models}) as url:
        client = SGLangClient(url)
        reply = await client.load_lora_adapter("a2", "/ckpt/a2")
        with pytest.raises(EngineRequestError, match="a1 is already loaded") as info:
            await client.load_lora_adapter("a1", "/ckpt/a1")
        adapters = await client.lora_adapters()
        await client.aclose()
    assert reply["loaded_adapters"] == {"a1": "/ckpt/a1", "a2": "/ckpt/a2"}
    assert info.value.status_code == 400
    assert adapters == {"a1": "/ckpt/a1", "a2": "/ckpt/a2"}
