"""The OpenAI chat-completions format (`POST /v1/chat/completions`): a finished generation as a
`chat.completion` body, or its stream of `chat.completion.chunk` events ending in
`data: [DONE]`. The request side is protocol.py's; the serving core streams with `ChatChunks`
unless an API passes its own encoder. Pure: no I/O."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from clawrl.gateway.errors import to_http
from clawrl.gateway.generation import Completion, openai_logprobs
from clawrl.gateway.tool_calls import Delta
from clawrl.gateway.versions import turn_versions

if TYPE_CHECKING:  # the serving core imports this module (its default stream encoder)
    from clawrl.gateway.serving import ChatService, StreamState

DONE = b"data: [DONE]\n\n"


def chat_completion(done: Completion, model_name: str, logprobs: bool) -> dict[str, Any]:
    """The chat.completion body of a finished generation."""
    return {
        "id": done.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": f"clawrl-policy-v{done.policy_version}",
        "choices": [
            {
                "index": 0,
                "message": done.message,
                "logprobs": openai_logprobs(done.generation) if logprobs else None,
                "finish_reason": done.finish,
            }
        ],
        "usage": chat_usage(done),
    }


def chat_usage(done: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class ChatChunks:
    """chat.completion.chunk events, then `data: [DONE]`."""

    def __init__(self, stream: StreamState, service: ChatService):
        self.stream = stream
        self.retry_after_s = service.retry_after_s
        self.logprobs = stream.request.logprobs
        self.include_usage = stream.request.include_usage
        self.base = {
            "id": stream.request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": service.model_name,
        }
        self.usage_key = {"usage": None} if self.include_usage else {}
        self.sent_tokens = 0
        self.calls = 0

    def head(self) -> dict[str, Any]:
        # The weights of the latest event: a sync mid-stream shows from the next chunk on.
        version, _ = turn_versions(self.stream.generation.weight_version, self.stream.admitted)
        return {**self.base, "system_fingerprint": f"clawrl-policy-v{version}"}

    def chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        body = {**self.head(), "choices": [choice], **self.usage_key}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def piece(self, delta: Delta) -> list[bytes]:
        logprobs = None
        if self.logprobs:
            logprobs = openai_logprobs(self.stream.generation, self.sent_tokens)
            self.sent_tokens = len(self.stream.generation.ids)
        if delta.tool_call is not None:
            call = delta.tool_call.to_openai(index=self.calls)
            self.calls += 1
            return [self.chunk({"tool_calls": [call]}, logprobs=logprobs)]
        return [self.chunk({"content": delta.content}, logprobs=logprobs)]

    def closing(self, done: Completion) -> list[bytes]:
        out = [self.chunk({}, done.finish)]
        if self.include_usage:
            body = {**self.head(), "choices": [], "usage": chat_usage(done)}
            out.append(b"data: " + orjson.dumps(body) + b"\n\n")
        out.append(DONE)
        return out

    def failure(self, exc: Exception) -> bytes:
        return b"data: " + orjson.dumps(to_http(exc, self.retry_after_s).body) + b"\n\n"
