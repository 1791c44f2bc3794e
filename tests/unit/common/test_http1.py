"""The lean HTTP/1.1 pool (common/http1.py) behind the gateway's /generate calls: replies read
whole (Content-Length, chunked, to the connection's end), connections reused, and every way a
call can go wrong mapped as the aiohttp path maps it. Real HTTP against scripted servers."""

import asyncio
import contextlib

import pytest
from aiohttp import web

from clawrl.common.http1 import BadReply, KeepAlivePool, dechunk
from clawrl.common.sglang_client import EngineRequestError, EngineUnavailable, SGLangClient
from tests.conftest import free_port
from tests.scripted_engine import scripted_engine

REPLY = {"text": " w0", "output_ids": [100], "meta_info": {"finish_reason": None}}


def test_dechunk_reads_a_whole_chunked_body_and_waits_for_the_rest() -> None:
    data = b"4\r\nWiki\r\n6;ext=1\r\npedia \r\n0\r\nTrailer: x\r\n\r\nNEXT"
    assert dechunk(data, 0) == (b"Wikipedia ", len(data) - 4)
    for cut in (3, 10, 25, len(data) - 6):  # any prefix is incomplete, never wrong
        assert dechunk(data[:cut], 0) is None
    with pytest.raises(BadReply, match="chunk size"):
        dechunk(b"zz\r\nab\r\n", 0)


@contextlib.asynccontextmanager
async def raw_server(answer: bytes, close: bool = False):
    """A TCP server that reads one request head and writes `answer` (then closes, or not)."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await serve(reader, writer)
        writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(head + await reader.readexactly(length))
            writer.write(answer)
            await writer.drain()
            if close:
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()


async def test_generate_reuses_one_connection_and_sends_json() -> None:
    peers, bodies = [], []

    async def generate(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        bodies.append((request.content_type, await request.json()))
        return web.json_response(REPLY)

    async with scripted_engine({"/generate": generate}) as url:
        client = SGLangClient(url, lean_generate=True)
        for i in range(3):
            assert await client.generate({"input_ids": [i]}) == REPLY
        await client.aclose()
    assert len(set(peers)) == 1
    assert bodies[2] == ("application/json", {"input_ids": [2], "stream": False})


async def test_engine_errors_are_mapped_as_on_the_aiohttp_path() -> None:
    async def reject(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "input_ids out of vocab"}}, status=400)

    async def overloaded(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded")

    async with scripted_engine({"/generate": reject}) as url:
        client = SGLangClient(url, lean_generate=True)
        with pytest.raises(EngineRequestError, match="out of vocab") as info:
            await client.generate({"input_ids": [10**9]})
        assert info.value.status_code == 400
        await client.aclose()
    async with scripted_engine({"/generate": overloaded}) as url:
        client = SGLangClient(url, lean_generate=True)
        with pytest.raises(EngineUnavailable, match="503"):
            await client.generate({"text": "hi"})
        await client.aclose()
    client = SGLangClient(f"http://127.0.0.1:{free_port()}", lean_generate=True)
    with pytest.raises(EngineUnavailable, match="unreachable"):
        await client.generate({"text": "hi"})
    await client.aclose()


async def test_a_chunked_reply_is_read_whole() -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        body = b'{"text": "' + b"x" * 70000 + b'", "output_ids": []}'
        for start in range(0, len(body), 9000):
            await response.write(body[start : start + 9000])
        await response.write_eof()
        return response

    async with scripted_engine({"/generate": chunked}) as url:
        client = SGLangClient(url, lean_generate=True)
        reply = await client.generate({"text": "hi"})
        assert reply["text"] == "x" * 70000
        assert (await client.generate({"text": "again"}))["output_ids"] == []
        await client.aclose()


async def test_a_reply_that_ends_with_its_connection_is_read_and_not_reused() -> None:
    answer = b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"text": "to the end"}'
    async with raw_server(answer, close=True) as (url, seen):
        pool = KeepAlivePool(url)
        assert await pool.post_json("/generate", b"{}", 5) == (200, b'{"text": "to the end"}')
        assert not pool._idle  # Connection: close: never put back
        assert await pool.post_json("/generate", b"{}", 5) == (200, b'{"text": "to the end"}')
        pool.close()
    assert len(seen) == 2


async def test_a_connection_the_server_closed_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    async with raw_server(answer, close=True) as (url, seen):  # closes after each reply
        pool = KeepAlivePool(url)
        assert await pool.post_json("/a", b"{}", 5) == (200, b"{}")
        await asyncio.sleep(0.1)  # the close arrives while the connection is idle
        assert await pool.post_json("/b", b"{}", 5) == (200, b"{}")
        pool.close()
    assert [request.split(b" ")[1] for request in seen] == [b"/a", b"/b"]


async def test_garbage_and_timeouts_are_unavailable_and_the_connection_dropped() -> None:
    async with raw_server(b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as (url, _):
        client = SGLangClient(url, lean_generate=True)
        with pytest.raises(EngineUnavailable, match="status line"):
            await client.generate({"text": "hi"})
        assert not client._lean._idle
        await client.aclose()

    left = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        for _ in range(300):  # until the client leaves (SGLang then aborts the request)
            await asyncio.sleep(0.02)
            if request.transport is None or request.transport.is_closing():
                left.set()
                break
        return web.json_response(REPLY)

    async with scripted_engine({"/generate": slow}) as url:
        client = SGLangClient(url, timeout_s=0.3, lean_generate=True)
        with pytest.raises(EngineUnavailable, match="timed out"):
            await client.generate({"text": "hi"})
        await asyncio.wait_for(left.wait(), 5)  # the engine saw the client go
        assert not client._lean._idle
        await client.aclose()


async def test_idle_connections_are_dropped_and_callers_past_the_limit_wait() -> None:
    peers: list[tuple] = []
    busy = 0
    most = 0

    async def generate(request: web.Request) -> web.Response:
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        peers.append(request.transport.get_extra_info("peername"))
        await asyncio.sleep(0.05)
        busy -= 1
        return web.json_response(REPLY)

    async with scripted_engine({"/generate": generate}) as url:
        pool = KeepAlivePool(url, max_connections=2, idle_s=0.3)
        replies = await asyncio.gather(*(pool.post_json("/generate", b"{}", 5) for _ in range(6)))
        assert [status for status, _ in replies] == [200] * 6
        assert most == 2 and len(set(peers)) == 2
        await asyncio.sleep(0.5)  # idle past idle_s: a fresh connection
        await pool.post_json("/generate", b"{}", 5)
        assert peers[-1] not in peers[:-1]
        pool.close()


async def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="plain http"):
        KeepAlivePool("https://engine:443")
    # SGLangClient keeps aiohttp for what the pool does not speak.
    client = SGLangClient("https://engine:443", lean_generate=True)
    assert client._lean is None
    await client.aclose()
