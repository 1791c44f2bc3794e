"""The Anthropic Messages API (`POST /v1/messages`) as the gateway accepts it: the request turned
into the one conversation model the chat route serves (chat-completions shaped messages and
tools in a `ChatRequest`), and a finished generation turned into a `message` object or its
stream of events (`message_start` ... `message_stop`). Features the gateway cannot serve
faithfully (server tools, images, documents, extended thinking, forced tool use) are refused
with a 400 naming them. Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from pydantic import Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from clawrl.gateway.errors import InvalidRequest, to_anthropic
from clawrl.gateway.generation import Completion
from clawrl.gateway.protocol import (
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
from clawrl.gateway.serving import ChatService, StreamState
from clawrl.gateway.tool_calls import Delta, ToolCall

NOT_FAITHFUL = "the gateway serves the policy's own samples, and {what} would change them"
MEDIA_BLOCKS = frozenset({"image", "document", "search_result"})


class MessagesBody(_Model):
    """The body of POST /v1/messages (session keys already taken out)."""

    model: StrictStr
    max_tokens: StrictInt
    messages: Annotated[list[Any], Field(min_length=1)]
    system: StrictStr | list[Any] | None = None
    stop_sequences: Any = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    metadata: dict[str, Any] | None = None
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None
    output_config: Any = None

    # Anthropic's temperature range is [0, 1].
    _temperature = field_validator("temperature")(_between(0.0, 1.0))
    _top_p = field_validator("top_p")(_between(0.0, 1.0, low_open=True))
    _stop = field_validator("stop_sequences")(classmethod(lambda cls, raw: stop_sequences(raw)))

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise _fail("must be at least 1, got {value}", value=value)
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _fail("must be at least 1, got {value}", value=value)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, raw: Any) -> str | None:
        if raw is None:
            return None
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in ("auto", "none"):
            return kind
        if kind in ("any", "tool"):
            raise _fail(
                "{kind!r} is not supported: "
                + NOT_FAITHFUL.format(what="forcing a tool call")
                + "; send {{'type': 'auto'}} (or 'none')",
                kind=kind,
            )
        raise _fail("must be an object whose type is auto, any, tool or none, got {raw!r}", raw=raw)


def parse_messages_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Parse and validate a /v1/messages body into the request the chat route serves."""
    data = parse_body(body)
    metadata = data.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    session = session_meta(data, headers, user=user)
    try:
        parsed = MessagesBody.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    refuse_unsupported(parsed)
    messages = []
    system = system_text(parsed.system)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(parsed.messages):
        messages += chat_messages(message, f"messages[{i}]")
    tools = [chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(parsed.tools or ())]
    render = [render_message(m) for m in messages]
    return ChatRequest(
        messages=messages,
        render_messages=render,
        tools=tools or None,
        tool_choice=parsed.tool_choice,
        model=parsed.model,
        stream=bool(parsed.stream),
        temperature=float(1.0 if parsed.temperature is None else parsed.temperature),
        top_p=float(1.0 if parsed.top_p is None else parsed.top_p),
        top_k=-1 if parsed.top_k is None else parsed.top_k,
        max_tokens=parsed.max_tokens,
        stop=parsed.stop_sequences,
        session=session,
        input_chars=sum(len(m["content"]) for m in render) + len(str(tools)),
        api="messages",
    )


def refuse_unsupported(body: MessagesBody) -> None:
    thinking = body.thinking
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") == "disabled"
    ):
        raise InvalidRequest(
            "extended thinking is not supported: the policy model is not a reasoning model",
            param="thinking",
        )
    if body.mcp_servers:
        raise InvalidRequest("MCP servers are not supported", param="mcp_servers")
    if body.container is not None:
        raise InvalidRequest("containers (code execution) are not supported", param="container")
    config = body.output_config
    if config is not None and not isinstance(config, dict):
        raise InvalidRequest(
            f"output_config must be an object, got {_kind(config)}", param="output_config"
        )
    if (config or {}).get("format") is not None:
        raise InvalidRequest(
            "output_config.format (structured outputs) is not supported: "
            + NOT_FAITHFUL.format(what="constraining the output to a schema"),
            param="output_config.format",
        )
    if (config or {}).get("effort") is not None:
        raise InvalidRequest(
            "output_config.effort is not supported: the policy model is not a reasoning model",
            param="output_config.effort",
        )


def system_text(system: str | list[Any] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "".join(block_text(block, f"system[{i}]") for i, block in enumerate(system))


def block_text(block: Any, param: str) -> str:
    """The text of a text block; anything else here is refused."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if isinstance(kind, str) and kind in MEDIA_BLOCKS:  # an array or object is not hashable
        raise InvalidRequest(
            f"{param}: {kind} blocks are not supported: the policy model reads text only",
            param=f"{param}.type",
        )
    raise InvalidRequest(
        f"{param} must be a text block ({{'type': 'text', 'text': ...}}), got "
        + (repr(kind) if kind else _kind(block)),
        param=param,
    )


def chat_messages(message: Any, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text and tool_use blocks are one
    assistant message (text joined, calls in order); a user's tool_result blocks are tool
    messages, its text a user message, in the order the blocks come."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object, got {_kind(message)}", param=param)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequest(
            f"{param}.role must be 'user' or 'assistant', got {role!r}", param=f"{param}.role"
        )
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{param}.content must be a string or an array of content blocks, got {_kind(content)}",
            param=f"{param}.content",
        )
    if role == "assistant":
        return [assistant_message(content, f"{param}.content")]
    out: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{param}.content[{i}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            out.append(tool_message(block, at))
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block_text(block, at)
        else:
            out.append({"role": "user", "content": block_text(block, at)})
    return out or [{"role": "user", "content": ""}]


def assistant_message(blocks: list[Any], param: str) -> dict[str, Any]:
    texts, calls = [], []
    for i, block in enumerate(blocks):
        at = f"{param}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            name, identifier, arguments = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not isinstance(identifier, str):
                raise InvalidRequest(f"{at} must have a string id and name", param=at)
            if not isinstance(arguments, dict):
                raise InvalidRequest(
                    f"{at}.input must be an object, got {_kind(arguments)}", param=f"{at}.input"
                )
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": identifier, "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            raise InvalidRequest(
                f"{at}: {kind} blocks are not supported (this model does not produce them)",
                param=f"{at}.type",
            )
        elif kind is not None and kind != "text":
            raise InvalidRequest(
                f"{at}: block type {kind!r} is not supported: the gateway takes text, tool_use "
                "and tool_result blocks",
                param=f"{at}.type",
            )
        else:
            texts.append(block_text(block, at))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = calls
    return message


def tool_message(block: dict[str, Any], param: str) -> dict[str, Any]:
    identifier = block.get("tool_use_id")
    if not isinstance(identifier, str):
        raise InvalidRequest(f"{param}.tool_use_id must be a string", param=f"{param}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        text = "".join(block_text(b, f"{param}.content[{i}]") for i, b in enumerate(content))
    elif isinstance(content, str):
        text = content
    else:
        raise InvalidRequest(
            f"{param}.content must be a string or an array of text blocks",
            param=f"{param}.content",
        )
    if block.get("is_error"):
        # The chat model has no error flag on a tool message: the text carries it.
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": identifier, "content": text}


def chat_tool(tool: Any, param: str) -> dict[str, Any]:
    """A client tool as the chat template takes it; server tools are refused."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"{param} must be an object, got {_kind(tool)}", param=param)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise InvalidRequest(
            f"{param}: tool type {kind!r} is not supported: the gateway serves custom (client) "
            "tools only (Anthropic's built-in tools such as web search, bash, text editor or "
            "computer use are not served)",
            param=f"{param}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{param}.name must be a non-empty string", param=f"{param}.name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(
            f"{param}.input_schema must be an object, got {_kind(schema)}",
            param=f"{param}.input_schema",
        )
    function = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = schema
    return {"type": "function", "function": function}


# --- the response -------------------------------------------------------------------------


def stop_reason(done: Completion, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if done.calls:
        return "tool_use", None
    if done.finish == "length":
        return "max_tokens", None
    matched = done.generation.matched_stop
    if matched is not None and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_object(request: ChatRequest, done: Completion, model: str) -> dict[str, Any]:
    """The message object of a finished, non-streamed request: the text (left out when
    empty, or only whitespace around tool calls), then one tool_use block per call."""
    text = done.content or ""
    content: list[dict[str, Any]] = []
    if text.strip() if done.calls else text:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(call) for call in done.calls]
    reason, sequence = stop_reason(done, request.stop)
    return {
        "id": done.request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(done.prompt_tokens, done.completion_tokens),
    }


class MessageEvents:
    """The Messages stream: message_start; content blocks in the order the reply makes them
    (text: content_block_start, text_delta ..., content_block_stop, opened at the first
    visible text; tool_use: start, one input_json_delta, stop); message_delta with the stop
    reason and usage; message_stop. A stream that breaks ends with an error event."""

    def __init__(self, stream: StreamState, service: ChatService):
        self.stream = stream
        self.model = service.model_name
        self.retry_after_s = service.retry_after_s
        self.index = 0  # of the next content block
        self.text_open = False
        self.held = ""  # leading whitespace, held until it is known whether text follows

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        body = orjson.dumps({"type": kind, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"

    def opening(self) -> list[bytes]:
        message = {
            "id": self.stream.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(len(self.stream.prompt_ids), 0),
        }
        return [self.event("message_start", message=message)]

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [self.event("content_block_stop", index=self.index - 1)]

    def _text(self, text: str) -> list[bytes]:
        out = []
        if not self.text_open:
            self.text_open = True
            block = {"type": "text", "text": ""}
            out.append(self.event("content_block_start", index=self.index, content_block=block))
        delta = {"type": "text_delta", "text": text}
        out.append(self.event("content_block_delta", index=self.index, delta=delta))
        return out

    def piece(self, delta: Delta) -> list[bytes]:
        if delta.tool_call is not None:
            self.held = ""  # whitespace before a call is no text block of its own
            call = delta.tool_call
            out = self._close_text()
            start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            json_delta = {"type": "input_json_delta", "partial_json": call.arguments}
            out += [
                self.event("content_block_start", index=self.index, content_block=start),
                self.event("content_block_delta", index=self.index, delta=json_delta),
                self.event("content_block_stop", index=self.index),
            ]
            self.index += 1
            return out
        if not self.text_open and not (self.held + delta.content).strip():
            self.held += delta.content
            return []
        text, self.held = self.held + delta.content, ""
        return self._text(text)

    def closing(self, done: Completion) -> list[bytes]:
        out = []
        if self.held and not done.calls:
            out += self._text(self.held)
        out += self._close_text()
        reason, sequence = stop_reason(done, self.stream.request.stop)
        out += [
            self.event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": done.completion_tokens},
            ),
            self.event("message_stop"),
        ]
        return out

    def failure(self, exc: Exception) -> bytes:
        return self.event("error", error=to_anthropic(exc, self.retry_after_s).body["error"])
