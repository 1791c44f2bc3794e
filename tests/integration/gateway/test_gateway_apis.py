"""The OpenAI Responses API and the Anthropic Messages API on a real gateway process, driven by
the official `openai` and `anthropic` clients, streaming and not, with tools both ways. Every
body and stream event is also checked against the SDKs' own types (pydantic validation, not
the clients' lenient construction). Where the model must emit an exact tool call, the engine is
a scripted SGLang stand-in (real HTTP, in a thread) whose sampled ids and log-probs the recorded
turns must carry; elsewhere the real CPU engine with the tiny model."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import anthropic
import httpx
import openai
import pytest
from aiohttp import web
from anthropic.types import Message
from openai.types.responses import Response

from clawrl.common.proto.records_pb2 import FinalizeReason
from tests.scripted_engine import scripted_engine, sse
from tests.sdk_events import validate_event

from .helpers import TIMEOUT

pytestmark = pytest.mark.integration

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OPENAI_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
INSTRUCTIONS = "Answer weather questions with the tool."


def sampled(text: str) -> tuple[list[int], list[float]]:
    """The ids and log-probs the scripted engine 'samples' for `text`: a token a character."""
    return [1000 + i for i in range(len(text))], [-0.01 * (i + 1) for i in range(len(text))]


class ScriptedEngine:
    """An SGLang stand-in in a background thread: each /generate answers the next scripted
    text (streamed as cumulative events, a character a token) and keeps the request."""

    def __init__(self):
        self.texts: queue.Queue[str] = queue.Queue()
        self.requests: list[dict] = []
        self.url = ""
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def script(self, *texts: str) -> None:
        for text in texts:
            self.texts.put(text)

    def events(self, text: str, prompt_tokens: int) -> list[dict]:
        ids, logprobs = sampled(text)
        return [
            {
                "text": text[:n],
                "output_ids": ids[:n],
                "meta_info": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "finish_reason": {"type": "stop", "matched": 2} if n == len(text) else None,
                    "output_token_logprobs": [
                        [lp, i, None] for lp, i in zip(logprobs, ids[:n], strict=False)
                    ],
                    "weight_version": "0",
                },
            }
            for n in range(1, len(text) + 1)
        ]

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        events = self.events(self.texts.get_nowait(), len(body["input_ids"]))
        if not body.get("stream"):
            return web.json_response(events[-1])
        return await sse(request, events)

    async def _serve(self) -> None:
        async def info(_):
            return web.json_response({"model_path": "scripted", "weight_version": "0"})

        async def health(_):
            return web.Response(text="")

        routes = {"/generate": self._generate, "/get_model_info": info, "/health": health}
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        async with scripted_engine(routes) as url:
            self.url = url
            self._started.set()
            await self._stop.wait()

    def start(self) -> ScriptedEngine:
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def engine(scripted) -> ScriptedEngine:
    return scripted[0]


@pytest.fixture(scope="module")
def scripted_gateway(scripted):
    return scripted[1]


def openai_client(handle, key: str = "none") -> openai.OpenAI:
    return handle.openai(api_key=key)


def anthropic_client(handle, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=handle.url, api_key=key, max_retries=0)


def stream_events(handle, path: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed request, the data's type
    matching its name."""
    with httpx.stream(
        "POST", f"{handle.base_url}{path}", json=body, headers=headers, timeout=TIMEOUT
    ) as streamed:
        streamed.read()
    assert streamed.status_code == 200, streamed.text
    events = []
    for block in streamed.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def assert_recorded(turn, text: str) -> None:
    """The turn carries exactly what the engine sampled."""
    ids, logprobs = sampled(text)
    assert list(turn.response_ids) == ids
    assert list(turn.response_logprobs) == pytest.approx(logprobs)
    assert turn.response_text == text


# --- the Responses API --------------------------------------------------------------------


def test_responses_tool_call_then_previous_response_id_streamed(
    scripted_gateway, engine, renderer, session_id
):
    """A function call comes back as a function_call item; its output, sent with only
    previous_response_id, is served on the whole history (the prompt a resending client
    would get) and is the recorded turn's next state; the stream is OpenAI's sequence."""
    client = openai_client(scripted_gateway)
    # The stored response is the API key's: the raw request below presents the same one.
    headers = {"X-Session-Id": session_id, "Authorization": "Bearer none"}
    engine.script("Let me look.\n" + CALL, "It is 24 degrees in Paris.")
    first = client.responses.create(
        model="m",
        instructions=INSTRUCTIONS,
        input="What is the weather in Paris?",
        tools=[OPENAI_TOOL],
        max_output_tokens=200,
        extra_headers=headers,
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Let me look."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage.output_tokens == len("Let me look.\n" + CALL)
    assert first.usage.input_tokens == len(engine.requests[-1]["input_ids"])

    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 24}'}
    events = stream_events(
        scripted_gateway,
        "/responses",
        {
            "model": "m",
            "instructions": INSTRUCTIONS,  # not carried over: agents send them every turn
            "previous_response_id": first.id,
            "input": [output],
            "tools": [OPENAI_TOOL],
            "stream": True,
        },
        headers,
    )
    for _, data in events:
        validate_event(data)
    names = [name for name, _ in events]
    text = "It is 24 degrees in Paris."
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(text),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == text
    completed = Response.model_validate(events[-1][1]["response"])
    assert completed.output_text == text and completed.previous_response_id == first.id

    # The continuation was served on the whole conversation.
    history = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 24}'},
    ]
    assert engine.requests[-1]["input_ids"] == renderer.render_ids(history, [CHAT_TOOL])
    assert engine.requests[-2]["input_ids"] == renderer.render_ids(history[:2], [CHAT_TOOL])

    [turn] = scripted_gateway.wait_turns(session_id, 1)
    assert turn.request_id == first.id
    assert_recorded(turn, "Let me look.\n" + CALL)
    assert turn.finish_reason == "tool_calls"
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert not turn.history_mismatch
    assert json.loads(turn.next_state_json)["content"] == '{"temp_c": 24}'
    assert json.loads(turn.tools_json) == [CHAT_TOOL]


def test_responses_streamed_tool_call(scripted_gateway, engine):
    """A streamed function call: the message item, then the call's item with its arguments;
    the SDK's stream helper assembles the same response as the non-streamed one."""
    client = openai_client(scripted_gateway)
    engine.script("Checking.\n" + CALL)
    with client.responses.stream(
        model="m",
        input="Weather in Paris?",
        tools=[OPENAI_TOOL],
        extra_headers={"X-Turn-Type": "side"},
    ) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert names[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    message, call = final.output
    assert message.content[0].text.strip() == "Checking."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


def test_responses_raw_body_is_an_sdk_response(scripted_gateway, engine):
    engine.script("Plain text.")
    reply = httpx.post(
        f"{scripted_gateway.base_url}/responses",
        json={"model": "m", "input": [{"role": "user", "content": "hi"}], "store": False},
        headers={"X-Turn-Type": "side"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 200
    body = Response.model_validate(reply.json())
    assert body.output_text == "Plain text." and body.store is False
    # store=false: nothing to continue from.
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(scripted_gateway).responses.create(
            model="m", input="more", previous_response_id=body.id
        )
    assert refused.value.body["param"] == "previous_response_id"


# --- the Messages API ---------------------------------------------------------------------


def test_messages_tool_use_then_tool_result_streamed(
    scripted_gateway, engine, renderer, session_id
):
    """A tool_use block comes back (stop_reason tool_use); the client resends the history with
    a tool_result, streamed: Anthropic's event sequence, and the first turn's next state is
    that result."""
    client = anthropic_client(scripted_gateway)
    # Sessions are the caller's: the raw request below presents the client's key.
    headers = {"X-Session-Id": session_id, "x-api-key": "none"}
    engine.script("Let me look.\n" + CALL, "It is 24 degrees.")
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(
        model="m",
        max_tokens=200,
        system="Answer weather questions with the tool.",
        messages=[question],
        tools=[ANTHROPIC_TOOL],
        extra_headers=headers,
    )
    assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
    text, use = first.content
    assert text.type == "text" and text.text == "Let me look."
    assert use.type == "tool_use" and (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert first.usage.output_tokens == len("Let me look.\n" + CALL)

    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"temp_c": 24}'}
    history = [
        question,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    events = stream_events(
        scripted_gateway,
        "/messages",
        {
            "model": "m",
            "max_tokens": 100,
            "system": "Answer weather questions with the tool.",
            "messages": history,
            "tools": [ANTHROPIC_TOOL],
            "stream": True,
        },
        headers,
    )
    for _, data in events:
        validate_event(data)
    answer = "It is 24 degrees."
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(answer),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert events[-2][1]["usage"]["output_tokens"] == len(answer)

    system = {"role": "system", "content": "Answer weather questions with the tool."}
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    expected = [
        system,
        question,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp_c": 24}'},
    ]
    assert engine.requests[-1]["input_ids"] == renderer.render_ids(expected, [CHAT_TOOL])

    [turn] = scripted_gateway.wait_turns(session_id, 1)
    assert turn.request_id == first.id
    assert_recorded(turn, "Let me look.\n" + CALL)
    assert turn.finalize_reason == FinalizeReason.FINALIZE_REASON_NEXT_STATE
    assert not turn.history_mismatch
    assert json.loads(turn.next_state_json) == {
        "role": "tool",
        "tool_call_id": use.id,
        "content": '{"temp_c": 24}',
    }


def test_messages_streamed_tool_use_with_the_sdk(scripted_gateway, engine):
    client = anthropic_client(scripted_gateway)
    engine.script("Checking.\n" + CALL)
    with client.messages.stream(
        model="m",
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[ANTHROPIC_TOOL],
        extra_headers={"X-Turn-Type": "side"},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    text, use = final.content
    assert text.text.strip() == "Checking."
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    Message.model_validate(final.model_dump())


def test_messages_stop_sequence_reported(scripted_gateway, engine):
    engine.script("one two")
    reply = anthropic_client(scripted_gateway).messages.create(
        model="m",
        max_tokens=50,
        messages=[{"role": "user", "content": "count"}],
        stop_sequences=["three"],
        extra_headers={"X-Turn-Type": "side"},
    )
    assert engine.requests[-1]["sampling_params"]["stop"] == ["three"]
    assert reply.stop_reason == "end_turn"  # the scripted engine stopped on a token, not "three"


# --- against the real engine --------------------------------------------------------------


def test_one_conversation_through_three_apis_is_served_and_recorded_alike(gateway, session_id):
    """The same conversation, greedy, through chat completions, Responses and Messages: the
    same prompt ids, the same sampled ids and log-probs, the same recorded messages."""
    system = f"Be brief. {session_id}"
    question = "Name a colour."
    done = {"X-Session-Done": "true"}
    chat = gateway.openai().chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=6,
        temperature=0,
        extra_headers={"X-Session-Id": f"{session_id}-chat", **done},
    )
    response = openai_client(gateway).responses.create(
        model="m",
        instructions=system,
        input=question,
        max_output_tokens=6,
        temperature=0,
        extra_headers={"X-Session-Id": f"{session_id}-responses", **done},
    )
    message = anthropic_client(gateway).messages.create(
        model="m",
        system=system,
        messages=[{"role": "user", "content": question}],
        max_tokens=6,
        # Not a parameter of the anthropic client any more; older clients send it.
        extra_body={"temperature": 0},
        extra_headers={"X-Session-Id": f"{session_id}-messages", **done},
    )
    text = chat.choices[0].message.content
    assert response.output_text == text
    assert "".join(block.text for block in message.content) == text
    assert chat.usage.prompt_tokens == response.usage.input_tokens == message.usage.input_tokens
    turns = [
        gateway.wait_turns(f"{session_id}-{api}", 1)[0] for api in ("chat", "responses", "messages")
    ]
    assert [t.request_id for t in turns] == [chat.id, response.id, message.id]
    first = turns[0]
    for turn in turns[1:]:
        assert list(turn.prompt_ids) == list(first.prompt_ids)
        assert list(turn.response_ids) == list(first.response_ids)
        assert list(turn.response_logprobs) == pytest.approx(list(first.response_logprobs))
        assert json.loads(turn.messages_json) == json.loads(first.messages_json)


def test_a_session_that_changes_api_is_noticed(gateway, session_id):
    """A Responses turn continued over chat completions with the same history: the turn is
    finalised with history_mismatch (and counted), not silently taken as its next state."""
    headers = {"X-Session-Id": session_id}
    before = gateway.metric("clawrl_gateway_history_mismatches_total")
    first = openai_client(gateway).responses.create(
        model="m", input="Hi", max_output_tokens=4, extra_headers=headers
    )
    gateway.openai().chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More"},
        ],
        max_tokens=4,
        extra_headers={**headers, "X-Session-Done": "true"},
    )
    turns = gateway.wait_turns(session_id, 2)
    assert turns[0].request_id == first.id and turns[0].history_mismatch
    assert gateway.metric("clawrl_gateway_history_mismatches_total") == before + 1


def test_previous_response_id_of_another_key_or_unknown_is_a_400(secured):
    side = {"X-Turn-Type": "side"}
    one, two = openai_client(secured, "sk-test-1"), openai_client(secured, "sk-test-2")
    first = one.responses.create(model="m", input="Hi", max_output_tokens=4, extra_headers=side)
    for client, previous in ((two, first.id), (one, "resp_0123")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model="m", input="Again", previous_response_id=previous, extra_headers=side
            )
        assert refused.value.body["param"] == "previous_response_id"
        assert f"'{previous}' not found" in refused.value.body["message"]
    again = one.responses.create(
        model="m",
        input="Again",
        previous_response_id=first.id,
        max_output_tokens=4,
        extra_headers=side,
    )
    assert again.status in ("completed", "incomplete")
    assert again.previous_response_id == first.id
    assert again.usage.input_tokens > first.usage.input_tokens


def test_each_api_answers_in_its_own_error_shape(secured):
    """Anthropic's client authenticates with x-api-key; refusals and auth failures come back
    as each SDK's own exceptions, from each API's error body."""
    side = {"X-Turn-Type": "side"}
    question = [{"role": "user", "content": "Hi"}]
    reply = anthropic_client(secured, "sk-test-1").messages.create(
        model="m", max_tokens=4, messages=question, extra_headers=side
    )
    assert reply.type == "message"
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        anthropic_client(secured, "wrong").messages.create(
            model="m", max_tokens=4, messages=question
        )
    assert unauthorized.value.body["type"] == "error"
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic_client(secured, "sk-test-1").messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "image blocks are not supported" in refused.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as builtin:
        openai_client(secured, "sk-test-1").responses.create(
            model="m", input="Hi", tools=[{"type": "web_search"}]
        )
    assert builtin.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.AuthenticationError):
        openai_client(secured, "wrong").responses.create(model="m", input="Hi")


def test_messages_without_a_session_header_form_a_session(gateway, session_id):
    """No session header: a Messages request resending the history is the next turn of the
    same caller's conversation, as on chat completions."""
    client = anthropic_client(gateway, f"key-{session_id}")
    question = {"role": "user", "content": f"Hi {session_id}"}
    first = client.messages.create(model="m", max_tokens=4, messages=[question])
    reply = {"role": "assistant", "content": [block.model_dump() for block in first.content]}
    second = client.messages.create(
        model="m",
        max_tokens=4,
        messages=[question, reply, {"role": "user", "content": "More"}],
        extra_headers={"X-Session-Done": "true"},
    )
    ids = (first.id, second.id)
    deadline = time.monotonic() + 15
    while len(turns := [t for t in gateway.turns() if t.request_id in ids]) < 2:
        assert time.monotonic() < deadline, "both turns must reach the stream"
        time.sleep(0.05)
    first_turn, second_turn = sorted(turns, key=lambda t: t.turn_index)
    assert first_turn.session_id == second_turn.session_id
    assert json.loads(first_turn.next_state_json) == {"role": "user", "content": "More"}
    assert not first_turn.history_mismatch
