"""The OpenAI chat-completions request as the gateway accepts it: pydantic models (the one way a
request is validated; ranges as SGLang checks them), errors with precise `param` paths, and the
session keys (headers, or the same keys in the body, which are stripped before serving). Pure:
no I/O."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from clawrl.gateway.errors import InvalidRequest
from clawrl.gateway.sessions import caller_scope

ROLES = ("system", "developer", "user", "assistant", "tool")
# probe: recorded as a main turn, marked Turn.probe, never trained (the judge masks it)
TURN_TYPES = ("main", "side", "probe")
SESSION_BODY_KEYS = ("session_id", "turn_type", "session_done", "episode")
MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
# What an HTTP header value can carry: the session id goes back as X-Session-Id.
HEADER_TEXT = re.compile(r"[\t\x20-\x7e\x80-\xff]*")

Number = StrictInt | StrictFloat


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _fail(message: str, **context: Any) -> PydanticCustomError:
    """A validation error whose message is `message` formatted with `context` (str.format:
    pydantic's own templates know neither `!r` nor `{{` escapes)."""
    return PydanticCustomError("invalid", message.format(**context))


# --- the request models -------------------------------------------------------------------


class _Model(BaseModel):
    # Unknown keys are allowed (clients send OpenAI fields the gateway does not use: metadata,
    # parallel_tool_calls, response_format, name, tool_call_id ...); known ones are strict.
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        if not isinstance(part, dict):
            raise _fail("must be an object, got {kind}", kind=_kind(part))
        if part.get("type") != "text":
            raise _fail(
                "only text content parts are supported, got type {kind!r}", kind=part.get("type")
            )
        return part


class FunctionCall(_Model):
    name: StrictStr
    arguments: Any = "{}"

    @model_validator(mode="before")
    @classmethod
    def _named(cls, fn: Any) -> Any:
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _fail("must be an object with a string name")
        return fn

    @field_validator("arguments")
    @classmethod
    def _json_text(cls, arguments: Any) -> Any:
        if not isinstance(arguments, str | dict):
            raise _fail("must be a JSON string")
        return arguments


class ToolCallIn(_Model):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Any = Field(None, validate_default=True)
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: list[ToolCallIn] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: Any) -> str:
        if role not in ROLES:
            raise _fail(
                "unknown role {role!r} (expected one of {roles})", role=role, roles=", ".join(ROLES)
            )
        return role

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise _fail("is required and must be a string")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Model):
    name: Annotated[StrictStr, Field(min_length=1)]


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _function_tool(cls, tool: Any) -> Any:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail("must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if tool.get("type", "function") != "function":
            raise _fail("only 'function' tools are supported")
        return tool


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: StrictBool | None = None


def stop_sequences(raw: Any) -> list[str]:
    """A validator's body: `stop` as a list of non-empty strings."""
    stops = [] if raw is None else [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail("must be a string or an array of strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _fail("accepts at most {n} sequences", n=MAX_STOP_SEQUENCES)
    return [s for s in stops if s]


def _between(low: float, high: float, *, low_open: bool = False):
    """A validator: a number in [low, high], or (low, high] when `low_open`."""
    bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(cls, value: float | None) -> float | None:
        above = value is None or (value > low if low_open else value >= low)
        if value is not None and not (above and value <= high):
            raise _fail(
                "must be between {low} and {high} {bounds}, got {value}",
                low=f"{low:g}",
                high=f"{high:g}",
                bounds=bounds,
                value=value,
            )
        return value

    return classmethod(check)


class ChatBody(_Model):
    """The body of POST /v1/chat/completions (session keys already taken out)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    model: StrictStr | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    n: StrictInt | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stop: Any = None
    seed: StrictInt | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    user: StrictStr | None = None

    # OpenAI's temperature range; SGLang's own bound is >= 0. SGLang refuses top_p outside
    # (0, 1].
    _temperature = field_validator("temperature")(_between(0.0, 2.0))
    _top_p = field_validator("top_p")(_between(0.0, 1.0, low_open=True))
    _penalties = field_validator("frequency_penalty", "presence_penalty")(_between(-2.0, 2.0))

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _fail("must be at least 1, got {value}", value=value)
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise _fail("must be -1 (no top-k) or at least 1, got {value}", value=value)
        return value

    @field_validator("n")
    @classmethod
    def _one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise _fail("only n=1 is supported, got {value}", value=value)
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise _fail("requires logprobs to be true")
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _fail("must be between 0 and {n}, got {value}", n=MAX_TOP_LOGPROBS, value=value)
        return value

    _stop = field_validator("stop")(classmethod(lambda cls, raw: stop_sequences(raw)))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, raw: Any) -> Any:
        if raw is None or raw in ("none", "auto"):
            return raw
        named = isinstance(raw, dict) and isinstance((raw.get("function") or {}).get("name"), str)
        if raw == "required" or named:
            # Forcing a call would need constrained decoding, and the tokens it samples would
            # no longer be the policy's own samples: refused rather than silently ignored.
            raise _fail(
                "{choice} is not supported: the gateway serves the policy's own samples and "
                "cannot force a tool call; send 'auto' (or 'none')",
                choice="'required'" if raw == "required" else "a named function",
            )
        raise _fail("must be 'none', 'auto', 'required' or a function, got {raw!r}", raw=raw)


# --- the validated request ----------------------------------------------------------------


@dataclass(frozen=True)
class SessionMeta:
    """What the client said about the session (headers win over body keys)."""

    session_id: str | None = None
    turn_type: str | None = None  # None: the configured default applies
    session_done: bool = False
    scope: str = "-"  # caller_scope: whose anonymous conversations this request may continue
    owner: str = "-"  # caller_scope of the API key alone: whose stored responses it may continue
    user: str | None = None  # the caller's end-user id (`user`, Anthropic's metadata.user_id)
    tenant: str = ""  # whose turn it is (common/tenants.py); set by tenants.identify
    episode: bool = False  # X-Episode: a turn of an episode, whose outcome comes later


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
    top_k: int = -1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    session: SessionMeta = field(default_factory=SessionMeta)
    input_chars: int = 0  # size of messages + tools, to decide where to tokenise
    api: str = "chat"  # the API it came through: chat | responses | messages

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
    try:
        chat = ChatBody.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    render_messages, chars = [], 0
    for message in chat.messages:
        text = message.text()
        chars += len(text)
        copy: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": text,
        }
        if message.role == "assistant" and message.tool_calls:
            calls = [call.model_dump(exclude_none=True) for call in message.tool_calls]
            copy["tool_calls"] = calls
            chars += sum(len(str(call["function"].get("arguments", ""))) for call in calls)
        render_messages.append(copy)
    tools = data.get("tools") or None
    return ChatRequest(
        messages=data["messages"],
        render_messages=render_messages,
        tools=tools,
        tool_choice=chat.tool_choice,
        model=chat.model,
        stream=bool(chat.stream),
        include_usage=bool(
            chat.stream and chat.stream_options and chat.stream_options.include_usage
        ),
        temperature=float(1.0 if chat.temperature is None else chat.temperature),
        top_p=float(1.0 if chat.top_p is None else chat.top_p),
        top_k=-1 if chat.top_k is None else chat.top_k,
        max_tokens=chat.max_completion_tokens or chat.max_tokens,
        stop=chat.stop,
        seed=chat.seed,
        frequency_penalty=float(chat.frequency_penalty or 0.0),
        presence_penalty=float(chat.presence_penalty or 0.0),
        logprobs=bool(chat.logprobs),
        top_logprobs=chat.top_logprobs or 0,
        session=session,
        # Rendering cost grows with the schemas' size; str() is a cheap enough estimate of it.
        input_chars=chars + (sum(len(str(tool)) for tool in tools) if tools else 0),
    )


def render_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the template renders it: role, text, tool calls (what the chat
    route renders of a message; the other APIs' requests convert to the same)."""
    copy = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        copy["tool_calls"] = message["tool_calls"]
    return copy


# --- pydantic errors as OpenAI errors -----------------------------------------------------

# Union members and validator names pydantic puts into an error's location.
_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
# What a value that matched no member of a union should have been, by field.
_UNIONS = {
    "content": "must be a string or an array of text parts",
    "temperature": "must be a number",
    "top_p": "must be a number",
    "frequency_penalty": "must be a number",
    "presence_penalty": "must be a number",
}
_MESSAGES = {
    "missing": "is a required property",
    "too_short": "must contain at least one message",
    "list_type": "must be an array, got {kind}",
    "model_type": "must be an object, got {kind}",
    "model_attributes_type": "must be an object, got {kind}",
    "dict_type": "must be an object, got {kind}",
    "string_type": "must be a string, got {kind}",
    "int_type": "must be an integer, got {value}",
    "bool_type": "must be a boolean, got {kind}",
    "float_type": "must be a number, got {value}",
    "literal_error": "must be {expected}, got {value}",
    "string_too_short": "must not be empty",
}


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _TAGS or "[" in part or part[:1].isupper())


def _param(loc: tuple) -> str:
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    return param


def invalid_request(exc: ValidationError) -> InvalidRequest:
    """The most specific of pydantic's errors as an OpenAI 400 with its `param` path."""
    errors = [(tuple(p for p in e["loc"] if not _is_tag(p)), e) for e in exc.errors()]
    deepest = max(len(loc) for loc, _ in errors)
    at = [(loc, e) for loc, e in errors if len(loc) == deepest]
    loc, error = at[0]
    param = _param(loc) or None
    name = str(loc[-1]) if loc else ""
    if error["type"] == "invalid" or (param is None and error["type"] not in _MESSAGES):
        text = error["msg"]
    elif len({e["type"] for _, e in at}) > 1 and name in _UNIONS:
        text = f"{_UNIONS[name]}, got {_kind(error['input'])}"
    elif error["type"] == "missing":
        return InvalidRequest(f"'{name}' is a required property", param=param)
    else:
        template = _MESSAGES.get(error["type"])
        context = {
            **(error.get("ctx") or {}),
            "kind": _kind(error["input"]),
            "value": repr(error["input"]),
        }
        text = template.format(**context) if template else error["msg"]
    return InvalidRequest(f"{param} {text}" if param else text, param=param)


# --- session keys -------------------------------------------------------------------------


def session_meta(data: dict[str, Any], headers: Mapping[str, str], user: Any = None) -> SessionMeta:
    """Session keys from headers or body; the body keys are removed from `data`. `user`: the
    caller's end-user id where the API does not name it `user` (Anthropic's metadata.user_id)."""
    body = {key: data.pop(key) for key in SESSION_BODY_KEYS if key in data}
    session_id = headers.get("x-session-id") or body.get("session_id")
    if session_id is not None:
        session_id = str(session_id).strip() or None
    if session_id is not None and len(session_id) > 256:
        raise InvalidRequest("the session id is longer than 256 characters", param="session_id")
    if session_id is not None and not HEADER_TEXT.fullmatch(session_id):
        # Else the reply's X-Session-Id header could not be sent: a 500, or no answer at all,
        # after the turn was recorded.
        raise InvalidRequest(
            "the session id must be printable Latin-1 text (it is sent back in the "
            f"X-Session-Id header), got {session_id!r}",
            param="session_id",
        )
    turn_type = headers.get("x-turn-type") or body.get("turn_type")
    if turn_type is not None:
        turn_type = str(turn_type).strip().lower()
        if turn_type not in TURN_TYPES:
            raise InvalidRequest(
                f"X-Turn-Type must be 'main', 'side' or 'probe', got {turn_type!r}",
                param="turn_type",
            )
    done = headers.get("x-session-done")
    if done is None:
        done = body.get("session_done", False)
    credential = api_credential(headers)
    if user is None:
        user = data.get("user")
    user = user if isinstance(user, str) else None
    scope = caller_scope(credential, user)
    episode = headers.get("x-episode")
    if episode is None:
        episode = body.get("episode", False)
    return SessionMeta(
        session_id,
        turn_type,
        _truthy(done),
        scope,
        caller_scope(credential, None),
        user,
        episode=_truthy(episode),
    )


def api_credential(headers: Mapping[str, str]) -> str | None:
    """The API key a request presents: `Authorization: Bearer <key>`, or Anthropic's
    `x-api-key: <key>`."""
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip() or None


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in TRUE_WORDS


def dumps(value: Any) -> bytes:
    """JSON bytes (the gateway's one serializer)."""
    return orjson.dumps(value)
