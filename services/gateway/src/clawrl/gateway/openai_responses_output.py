"""The OpenAI Responses API's reply: a finished generation as a `response` object (output items:
the message, then one function_call per call), or as its stream of events
(`response.created` ... `response.completed`). The request side is openai_responses.py's.
Pure: no I/O."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from clawrl.gateway.errors import to_http
from clawrl.gateway.generation import Completion, openai_logprobs
from clawrl.gateway.openai_responses import ResponsesRequest
from clawrl.gateway.serving import ChatService, StreamState
from clawrl.gateway.tool_calls import Delta, ToolCall


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
        # The Responses API's error codes are a closed set (the SDK's ResponseError.code), and
        # every failure of a started stream is the server's: the gateway's own code goes first
        # in the message.
        error = to_http(exc, self.retry_after_s).body["error"]
        message = f"{error['code']}: {error['message']}" if error["code"] else error["message"]
        reason = {"code": "server_error", "message": message}
        return self.event("response.failed", response=self.response(status="failed", error=reason))
