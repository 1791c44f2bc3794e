"""The OpenAI chat-completions request as the gateway accepts it: parsing, validation with
precise `param` paths, and the session keys (headers, or the same keys in the body, which are
stripped before serving). Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.sessions import caller_scope

ROLES = ("system", "developer", "user", "assistant", "tool")
TURN_TYPES = ("main", "side")
SESSION_BODY_KEYS = ("session_id", "turn_type", "session_done")
MAX_STOP_SEQUENCES = 16
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class SessionMeta:
    """What the client said about the session (headers win over body keys)."""

    session_id: str | None = None
    turn_type: str | None = None  # None: the configured default applies
    session_done: bool = False
    scope: str = "-"  # caller_scope: whose anonymous conversations this request may continue


@dataclass
class ChatRequest:
    """A validated chat-completions request."""

    messages: list[dict[str, Any]]  # as sent (recorded verbatim)
    render_messages: list[dict[str, Any]]  # text content, roles the template knows
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    session: SessionMeta = field(default_factory=SessionMeta)
    input_chars: int = 0  # size of messages + tools, to decide where to tokenise

    @property
    def parse_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or 400."""
    if not body:
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {_kind(data)}")
    return data


def parse_chat_request(body: bytes, headers: Mapping[str, str]) -> ChatRequest:
    """Parse and validate a /v1/chat/completions body; session keys are taken out of it."""
    data = parse_body(body)
    session = session_meta(data, headers)
    messages, render_messages, chars = _messages(data.get("messages"))
    tools, tool_chars = _tools(data.get("tools"))
    n = _int(data, "n", minimum=1)
    if n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    max_tokens = _int(data, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int(data, "max_tokens", minimum=1)
    stream = _bool(data, "stream")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    top_logprobs = _int(data, "top_logprobs", minimum=0)
    if top_logprobs is not None and top_logprobs > 20:
        raise InvalidRequest("top_logprobs must be at most 20", param="top_logprobs")
    return ChatRequest(
        messages=messages,
        render_messages=render_messages,
        tools=tools,
        tool_choice=_tool_choice(data.get("tool_choice"), tools),
        model=model,
        stream=stream,
        include_usage=bool(stream and options and options.get("include_usage")),
        temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0),
        max_tokens=max_tokens,
        stop=_stop(data.get("stop")),
        seed=_int(data, "seed"),
        frequency_penalty=_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        logprobs=_bool(data, "logprobs"),
        session=session,
        input_chars=chars + tool_chars,
    )


def session_meta(data: dict[str, Any], headers: Mapping[str, str]) -> SessionMeta:
    """Session keys from headers or body; the body keys are removed from `data`."""
    body = {key: data.pop(key) for key in SESSION_BODY_KEYS if key in data}
    session_id = headers.get("x-session-id") or body.get("session_id")
    if session_id is not None:
        session_id = str(session_id).strip() or None
    if session_id is not None and len(session_id) > 256:
        raise InvalidRequest("the session id is longer than 256 characters", param="session_id")
    turn_type = headers.get("x-turn-type") or body.get("turn_type")
    if turn_type is not None:
        turn_type = str(turn_type).strip().lower()
        if turn_type not in TURN_TYPES:
            raise InvalidRequest(
                f"X-Turn-Type must be 'main' or 'side', got {turn_type!r}", param="turn_type"
            )
    done = headers.get("x-session-done")
    if done is None:
        done = body.get("session_done", False)
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    user = data.get("user")
    scope = caller_scope(
        credential.strip() if scheme.lower() == "bearer" else None,
        user if isinstance(user, str) else None,
    )
    return SessionMeta(session_id, turn_type, _truthy(done), scope)


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in TRUE_WORDS


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _text(content: Any, param: str, *, nullable: bool) -> tuple[str, int]:
    """Message content as text (a string or a list of text parts) and its length."""
    if content is None:
        if nullable:
            return "", 0
        raise InvalidRequest(f"{param} is required and must be a string", param=param)
    if isinstance(content, str):
        return content, len(content)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(f"{where} must be an object, got {_kind(part)}", param=where)
            if part.get("type") != "text":
                raise InvalidRequest(
                    f"{where}: only text content parts are supported, got type "
                    f"{part.get('type')!r}",
                    param=where,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
            texts.append(text)
        joined = "".join(texts)
        return joined, len(joined)
    raise InvalidRequest(
        f"{param} must be a string or an array of text parts, got {_kind(content)}", param=param
    )


def _messages(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    if raw is None:
        raise InvalidRequest("'messages' is a required property", param="messages")
    if not isinstance(raw, list):
        raise InvalidRequest(f"messages must be an array, got {_kind(raw)}", param="messages")
    if not raw:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    rendered = []
    chars = 0
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object, got {_kind(message)}", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"{where}.role: unknown role {role!r} (expected one of {', '.join(ROLES)})",
                param=f"{where}.role",
            )
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if tool_calls is not None:
            chars += _check_tool_calls(tool_calls, f"{where}.tool_calls")
        text, size = _text(message.get("content"), f"{where}.content", nullable=role == "assistant")
        chars += size
        copy = {"role": "system" if role == "developer" else role, "content": text}
        if tool_calls:
            copy["tool_calls"] = tool_calls
        rendered.append(copy)
    return raw, rendered, chars


def _check_tool_calls(calls: Any, param: str) -> int:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{param} must be an array", param=param)
    size = 0
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f"{where} must be an object with function.name", param=f"{where}.function"
            )
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            raise InvalidRequest(
                f"{where}.function.arguments must be a JSON string",
                param=f"{where}.function.arguments",
            )
        size += len(arguments) if isinstance(arguments, str) else 64
    return size


def _tools(raw: Any) -> tuple[list[dict[str, Any]] | None, int]:
    if raw is None:
        return None, 0
    if not isinstance(raw, list):
        raise InvalidRequest(f"tools must be an array, got {_kind(raw)}", param="tools")
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(
                f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=where,
            )
        if tool.get("type", "function") != "function":
            raise InvalidRequest(
                f"{where}.type: only 'function' tools are supported", param=f"{where}.type"
            )
    # Rendering cost grows with the schemas' size; str() is a cheap enough estimate of it.
    return (raw or None), sum(len(str(tool)) for tool in raw)


def _tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> Any:
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise InvalidRequest(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {raw!r}",
                param="tool_choice",
            )
        return raw
    if isinstance(raw, dict) and isinstance((raw.get("function") or {}).get("name"), str):
        name = raw["function"]["name"]
        if not any(tool["function"]["name"] == name for tool in tools or []):
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not in tools",
                param="tool_choice",
            )
        return raw
    raise InvalidRequest("tool_choice is malformed", param="tool_choice")


def _bool(data: dict[str, Any], key: str) -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be a boolean, got {_kind(value)}", param=key)
    return value


def _int(data: dict[str, Any], key: str, minimum: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InvalidRequest(f"{key} must be an integer, got {value!r}", param=key)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"{key} must be at least {minimum}, got {value}", param=key)
    return value


def _number(data: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidRequest(f"{key} must be a number, got {value!r}", param=key)
    if not low <= value <= high:
        raise InvalidRequest(f"{key} must be between {low:g} and {high:g}, got {value}", param=key)
    return float(value)


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    return [s for s in stops if s]


def dumps(value: Any) -> bytes:
    """JSON bytes (the gateway's one serializer)."""
    return orjson.dumps(value)
