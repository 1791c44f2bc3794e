"""A streaming client that hangs up while its turn is being written to Redis loses nothing: the
write outlives the cancelled request, so the turn is recorded all the same.

The moment is made real with a TCP proxy in front of Redis that holds what the gateway sends
while told to: the test hangs up once the gateway's first recording command is held (so the
write has begun and cannot have reached Redis), waits until the gateway has finished the
request (cancelled), then lets the command through."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from clawrl.common.records import Turn
from tests.conftest import free_port, wait_until

from .helpers import TIMEOUT, user

pytestmark = pytest.mark.integration

PREFIX = "test:hangup"


class HoldingProxy:
    """A TCP proxy to Redis that, while `holding` is set, keeps what clients send (and sets
    `held` once it keeps something) until `holding` is cleared."""

    def __init__(self, target_port: int):
        self.port = free_port()
        self.target_port = target_port
        self.holding = threading.Event()
        self.held = threading.Event()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(5)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        tasks = set()

        async def pipe(reader, writer, hold: bool):
            try:
                while data := await reader.read(65536):
                    while hold and self.holding.is_set():
                        self.held.set()
                        await asyncio.sleep(0.01)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(client_reader, client_writer):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            for task in (pipe(client_reader, writer, True), pipe(reader, client_writer, False)):
                tasks.add(asyncio.ensure_future(task))

        async def serve():
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            started.set()

        self.loop.run_until_complete(serve())
        self.loop.run_forever()

    def close(self) -> None:
        self.holding.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def held_redis_gateway(gateways, redis_url) -> Iterator:
    proxy = HoldingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    handle = gateways.ready(
        gateways.start(
            "hangup",
            redis_url=f"redis://127.0.0.1:{proxy.port}/0",
            CLAWRL_SESSIONS__KEY_PREFIX=PREFIX,
            # No idle sweep during the test: the first command held must be the recording's.
            CLAWRL_SESSIONS__SWEEP_INTERVAL_S="3600",
            CLAWRL_REDIS__SOCKET_TIMEOUT_S="30",
        )
    )
    yield handle, proxy
    handle.child.stop()
    proxy.close()


def pending_turns(handle) -> list[Turn]:
    """The turns pending in this gateway's sessions (read from Redis itself, not the proxy)."""
    turns = []
    for key in handle.redis.scan_iter(f"{PREFIX}:s:*"):
        stored = handle.redis.hget(key, "turn")
        if stored is not None:
            turns.append(Turn.FromString(stored))
    return turns


def test_a_client_hanging_up_during_the_write_loses_no_turn(held_redis_gateway):
    handle, proxy = held_redis_gateway
    tag = uuid.uuid4().hex[:8]
    # An anonymous continuation: its recording starts by looking its session up (one MGET),
    # so while that is held, nothing of the turn has reached Redis.
    history = [user(f"hello {tag}"), {"role": "assistant", "content": "hi"}, user("more")]
    body = {"messages": history, "max_tokens": 6, "stream": True}
    served = handle.metric("clawrl_gateway_requests_total", route="/v1/chat/completions")
    proxy.held.clear()
    proxy.holding.set()
    try:
        with httpx.stream(
            "POST", f"{handle.base_url}/chat/completions", json=body, timeout=TIMEOUT
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a line iterator collected closes the stream
            first_line = next(lines)
            assert proxy.held.wait(60), "the gateway never began writing the turn"
            assert handle.metric("clawrl_gateway_completion_tokens_total") > 0  # generated
        # The client is gone; the gateway notices, cancels the request and counts it done.
        wait_until(
            lambda: (
                handle.metric("clawrl_gateway_requests_total", route="/v1/chat/completions")
                > served
            ),
            60,
            "the cancelled request's end",
        )
    finally:
        proxy.holding.clear()
    request_id = first_line.split('"id":"', 1)[1].split('"', 1)[0]
    deadline = time.monotonic() + 30
    while not any(t.request_id == request_id for t in pending_turns(handle)):
        assert time.monotonic() < deadline, (
            f"the turn of the client that hung up was lost:\n{handle.child.log_tail()}"
        )
        time.sleep(0.1)
    [turn] = [t for t in pending_turns(handle) if t.request_id == request_id]
    assert len(turn.response_ids) == len(turn.response_logprobs) > 0
    assert handle.metric("clawrl_gateway_recording_detached_total") == 1
    assert handle.metric("clawrl_gateway_recording_failures_total") == 0
