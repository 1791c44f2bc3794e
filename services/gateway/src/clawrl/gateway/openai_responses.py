"""The OpenAI Responses API (`POST /v1/responses`) as the gateway accepts it: the request turned
into the one conversation model the chat route serves (chat-completions shaped messages and
tools in a `ChatRequest`). Features the gateway cannot serve faithfully (built-in tools,
images, files, audio, structured outputs, background responses) are refused with a 400 naming
them. The reply, a `response` object or its stream of events, is openai_responses_output.py's.
Pure: no I/O (previous_response_id is resolved by the caller, from conversations.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.generation import Completion
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
