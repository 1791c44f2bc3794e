"""Structured logging: JSON lines in pods, readable text locally, with the session id and policy
version of the work in hand attached to every record through context variables."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

from clawrl.common.settings import LoggingSettings

_session_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("session_id", default=None)
_policy_version: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "policy_version", default=None
)


@contextlib.contextmanager
def log_context(session_id: str | None = None, policy_version: int | None = None) -> Iterator[None]:
    """Attach a session id and/or policy version to every log record inside the block."""
    tokens = []
    if session_id is not None:
        tokens.append((_session_id, _session_id.set(session_id)))
    if policy_version is not None:
        tokens.append((_policy_version, _policy_version.set(policy_version)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class _ContextFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.session_id = getattr(record, "session_id", None) or _session_id.get()
        record.policy_version = getattr(record, "policy_version", None) or _policy_version.get()
        return True


# color_message: uvicorn's ANSI-coloured copy of the message. Keys starting with "_" (e.g.
# Ray's _ray_timestamp_ns) are private to the library that set them and left out too.
_RESERVED = set(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "service",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra={...}` fields are kept as top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": record.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and value is not None and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """Readable lines for local runs: time, level, service, message, then context as k=v."""

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{key}={value}"
            for key, value in record.__dict__.items()
            if key not in _RESERVED and value is not None and not key.startswith("_")
        )
        line = (
            f"{time.strftime('%H:%M:%S', time.localtime(record.created))} "
            f"{record.levelname:<5} {record.service} {record.getMessage()}"
        )
        if extras:
            line += f"  [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(settings: LoggingSettings, service: str) -> None:
    """Install one stderr handler on the root logger (replacing any earlier one)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else TextFormatter())
    handler.addFilter(_ContextFilter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())
    # Access logs from uvicorn/httpx duplicate our own request metrics and drown the rest.
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
