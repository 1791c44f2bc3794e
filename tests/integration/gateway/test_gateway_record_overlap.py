"""A main turn's record is prepared while the engine generates (ChatService._prepare_meanwhile): the
engine request must be on the wire before that CPU work starts, or it only delays the request.
The engine here is a plain socket server in a thread: while `prepare` runs, the event loop is
held, so only a request already written to the kernel can reach it (on a kept-alive engine
connection: a new one takes longer to open, and its first request goes after the preparation).
The turn recorded from the prepared parts is then read back from the real Redis."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.records import Turn
from clawrl.common.sglang_client import SGLangClient
from clawrl.gateway.control import PauseGate
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.recording import Recorder
from clawrl.gateway.serving import ChatService
from clawrl.gateway.sessions import SessionStore

pytestmark = pytest.mark.integration

REPLY = {
    "text": " w0 w1",
    "output_ids": [100, 101],
    "meta_info": {
        "id": "x",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "finish_reason": {"type": "length", "length": 2},
        "output_token_logprobs": [[-0.5, 100, None], [-0.25, 101, None]],
        "weight_version": "0",
    },
}


class ThreadEngine:
    """/generate over a raw socket in a thread: marks each request's arrival, then answers."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.arrived = threading.Event()
        self.stream = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, data = data.split(b"\r\n\r\n", 1)
                length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                                  if line.startswith(b"content-length:")))  # fmt: skip
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = json.loads(data[:length]), data[length:]
                self.arrived.set()
                if body.get("stream"):
                    payload = b"data: " + orjson.dumps(REPLY) + b"\n\ndata: [DONE]\n\n"
                    kind = b"text/event-stream"
                else:
                    payload, kind = orjson.dumps(REPLY), b"application/json"
                head = b"HTTP/1.1 200 OK\r\nContent-Type: %b\r\nContent-Length: %d\r\n\r\n"
                conn.sendall(head % (kind, len(payload)) + payload)

    def close(self) -> None:
        self.server.close()


class Renderer:
    eos_token_ids = [2]

    def render_ids(self, messages, tools=None):
        return [10, 11, 12]


@pytest.mark.parametrize(
    ("stream", "lean"),
    [(False, False), (False, True), (True, False)],
    ids=["aiohttp", "lean", "stream"],
)
async def test_the_engine_request_leaves_before_the_record_is_prepared(redis_url, stream, lean):
    engine_server = ThreadEngine()
    # lean: the gateway's own client (lifespan.create_engine). Streams are aiohttp's either way
    # (warmed by the side turn below only without it).
    engine = SGLangClient(f"http://127.0.0.1:{engine_server.port}", lean_generate=lean)
    redis = Redis.from_url(redis_url)
    prefix = f"test:overlap:{random.getrandbits(32):x}"
    store = SessionStore(redis, prefix=prefix, stream=f"{prefix}:turns", maxlen=100, ttl_s=60)
    metrics = GatewayMetrics()
    recorder = Recorder(store, metrics, gateway_id="g", anonymous_matching=True,
                        idle_timeout_s=60, sweep_interval_s=60, sweep_batch=10)  # fmt: skip
    seen = []
    prepare = recorder.prepare

    def watched_prepare(context, **parts):
        # The loop is held here: the thread can only see a request already sent.
        seen.append(engine_server.arrived.wait(timeout=2))
        prepare(context, **parts)

    recorder.prepare = watched_prepare
    service = ChatService(
        renderer=Renderer(),
        engine=engine,
        gate=PauseGate(metrics, hold_timeout_s=1, retry_after_s=1),
        metrics=metrics,
        recorder=recorder,
        model_name="m",
        context_length=4096,
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    request = parse_chat_request(json.dumps(body).encode(), {"x-session-id": "s1"})
    try:
        # A side turn first: the engine connection is open (a new one takes more passes of
        # the loop to connect; its first request is then sent after the preparation).
        side = {"messages": [{"role": "user", "content": "warm"}]}
        await service.complete(parse_chat_request(orjson.dumps(side), {"x-turn-type": "side"}))
        engine_server.arrived.clear()
        if stream:
            opened = await service.open_stream(request, time.perf_counter())
            lines = [line async for line in opened.lines]
            await opened.release()
            assert lines[-1] == b"data: [DONE]\n\n"
        else:
            _, headers = await service.complete(request)
            assert headers["X-Turn-Id"].startswith("s1:") and headers["X-Turn-Id"].endswith(":0")
        assert seen == [True]
        fields = await redis.hgetall(f"{prefix}:s:-:s1")  # the caller's session "s1"
        turn = Turn.FromString(fields[b"turn"])
        assert turn.session_id == "s1" and turn.turn_index == 0 and turn.model == "m"
        assert list(turn.prompt_ids) == [10, 11, 12] and list(turn.response_ids) == [100, 101]
        assert json.loads(turn.messages_json) == body["messages"]
    finally:
        await engine.aclose()
        await redis.aclose()
        service.close()
        engine_server.close()
