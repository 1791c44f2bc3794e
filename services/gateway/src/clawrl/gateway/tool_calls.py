"""Reading tool calls out of the model's text, whole or as it streams.

Hermes/Qwen format: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block per
call, possibly after some text. A block whose JSON does not parse stays in the content, so
nothing the model wrote is lost. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call = {"index": index, **call}
        return call


def parse_call(body: str) -> ToolCall | None:
    """One block's JSON as a ToolCall, or None when it is not a well-formed call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole completion; content is None when only calls remain."""
    if parser == "none" or OPEN not in text:
        return text, []
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = parse_call(match.group(1).strip())
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


@dataclass
class Delta:
    """One piece of streamed output: content text or a complete tool call."""

    content: str | None = None
    tool_call: ToolCall | None = None


class StreamingToolCallParser:
    """Feed text deltas; get content deltas and complete tool calls. Text that could be the
    start of `<tool_call>` is held back until it is known not to be."""

    def __init__(self, parser: str = "hermes"):
        self.enabled = parser != "none"
        self.buffer = ""
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        if not self.enabled:
            return [Delta(content=text)] if text else []
        self.buffer += text
        out: list[Delta] = []
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                out.append(self._close(self.buffer[:end], terminated=True))
                self.buffer = self.buffer[end + len(CLOSE) :]
                self.in_call = False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Delta(content=self.buffer[:start]))
                self.buffer = self.buffer[start + len(OPEN) :]
                self.in_call = True
                continue
            keep = _partial_open(self.buffer)
            emit = self.buffer[: len(self.buffer) - keep]
            if emit:
                out.append(Delta(content=emit))
            self.buffer = self.buffer[len(emit) :]
            break
        return out

    def finish(self) -> list[Delta]:
        """Flush what is held back at the end of the stream."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            return [self._close(rest, terminated=False)]
        return [Delta(content=rest)] if rest else []

    def _close(self, body: str, *, terminated: bool) -> Delta:
        call = parse_call(body.strip())
        if call is None:
            return Delta(content=OPEN + body + (CLOSE if terminated else ""))
        self.calls += 1
        return Delta(tool_call=call)


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0
