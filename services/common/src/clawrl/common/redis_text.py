"""Redis replies as text: redis-py returns bytes (str with `decode_responses`); every reader of
stream entries, ids and script results turns them into str here, in one way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text(value: Any) -> str:
    """`value` as str: bytes decoded as UTF-8, anything else through str()."""
    return value.decode() if isinstance(value, bytes) else str(value)


def text_fields(fields: Mapping[Any, Any]) -> dict[str, str]:
    """A stream entry's fields with keys and values as str."""
    return {text(key): text(value) for key, value in fields.items()}
