"""The recording spool: session-script calls that Redis did not take (down, restarting, failing
over), kept on local disk in order and replayed when it answers again, so a turn served during
an outage is still recorded, exactly once (every script write is keyed by its request id, so a
call that did reach Redis before its answer was lost is a no-op when replayed).

Order matters within a session (a turn's next state is the next request's), so while anything
is spooled every new call joins the end of the spool instead of going straight to Redis; the
replay applies calls oldest first and stops at the first one Redis refuses again.

On disk: one JSON line per call in `{dir}/spool.jsonl`, appended and flushed before the call is
counted as spooled (a gateway restart replays it); after a replay the remainder is written to a
temporary file and renamed over the spool. Bounded by `max_bytes`: a call past the bound is
dropped, counted and logged (serving never stops for recording).
"""

from __future__ import annotations

import base64
import fcntl
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)

SPOOL_FILE = "spool.jsonl"
_BYTES = "__b64__"


@dataclass(frozen=True)
class SpooledCall:
    """One session-script call: `op` ("record" or "finalize") and its keyword arguments."""

    op: str
    kwargs: dict[str, Any]

    def to_line(self) -> bytes:
        return orjson.dumps({"op": self.op, "kwargs": _encode(self.kwargs)}) + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> SpooledCall:
        data = orjson.loads(line)
        return cls(op=data["op"], kwargs=_decode(data["kwargs"]))


def _encode(value: Any) -> Any:
    """JSON-safe: bytes (protobuf records, finalize extras) as tagged base64."""
    if isinstance(value, bytes):
        return {_BYTES: base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_BYTES}:
            return base64.b64decode(value[_BYTES])
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


class RecordingSpool:
    """Spooled calls in memory, mirrored on disk (see the module docstring)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.path = self.directory / SPOOL_FILE
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # One gateway per spool: two appending and replaying one file would interleave.
        self._lock = open(self.directory / "lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"the recording spool {self.directory} is held by another gateway process"
            ) from None
        self._calls: deque[tuple[SpooledCall, int]] = deque()
        self.bytes = 0
        self._load()
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        """Calls a previous run of this gateway left (a torn last line from a crash is
        dropped: its call was never counted as spooled)."""
        if not self.path.is_file():
            return
        lines = self.path.read_bytes().splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                self._calls.append((SpooledCall.from_line(line), len(line)))
                self.bytes += len(line)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("spool %s line %d unreadable, dropped: %s", self.path, number, exc)
        if self._calls:
            log.warning("%d recording call(s) spooled by an earlier run: replaying them when "
                        "Redis answers", len(self._calls))  # fmt: skip
        self._rewrite()

    def __len__(self) -> int:
        return len(self._calls)

    def append(self, call: SpooledCall) -> bool:
        """Spool `call` after those already waiting; False (nothing written) when the spool is
        full."""
        line = call.to_line()
        if self.bytes + len(line) > self.max_bytes:
            return False
        self._file.write(line)
        self._file.flush()
        self._calls.append((call, len(line)))
        self.bytes += len(line)
        return True

    async def replay(
        self, apply: Callable[[SpooledCall], Awaitable[None]], errors: tuple[type, ...]
    ) -> int:
        """Apply spooled calls oldest first until one raises one of `errors` (Redis still
        unavailable: it stays first in line); returns how many were applied."""
        applied = 0
        try:
            while self._calls:
                call, size = self._calls[0]
                await apply(call)
                self._calls.popleft()
                self.bytes -= size
                applied += 1
        except errors as exc:
            log.info("spool replay paused after %d call(s): %s: %s", applied,
                     type(exc).__name__, exc)  # fmt: skip
        finally:
            if applied:
                self._rewrite()
        return applied

    def _rewrite(self) -> None:
        """The file holds exactly the calls still waiting (written aside, then renamed)."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for call, _ in self._calls:
                f.write(call.to_line())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = open(self.path, "ab")

    def close(self) -> None:
        self._file.close()
        self._lock.close()  # releases the flock
