"""A Turn record checked and decoded once: its messages, reply and next state as Python objects.
A turn that cannot be judged raises `MalformedTurn` with the reason (it is dead-lettered)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from clawrl.common.chat import ChatTemplateError, content_text
from clawrl.common.records import Turn


class MalformedTurn(ValueError):
    """A turn the judge cannot make a sample from; the message is the dead-letter reason."""


def _json(text: str, what: str, kind: type) -> Any:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise MalformedTurn(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise MalformedTurn(f"{what} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def next_state_messages(turn: Turn) -> list[dict[str, Any]]:
    """Every message after the assistant's reply, in order (next_state_messages_json); turns
    recorded before that field existed carry only next_state_json (the last one)."""
    texts = list(turn.next_state_messages_json) or (
        [turn.next_state_json] if turn.next_state_json else []
    )
    return [_json(t, "a next-state message", dict) for t in texts]


@dataclass
class TurnView:
    """The parts of a Turn the judge reads, decoded lazily (a reward_fn that only needs the
    response text costs no JSON parsing)."""

    turn: Turn

    @cached_property
    def messages(self) -> list[dict[str, Any]]:
        """The request messages the prompt was rendered from."""
        return _json(self.turn.messages_json or "[]", "messages_json", list)

    @cached_property
    def tools(self) -> list[dict[str, Any]] | None:
        return _json(self.turn.tools_json, "tools_json", list) if self.turn.tools_json else None

    @cached_property
    def response_message(self) -> dict[str, Any]:
        """The assistant message returned (content, tool_calls)."""
        if not self.turn.response_message_json:
            return {"role": "assistant", "content": self.turn.response_text}
        return _json(self.turn.response_message_json, "response_message_json", dict)

    @cached_property
    def next_state(self) -> list[dict[str, Any]]:
        return next_state_messages(self.turn)

    @property
    def response_text(self) -> str:
        return self.turn.response_text

    @property
    def has_next_state(self) -> bool:
        return bool(self.turn.next_state_messages_json or self.turn.next_state_json)

    def last_user_text(self) -> str:
        """Text of the last user message of the prompt ("" when none)."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                return message_text(message)
        return ""

    def next_user_text(self) -> str:
        """Text of the user message in the next state ("" when none)."""
        for message in self.next_state:
            if message.get("role") == "user":
                return message_text(message)
        return ""


def message_text(message: dict[str, Any]) -> str:
    try:
        return content_text(message.get("content"))
    except ChatTemplateError as exc:
        raise MalformedTurn(str(exc)) from exc


def check_turn(turn: Turn) -> TurnView:
    """The turn's view once its invariants hold (ids, lengths, JSON of the next state)."""
    if not turn.turn_id or not turn.session_id:
        raise MalformedTurn("turn has no turn_id or session_id")
    if len(turn.response_logprobs) != len(turn.response_ids):
        raise MalformedTurn(
            f"{len(turn.response_ids)} response ids but {len(turn.response_logprobs)} log-probs"
        )
    view = TurnView(turn)
    # Parse now: bad JSON is a malformed turn, found before any engine is asked.
    view.messages  # noqa: B018
    view.next_state  # noqa: B018
    return view
