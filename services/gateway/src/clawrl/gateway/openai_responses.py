"""The OpenAI Responses API (`POST /v1/responses`) as the gateway accepts it: the request turned
into the one conversation model the chat route serves (chat-completions shaped messages and
tools in a `ChatRequest`), and a finished generation turned into a `response` object or its
stream of events (`response.created` ... `response.completed`). Features the gateway cannot
serve faithfully (built-in tools, images, files, audio, structured outputs, background
responses) are refused with a 400 naming them. Pure: no I/O (previous_response_id is resolved
by the caller, from conversations.py)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from clawrl.gateway.errors import InvalidRequest, to_http
from clawrl.gateway.protocol import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    Number,
    _between,
    _fail,
    _kind,
    _Model,
    invalid_request,
    parse_body,
    render_message,
    session_meta,
    stop_sequences,
)
from clawrl.gateway.serving import ChatService, Completion, StreamState, openai_logprobs
from clawrl.gateway.tool_calls import Delta, ToolCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` values the gateway honours, or that ask for items it never produces.
INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image", "file", "audio"})
ROLES = ("user", "assistant", "system", "developer")
NOT_FAITHFUL = "the gateway serves the policy's own samples, and {what} would change them"


class ResponsesBody(_Model):
    """The body of POST /v1/responses (session keys already taken out)."""

    input: StrictStr | list[Any]
    model: StrictStr | None = None
    instructions: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: Annotated[StrictStr, Field(min_length=1)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    max_output_tokens: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    include: list[StrictStr] | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    stop: Any = None  # not OpenAI's: the chat route's stop sequences, for clients that need them
    text: Any = None
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None

    _temperature = field_validator("temperature")(_between(0.0, 2.0))
    _top_p = field_validator("top_p")(_between(0.0, 1.0, low_open=True))

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _fail("must be at least 1, got {value}", value=value)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _fail("must be between 0 and {n}, got {value}", n=MAX_TOP_LOGPROBS, value=value)
        return value

    _stop = field_validator("stop")(classmethod(lambda cls, raw: stop_sequences(raw)))

    @field_validator("include")
    @classmethod
    def _include(cls, values: list[str] | None) -> list[str] | None:
        for value in values or ():
            if value not in INCLUDES:
                raise _fail(
                    "{value!r} is not supported (only {known})",
                    value=value,
                    known=", ".join(sorted(INCLUDES)),
                )
        return values

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, raw: Any) -> Any:
        if raw is None or raw in ("none", "auto"):
            return raw
        if raw == "required" or isinstance(raw, dict):
            raise _fail(
                "{choice} is not supported: "
                + NOT_FAITHFUL.format(what="forcing a tool call")
                + "; send 'auto' (or 'none')",
                choice="'required'" if raw == "required" else "a specific tool",
            )
        raise _fail("must be 'none', 'auto', 'required' or a tool, got {raw!r}", raw=raw)


@dataclass
class ResponsesRequest:
    """A validated /v1/responses request: what the Response object echoes, the conversation
    items it adds (chat messages), and the ChatRequest it is served as once the stored
    history (previous_response_id) is put in front by `continued`."""

    chat: ChatRequest  # messages: this request's own (instructions first), before continuation
    items: list[dict[str, Any]]  # this request's input items as chat messages
    instructions: str | None
    previous_response_id: str | None
    store: bool
    tools: list[dict[str, Any]]  # as sent, for the Response object
    tool_choice: str
    parallel_tool_calls: bool
    metadata: dict[str, str]
    user: str | None
    top_logprobs: int


def parse_responses_request(body: bytes, headers: Mapping[str, str]) -> ResponsesRequest:
    """Parse and validate a /v1/responses body; session keys are taken out of it. Its `chat`
    has no messages yet: `continued` puts them in, with the stored history if any."""
    data = parse_body(body)
    session = session_meta(data, headers)
    try:
        parsed = ResponsesBody.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    refuse_unsupported(parsed)
    items = input_messages(parsed.input)
    tools = [function_tool(tool, f"tools[{i}]") for i, tool in enumerate(parsed.tools or ())]
    logprobs = LOGPROBS_INCLUDE in (parsed.include or ())
    chat = ChatRequest(
        messages=[],
        render_messages=[],
        tools=[chat_tool(tool) for tool in tools] or None,
        tool_choice=parsed.tool_choice,
        model=parsed.model,
        stream=bool(parsed.stream),
        temperature=float(1.0 if parsed.temperature is None else parsed.temperature),
        top_p=float(1.0 if parsed.top_p is None else parsed.top_p),
        max_tokens=parsed.max_output_tokens,
        stop=parsed.stop,
        logprobs=logprobs,
        top_logprobs=(parsed.top_logprobs or 0) if logprobs else 0,
        session=session,
        api="responses",
    )
    request = ResponsesRequest(
        chat=chat,
        items=items,
        instructions=parsed.instructions,
        previous_response_id=parsed.previous_response_id,
        store=parsed.store is not False,
        tools=tools,
        tool_choice=parsed.tool_choice or "auto",
        parallel_tool_calls=parsed.parallel_tool_calls is not False,
        metadata=parsed.metadata or {},
        user=parsed.user,
        top_logprobs=parsed.top_logprobs or 0,
    )
    return request


def continued(
    request: ResponsesRequest, history: list[dict[str, Any]], session_id: str | None
) -> ResponsesRequest:
    """The request with a stored conversation in front of its own items (and that
    conversation's session, unless the client named one): the same ChatRequest a client
    resending the whole history would have made."""
    messages = [*history, *request.items]
    if request.instructions is not None:
        messages.insert(0, {"role": "system", "content": request.instructions})
    if not messages:
        raise InvalidRequest("input must contain at least one item", param="input")
    session = request.chat.session
    if session.session_id is None and session_id is not None:
        session = dataclasses.replace(session, session_id=session_id)
    render = [render_message(m) for m in messages]
    chars = sum(len(m["content"]) for m in render) + len(str(request.chat.tools or ""))
    chat = dataclasses.replace(
        request.chat,
        messages=messages,
        render_messages=render,
        session=session,
        input_chars=chars,
    )
    return dataclasses.replace(request, chat=chat)


def stored_messages(request: ResponsesRequest, done: Completion) -> list[dict[str, Any]]:
    """The conversation a continuation of this response starts from: everything but the
    instructions, and the reply."""
    messages = request.chat.messages
    if request.instructions is not None:
        messages = messages[1:]
    return [*messages, done.message]


# --- request conversion -------------------------------------------------------------------


def refuse_unsupported(body: ResponsesBody) -> None:
    """A 400 for every feature the gateway would otherwise have to drop silently."""
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if body.conversation is not None:
        raise InvalidRequest(
            "conversation objects are not supported: continue with previous_response_id, or "
            "send the whole history",
            param="conversation",
        )
    if body.prompt is not None:
        raise InvalidRequest("prompt templates are not supported", param="prompt")
    if body.truncation == "auto":
        raise InvalidRequest(
            "truncation 'auto' is not supported: the gateway never drops input items; send "
            "'disabled'",
            param="truncation",
        )
    if body.max_tool_calls is not None:
        raise InvalidRequest("max_tool_calls is not supported", param="max_tool_calls")
    if body.reasoning is not None and (
        not isinstance(body.reasoning, dict) or any(v is not None for v in body.reasoning.values())
    ):
        raise InvalidRequest(
            "reasoning options are not supported: the policy model is not a reasoning model",
            param="reasoning",
        )
    fmt = body.text.get("format") if isinstance(body.text, dict) else None
    if body.text is not None and not isinstance(body.text, dict):
        raise InvalidRequest(f"text must be an object, got {_kind(body.text)}", param="text")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise InvalidRequest(
            f"text.format {kind!r} is not supported: "
            + NOT_FAITHFUL.format(what="constraining the output to a format")
            + "; send {'type': 'text'}",
            param="text.format",
        )


def function_tool(tool: Any, param: str) -> dict[str, Any]:
    """A function tool as sent; any other (built-in) tool is refused."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{param} must be an object, got {_kind(tool)}", param=param)
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"{param}: tool type {kind!r} is not supported: the gateway serves function tools "
            "only (built-in tools such as web search, file search, computer use or code "
            "interpreter run on OpenAI's side)",
            param=f"{param}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(
            f"{param}.parameters must be an object, got {_kind(parameters)}",
            param=f"{param}.parameters",
        )
    return {
        "type": "function",
        "name": name,
        "description": tool.get("description"),
        "parameters": parameters,
        "strict": tool.get("strict"),
    }


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as the chat template takes it. `strict` is not enforced:
    the arguments are what the policy samples (unconstrained), as on the chat route."""
    function = {"name": tool["name"]}
    if tool["description"] is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool["parameters"] or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def input_messages(raw: str | list[Any]) -> list[dict[str, Any]]:
    """The input items as chat messages: a function_call joins the assistant message before
    it (the Responses API lists a reply's text and its calls as separate items; the chat
    model has one assistant message with both), a function_call_output is a tool message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{param} must be an object, got {_kind(item)}", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(
                    f"{param}.role must be one of {', '.join(ROLES)}, got {role!r}",
                    param=f"{param}.role",
                )
            text = content_text(item.get("content"), f"{param}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise InvalidRequest(
                f"{param}: input item type {kind!r} is not supported: the gateway takes "
                "messages, function_call and function_call_output items"
                + (
                    " (send the item itself, or continue with previous_response_id)"
                    if kind == "item_reference"
                    else ""
                ),
                param=f"{param}.type",
            )
    return messages


def content_text(content: Any, param: str) -> str:
    """The text of a message's content: a string, or text parts; media parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{param} must be a string or an array of content parts, got {_kind(content)}",
            param=param,
        )
    texts = []
    for i, part in enumerate(content):
        at = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        named = isinstance(kind, str)  # an array or object names no type (and is unhashable)
        if named and kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif named and kind in MEDIA_PARTS:
            raise InvalidRequest(
                f"{at}: {kind} content is not supported: the policy model reads text only",
                param=f"{at}.type",
            )
        else:
            raise InvalidRequest(
                f"{at} must be a text part ({{'type': 'input_text', 'text': ...}}), got {kind!r}"
                if kind
                else f"{at} must be an object with a type",
                param=at,
            )
    return "".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(
            f"{param}.{key} must be a string, got {_kind(value)}", param=f"{param}.{key}"
        )
    return value


# --- the response -------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(done: Completion) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def status_of(done: Completion) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details): a reply cut by max_output_tokens (or the context
    window) is incomplete."""
    if done.finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def message_item(
    identifier: str, text: str, status: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "id": identifier,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def call_item(identifier: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": identifier,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


def output_items(request: ResponsesRequest, done: Completion) -> list[dict[str, Any]]:
    """The reply's text as one message item (left out when only calls were made), then one
    function_call item per call: the order a client replays them in, which converts back to
    the assistant message that was recorded."""
    status, _ = status_of(done)
    items = []
    text = done.content or ""
    if text.strip() or not done.calls:
        logprobs = openai_logprobs(done.generation)["content"] if request.chat.logprobs else None
        items.append(message_item(item_id("msg"), text, status, logprobs))
    items += [call_item(item_id("fc"), call) for call in done.calls]
    return items


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: int,
    *,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    done: Completion | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    incomplete = None
    if done is not None:
        status, incomplete = status_of(done)
    chat = request.chat
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": chat.max_tokens,
        "model": model,
        "output": output or [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": chat.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "top_logprobs": request.top_logprobs,
        "top_p": chat.top_p,
        "truncation": "disabled",
        "usage": usage(done) if done is not None else None,
        "user": request.user,
        "metadata": request.metadata,
    }


def response_body(request: ResponsesRequest, done: Completion, model: str) -> dict[str, Any]:
    """The response object of a finished, non-streamed request."""
    return response_object(
        request,
        done.request_id,
        model,
        int(time.time()),
        output=output_items(request, done),
        done=done,
    )


class ResponseEvents:
    """The Responses stream: response.created and response.in_progress; the reply's message
    item (output_item.added, content_part.added, output_text.delta ..., output_text.done,
    content_part.done, output_item.done), opened at its first visible text; one item per
    function call (added, arguments delta and done, done), in the order output_items gives
    them, so the streamed and the whole response agree; then response.completed (or
    response.incomplete). A stream that breaks ends with response.failed."""

    def __init__(self, request: ResponsesRequest, stream: StreamState, service: ChatService):
        self.request = request
        self.stream = stream
        self.model = service.model_name
        self.retry_after_s = service.retry_after_s
        self.created_at = int(time.time())
        self.sequence = 0
        self.message_id: str | None = None  # set once the message item is open
        self.held = ""  # leading whitespace, held until it is known whether text follows
        self.text: list[str] = []
        self.sent_tokens = 0

    @classmethod
    def factory(cls, request: ResponsesRequest):
        return lambda stream, service: cls(request, stream, service)

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def response(self, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.request, self.stream.request_id, self.model, self.created_at, **fields
        )

    def opening(self) -> list[bytes]:
        created = self.response()
        return [
            self.event("response.created", response=created),
            self.event("response.in_progress", response=created),
        ]

    def _logprobs(self) -> list[dict[str, Any]]:
        if not self.request.chat.logprobs:
            return []
        entries = openai_logprobs(self.stream.generation, self.sent_tokens)["content"]
        self.sent_tokens = len(self.stream.generation.ids)
        return entries

    def _open_message(self) -> list[bytes]:
        self.message_id = item_id("msg")
        return [
            self.event(
                "response.output_item.added",
                output_index=0,
                item={**message_item(self.message_id, "", "in_progress", None), "content": []},
            ),
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            ),
        ]

    def _delta(self, text: str) -> list[bytes]:
        out = [] if self.message_id is not None else self._open_message()
        self.text.append(text)
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=self._logprobs(),
            )
        )
        return out

    def piece(self, delta: Delta) -> list[bytes]:
        # Calls are sent at the end, after the message item (see output_items).
        if not delta.content:
            return []
        if self.message_id is None and not (self.held + delta.content).strip():
            self.held += delta.content
            return []
        text, self.held = self.held + delta.content, ""
        return self._delta(text)

    def closing(self, done: Completion) -> list[bytes]:
        status, _ = status_of(done)
        out: list[bytes] = []
        output: list[dict[str, Any]] = []
        if self.message_id is None and not done.calls:
            out += self._delta(self.held) if self.held else self._open_message()
        if self.message_id is not None:
            text = "".join(self.text)
            logprobs = (
                openai_logprobs(done.generation)["content"] if self.request.chat.logprobs else None
            )
            item = message_item(self.message_id, text, status, logprobs)
            part = item["content"][0]
            out += [
                self.event(
                    "response.output_text.done",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=logprobs or [],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    part=part,
                ),
                self.event("response.output_item.done", output_index=0, item=item),
            ]
            output.append(item)
        for call in done.calls:
            index, identifier = len(output), item_id("fc")
            item = call_item(identifier, call)
            at = {"item_id": identifier, "output_index": index}
            out += [
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item=call_item(identifier, call, "in_progress"),
                ),
                self.event("response.function_call_arguments.delta", **at, delta=call.arguments),
                self.event(
                    "response.function_call_arguments.done",
                    **at,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
            output.append(item)
        final = self.response(output=output, done=done)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self.event(kind, response=final))
        return out

    def failure(self, exc: Exception) -> bytes:
        error = to_http(exc, self.retry_after_s).body["error"]
        reason = {"code": error["code"] or "server_error", "message": error["message"]}
        return self.event("response.failed", response=self.response(status="failed", error=reason))
