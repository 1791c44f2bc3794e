"""The official SDKs' stream event types by their `type` literal, to validate each event a
gateway sends with pydantic against the one type it names (the SDK clients themselves build
events without validation)."""

from __future__ import annotations

import typing

from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent


def by_type(union) -> dict[str, type]:
    """The members of an SDK event union (bare or Annotated) by their `type` literal."""
    members = typing.get_args(typing.get_args(union)[0]) or typing.get_args(union)
    return {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in members}


RESPONSE_EVENTS = by_type(ResponseStreamEvent)
MESSAGE_EVENTS = by_type(RawMessageStreamEvent)


def validate_event(data: dict[str, typing.Any]) -> None:
    """Validate one Responses or Messages stream event against its SDK type."""
    kind = data["type"]
    (RESPONSE_EVENTS.get(kind) or MESSAGE_EVENTS[kind]).model_validate(data)
