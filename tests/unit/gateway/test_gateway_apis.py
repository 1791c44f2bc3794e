"""The Responses and Messages APIs without a process: each request converts to the conversation
the chat route would serve for the same conversation (one render, one recording); features the
gateway cannot serve faithfully are refused with a 400 naming them; bodies and stream events
from the serving core (against a scripted engine over real HTTP) validate against the official
SDKs' own types, in the order each API defines."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from aiohttp import web
from anthropic.types import Message
from openai.types.responses import Response

from clawrl.gateway.anthropic_messages import MessageEvents, message_object, parse_messages_request
from clawrl.gateway.errors import InvalidRequest, Overloaded, Unauthorized, to_anthropic
from clawrl.gateway.openai_responses import continued, parse_responses_request, stored_messages
from clawrl.gateway.openai_responses_output import ResponseEvents, response_body
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.serving import ChatService
from clawrl.gateway.sessions import history_hashes
from tests.scripted_engine import sse
from tests.sdk_events import RESPONSE_EVENTS, validate_event
from tests.unit.gateway.test_gateway_serving_core import scripted_service

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS},
}
OPENAI_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": PARAMETERS,
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}
ARGUMENTS = '{"city": "Paris"}'


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# --- one conversation model ---------------------------------------------------------------


def test_one_conversation_through_three_apis_renders_the_same():
    """System text, a question, a reply with a tool call, its result, a follow-up: the chat
    route's render messages and tools, whichever API sent them."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ARGUMENTS},
    }
    chat = parse_chat_request(
        body(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "24C"},
                {"role": "user", "content": "Thanks"},
            ],
            tools=[CHAT_TOOL],
        ),
        {},
    )
    responses = parse_responses_request(
        body(
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": ARGUMENTS,
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "24C"},
                {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
            ],
            tools=[OPENAI_TOOL],
        ),
        {},
    )
    responses = continued(responses, [], None).chat
    messages = parse_messages_request(
        body(
            model="m",
            max_tokens=10,
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Looking."},
                        {
                            "type": "tool_use",
                            "id": "call_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": "24C"},
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            tools=[ANTHROPIC_TOOL],
        ),
        {},
    )
    assert responses.render_messages == chat.render_messages
    assert messages.render_messages == chat.render_messages
    assert responses.tools == messages.tools == [CHAT_TOOL]
    assert (chat.api, responses.api, messages.api) == ("chat", "responses", "messages")
    # Recorded as chat messages, so the judge and trainer read one format.
    assert responses.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "24C"}
    assert messages.messages == responses.messages
    # One API's history never extends another's: a session that mixes them is noticed.
    apis = ("chat", "responses", "messages")
    hashes = {api: history_hashes(chat.render_messages, api)[-1] for api in apis}
    assert len(set(hashes.values())) == 3


def test_previous_response_id_continues_like_a_resent_history():
    first = parse_responses_request(body(instructions="Be brief.", input="Hi"), {})
    first = continued(first, [], None)

    class Done:
        message = {"role": "assistant", "content": "Hello!"}

    history = stored_messages(first, Done)
    assert history == [{"role": "user", "content": "Hi"}, Done.message]
    follow = parse_responses_request(
        body(instructions="Be terse.", input="Again", previous_response_id="resp_1"),
        {"x-session-id": ""},
    )
    follow = continued(follow, history, "sess-1")
    resent = parse_chat_request(
        body(
            messages=[
                {"role": "system", "content": "Be terse."},  # instructions are not carried over
                {"role": "user", "content": "Hi"},
                Done.message,
                {"role": "user", "content": "Again"},
            ]
        ),
        {},
    )
    assert follow.chat.render_messages == resent.render_messages
    assert follow.chat.session.session_id == "sess-1"
    named = continued(
        parse_responses_request(body(input="x"), {"x-session-id": "mine"}), history, "sess-1"
    )
    assert named.chat.session.session_id == "mine"  # the client's own session id wins


def test_sampling_options_reach_the_chat_request():
    responses = continued(
        parse_responses_request(
            body(input="x", temperature=0.3, top_p=0.9, max_output_tokens=7, stop=["END"]), {}
        ),
        [],
        None,
    ).chat
    assert (responses.temperature, responses.top_p, responses.max_tokens) == (0.3, 0.9, 7)
    assert responses.stop == ["END"]
    messages = parse_messages_request(
        body(
            model="m",
            max_tokens=9,
            messages=[{"role": "user", "content": "x"}],
            temperature=0.5,
            top_p=0.8,
            stop_sequences=["END"],
            metadata={"user_id": "u1"},
        ),
        {"x-api-key": "sk-1"},
    )
    assert (messages.temperature, messages.top_p, messages.max_tokens) == (0.5, 0.8, 9)
    assert messages.stop == ["END"]
    # x-api-key is the caller, as a Bearer key is; metadata.user_id is the end user.
    bearer = parse_chat_request(
        body(messages=[{"role": "user", "content": "x"}], user="u1"),
        {"authorization": "Bearer sk-1"},
    )
    assert messages.session.scope == bearer.session.scope
    assert messages.session.owner == bearer.session.owner != "-"


# --- refusals -----------------------------------------------------------------------------

MESSAGE = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' is not supported"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type", "function"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "input_image content is not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "input[0].content[0].type",
            "input_audio content is not supported",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "previous_respon"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning'"),
        ({"tool_choice": "required"}, "tool_choice", "cannot|would change"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "json_schema"),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "never drops"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "not a reasoning model"),
        ({"include": ["file_search_call.results"]}, "include", "not supported"),
        ({"temperature": 3}, "temperature", "between 0 and 2"),
        ({"input": 5}, "input", "must be"),
        # A part type that is an array or object (a 500 before: unhashable in a set lookup).
        (
            {"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]},
            "input[0].content[0]",
            "must be a text part",
        ),
        ({"input": [{"role": "user", "content": [{"type": {}}]}]}, "input[0].content[0]", "type"),
    ],
)
def test_responses_refusals(fields, param, says):
    with pytest.raises(InvalidRequest) as refused:
        request = parse_responses_request(body(**{"input": "x", **fields}), {})
        continued(request, [], None)
    assert refused.value.param == param
    assert any(s in refused.value.message for s in says.split("|")), refused.value.message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0].type",
            "'web_search_20250305' is not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
            "image blocks are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
            "document blocks",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "thinking"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config.format",
            "structured outputs",
        ),
        ({"output_config": {"effort": "high"}}, "output_config.effort", "not a reasoning"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "'any' is not supported"),
        ({"temperature": 1.5}, "temperature", "between 0 and 1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or"),
        # A block type that is an array or object (a 500 before: unhashable in a set lookup).
        (
            {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
            "messages[0].content[0]",
            "must be a text block",
        ),
        ({"system": [{"type": {}}]}, "system[0]", "must be a text block"),
    ],
)
def test_messages_refusals(fields, param, says):
    with pytest.raises(InvalidRequest) as refused:
        parse_messages_request(
            body(**{"model": "m", "max_tokens": 5, "messages": MESSAGE, **fields}), {}
        )
    assert refused.value.param == param
    assert says in refused.value.message, refused.value.message


def test_anthropic_error_shapes():
    error = to_anthropic(InvalidRequest("bad", param="x"))
    assert (error.status, error.body) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
    )
    assert to_anthropic(Unauthorized("no")).body["error"]["type"] == "authentication_error"
    overloaded = to_anthropic(Overloaded("paused", retry_after_s=3))
    assert (overloaded.status, overloaded.body["error"]["type"]) == (529, "overloaded_error")
    assert overloaded.headers == {"Retry-After": "3"}
    assert to_anthropic(RuntimeError("boom")).status == 500


# --- the formats, from the serving core ---------------------------------------------------


def engine_events(text: str, finish: str) -> list[dict]:
    return [
        {
            "text": text[:n],
            "output_ids": list(range(n)),
            "meta_info": {
                "prompt_tokens": 3,
                "completion_tokens": n,
                "finish_reason": {"type": finish, "matched": "END"} if n == len(text) else None,
                "output_token_logprobs": [[-0.1, i, "t"] for i in range(n)],
            },
        }
        for n in range(1, len(text) + 1)
    ]


@pytest.fixture
async def service():
    """`await make(text, finish)` -> a ChatService whose engine answers `text`."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(text: str, finish: str = "stop") -> ChatService:
            async def generate(request: web.Request) -> web.StreamResponse:
                events = engine_events(text, finish)
                if not (await request.json())["stream"]:
                    return web.json_response(events[-1])
                return await sse(request, events)

            return await scripted_service(stack, generate)

        yield make


def responses_request(**fields):
    request = parse_responses_request(body(**{"input": "weather?", **fields}), {})
    return continued(request, [], None)


async def stream_of(service, chat, encoder) -> list[tuple[str, dict]]:
    stream = await service.open_stream(chat, time.perf_counter(), encoder)
    raw = [line async for line in stream.lines]
    await stream.release()
    events = []
    for line in raw:
        head, data = line.decode().rstrip("\n").split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    return events


async def test_responses_body_and_stream_with_a_tool_call(service):
    svc = await service("Let me look.\n" + CALL)
    request = responses_request(tools=[OPENAI_TOOL])
    whole = Response.model_validate(response_body(request, await svc.generate(request.chat), "m"))
    assert whole.status == "completed"
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output[0].content[0].text == "Let me look."
    assert whole.output[1].arguments == ARGUMENTS and whole.output[1].call_id.startswith("call_")

    events = await stream_of(
        svc,
        responses_request(tools=[OPENAI_TOOL], stream=True).chat,
        ResponseEvents.factory(request),
    )
    for _, data in events:
        validate_event(data)
    names = [name for name, _ in events]
    deltas = names.count("response.output_text.delta")
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    final = Response.model_validate(events[-1][1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text.strip() == "Let me look."
    assert final.output[1].name == "get_weather" and final.output[1].arguments == ARGUMENTS
    assert final.usage.output_tokens == len("Let me look.\n" + CALL)


async def test_responses_cut_by_max_output_tokens_is_incomplete(service):
    svc = await service("a long answer", finish="length")
    request = responses_request(max_output_tokens=13, include=["message.output_text.logprobs"])
    whole = Response.model_validate(response_body(request, await svc.generate(request.chat), "m"))
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert len(whole.output[0].content[0].logprobs) == len("a long answer")
    events = await stream_of(
        svc, responses_request(stream=True).chat, ResponseEvents.factory(request)
    )
    assert events[-1][0] == "response.incomplete"
    RESPONSE_EVENTS["response.incomplete"].model_validate(events[-1][1])


async def test_messages_body_and_stream_with_a_tool_call(service):
    svc = await service("Let me look.\n" + CALL)
    fields = {"model": "m", "max_tokens": 100, "messages": MESSAGE, "tools": [ANTHROPIC_TOOL]}
    chat = parse_messages_request(body(**fields), {})
    whole = Message.model_validate(message_object(chat, await svc.generate(chat), "m"))
    assert whole.stop_reason == "tool_use"
    assert [block.type for block in whole.content] == ["text", "tool_use"]
    assert whole.content[1].input == {"city": "Paris"}

    events = await stream_of(
        svc, parse_messages_request(body(**fields, stream=True), {}), MessageEvents
    )
    for _, data in events:
        validate_event(data)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta") - 1
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    starts = [data for name, data in events if name == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1]
    assert starts[1]["content_block"]["type"] == "tool_use"
    json_delta = [d for n, d in events if n == "content_block_delta"][-1]["delta"]
    assert json.loads(json_delta["partial_json"]) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_messages_stop_sequence_and_max_tokens(service):
    fields = {"model": "m", "max_tokens": 100, "messages": MESSAGE, "stop_sequences": ["END"]}
    chat = parse_messages_request(body(**fields), {})
    stopped = message_object(chat, await (await service("one two")).generate(chat), "m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    cut = message_object(chat, await (await service("one", "length")).generate(chat), "m")
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("max_tokens", None)


def test_refusal_messages_are_formatted():
    """Validation messages are formatted like str.format (they showed `{kind!r}` and `{{`
    literally before)."""
    with pytest.raises(InvalidRequest) as image:
        parse_chat_request(
            body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), {}
        )
    assert image.value.message.endswith("got type 'image_url'")
    with pytest.raises(InvalidRequest) as tool:
        parse_chat_request(body(messages=MESSAGE, tools=[{"type": "x"}]), {})
    assert "{'type': 'function', 'function': {'name': ...}}" in tool.value.message
