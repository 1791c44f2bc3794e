"""What the trainer learns from must be right: anonymous sessions never mix callers, a streamed
turn is stored before its finish chunk leaves with exactly what the engine sampled, the engine's
weight version is recorded, and a next state holds every message after the reply."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from clawrl.common.proto.records_pb2 import FinalizeReason
from tests.conftest import free_port

from .helpers import TIMEOUT, turn_of, user

pytestmark = pytest.mark.integration


def turns_with(handle, tag: str) -> list:
    return [t for t in handle.turns() if tag in t.messages_json]


def wait_for(check, timeout_s: float = 15):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            return found
        time.sleep(0.05)
    return found


def test_identical_openings_of_two_api_keys_stay_two_sessions(secured):
    """Greedy decoding makes both first replies equal; each caller's continuation must finalise
    its own first turn with its own next state."""
    tag = uuid.uuid4().hex
    opening = [{"role": "system", "content": f"Be brief. {tag}"}, user("Hello there")]
    clients = {key: secured.openai(api_key=key) for key in ("sk-test-1", "sk-test-2")}
    firsts = {
        key: client.chat.completions.create(
            model="m", messages=opening, max_tokens=4, temperature=0
        )
        for key, client in clients.items()
    }
    replies = {
        key: reply.choices[0].message.model_dump(exclude_none=True) for key, reply in firsts.items()
    }
    assert replies["sk-test-1"] == replies["sk-test-2"]
    for key, client in clients.items():
        client.chat.completions.create(
            model="m",
            messages=[*opening, replies[key], user(f"continue as {key}")],
            max_tokens=4,
            temperature=0,
        )
    firsts = wait_for(
        lambda: (
            [t for t in turns_with(secured, tag) if t.turn_index == 0 and t.finalize_reason]
            if len(turns_with(secured, tag)) >= 2
            else None
        )
    )
    assert firsts is not None and len(firsts) == 2
    assert len({t.session_id for t in firsts}) == 2
    next_states = sorted(json.loads(t.next_state_json)["content"] for t in firsts)
    assert next_states == ["continue as sk-test-1", "continue as sk-test-2"]
    assert all(t.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE for t in firsts)


def test_identical_live_openings_of_one_caller_start_a_new_session(gateway):
    """Same caller, same opening twice, both pending: a follow-up is not guessed onto either."""
    tag = uuid.uuid4().hex
    opening = [user(f"ping {tag}")]
    client = gateway.openai(api_key=f"client-{tag}")
    before = gateway.metric("clawrl_gateway_ambiguous_histories_total", event="new_session")
    replies = [
        client.chat.completions.create(model="m", messages=opening, max_tokens=3, temperature=0)
        for _ in range(2)
    ]
    message = replies[0].choices[0].message.model_dump(exclude_none=True)
    follow_up = client.chat.completions.with_raw_response.create(
        model="m",
        messages=[*opening, message, user("pong?")],
        max_tokens=3,
        temperature=0,
        extra_headers={"X-Session-Done": "1"},
    )
    after = gateway.metric("clawrl_gateway_ambiguous_histories_total", event="new_session")
    assert after == before + 1
    third = follow_up.headers["x-session-id"]
    [turn] = gateway.wait_turns(third, 1)
    assert turn.turn_index == 0  # a new session, not a continuation of either opening
    # The two openings are still pending: nothing was finalised with the follow-up's message.
    assert not [t for t in turns_with(gateway, tag) if t.session_id != third]


class SlowProxy:
    """A TCP proxy that delays what the client sends by `delay_s` (a slow Redis)."""

    def __init__(self, target_port: int, delay_s: float):
        self.port = free_port()
        self.target_port = target_port
        self.delay_s = delay_s
        self.tasks: set[asyncio.Future] = set()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(5)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def pipe(reader, writer, delay_s):
            try:
                while data := await reader.read(65536):
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(client_reader, client_writer):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            for task in (pipe(client_reader, writer, self.delay_s), pipe(reader, client_writer, 0)):
                self.tasks.add(asyncio.ensure_future(task))

        async def serve():
            self.server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            started.set()

        self.loop.run_until_complete(serve())
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def slow_redis_gateway(gateways, redis_url) -> Iterator:
    """A gateway whose Redis answers 0.4 s late: a store after the finish chunk shows."""
    proxy = SlowProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]), 0.4)
    handle = gateways.ready(
        gateways.start(
            "slow-redis",
            redis_url=f"redis://127.0.0.1:{proxy.port}/0",
            CLAWRL_REDIS__SOCKET_TIMEOUT_S="5",
        )
    )
    yield handle
    handle.child.stop()
    proxy.close()


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def test_streamed_turn_is_stored_before_its_finish_chunk(slow_redis_gateway, engine_url):
    gateway = slow_redis_gateway
    session_id = f"stream-{uuid.uuid4().hex[:8]}"
    messages = [user("Stream me a few tokens.")]
    body = {
        "messages": messages,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/chat/completions",
        json=body,
        headers={"X-Session-Id": session_id},
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
        content = []
        for event in events:
            delta = event["choices"][0]
            content.append(delta["delta"].get("content") or "")
            if delta["finish_reason"]:
                break
        request_id = event["id"]
        # The finish chunk is here, [DONE] is not read yet: the turn must already be pending.
        pending = gateway.redis.hget(f"test:slow-redis:s:-:{session_id}", "tid")
        assert pending == turn_of(session_id, request_id, 0).encode()
        # ... and a next request sent now finds it and finalises it with its next state.
        history = [*messages, {"role": "assistant", "content": "".join(content)}, user("next")]
        nxt = gateway.chat(history, headers={"X-Session-Id": session_id, "X-Session-Done": "1"})
        assert nxt.status_code == 200
        assert next(events) == "[DONE]"
    first, _ = gateway.wait_turns(session_id, 2)
    assert first.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(first.next_state_json) == user("next")
    assert not first.history_mismatch
    # Exactly what the engine samples for this prompt and seed.
    own = httpx.post(
        f"{engine_url}/generate",
        json={
            "input_ids": list(first.prompt_ids),
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 1.0,
                "top_p": 1.0,
                "sampling_seed": 1234,
                "stop_token_ids": [2],
            },
            "return_logprob": True,
        },
        timeout=TIMEOUT,
    ).json()
    assert list(first.response_ids) == own["output_ids"]
    expected = [entry[0] for entry in own["meta_info"]["output_token_logprobs"]]
    assert list(first.response_logprobs) == pytest.approx(expected, abs=1e-5)
    assert first.response_text == "".join(content) == own["text"]
    assert first.request_id.startswith("chatcmpl-")


def test_parallel_tool_results_are_all_in_the_next_state(gateway, session_id):
    headers = {"X-Session-Id": session_id}
    first = gateway.chat([user("Weather in Paris and Rome?")], headers=headers).json()
    calls = [
        {
            "id": f"call_{city}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        for city in ("Paris", "Rome")
    ]
    reply = {**first["choices"][0]["message"], "tool_calls": calls}
    after = [
        {"role": "tool", "tool_call_id": "call_Paris", "content": "21C"},
        {"role": "tool", "tool_call_id": "call_Rome", "content": "25C"},
        user("And tomorrow?"),
    ]
    history = [user("Weather in Paris and Rome?"), reply, *after]
    assert gateway.chat(history, headers={**headers, "X-Session-Done": "1"}).status_code == 200
    turn = gateway.wait_turns(session_id, 2)[0]
    assert [json.loads(m) for m in turn.next_state_messages_json] == after
    assert json.loads(turn.next_state_json) == after[-1]


@pytest.fixture(scope="module")
def versioned(engine_factory, gateways):
    """A gateway restarted with no memory of the policy version (0) in front of an engine whose
    weights are at version 5."""
    url = engine_factory("smollm2-tiny", "--weight-version", "5")
    handle = gateways.ready(
        gateways.start("versioned", engine_url=url, CLAWRL_CONTROL__INITIAL_POLICY_VERSION="0")
    )
    return handle, url


def test_the_engines_weight_version_is_recorded(versioned, session_id):
    handle, url = versioned
    headers = {"X-Session-Id": session_id}
    for stream in (False, True):
        reply = handle.chat([user("which weights?")], headers=headers, stream=stream)
        assert reply.status_code == 200
    # The weights change under the gateway (no Resume reached it): the next turn says so.
    from clawrl.common.models import resolve_model_dir
    from clawrl.common.settings import ModelSettings

    model_dir = str(resolve_model_dir(ModelSettings(path="smollm2-tiny")))
    update = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": model_dir, "weight_version": "6"},
        timeout=TIMEOUT,
    )
    assert update.json()["success"] is True
    reply = handle.chat([user("and now?")], headers={**headers, "X-Session-Done": "1"})
    assert reply.json()["system_fingerprint"] == "clawrl-policy-v6"
    turns = handle.wait_turns(session_id, 3)
    assert [(t.weight_version, t.policy_version) for t in turns] == [("5", 5), ("5", 5), ("6", 6)]


def test_a_stream_the_client_leaves_is_still_the_next_state(gateway, session_id):
    """Recording happens when a request ends; a streamed main request whose client hangs up
    mid-answer records no turn of its own but still finalises the turn it answers."""
    headers = {"X-Session-Id": session_id}
    first = gateway.chat([user("one")], headers=headers)
    assert first.status_code == 200
    history = [user("one"), first.json()["choices"][0]["message"], user("two")]
    body = {"messages": history, "max_tokens": 2000, "stream": True}
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/chat/completions",
        json=body,
        headers=headers,
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the stream started; hang up
    [turn] = gateway.wait_turns(session_id, 1)
    assert turn.turn_id == turn_of(session_id, first.json()["id"], 0)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert json.loads(turn.next_state_json) == user("two")
    # The stream did not finish: no turn of its own is pending.
    assert gateway.redis.hget(f"test:main:s:-:{session_id}", "tid") is None
