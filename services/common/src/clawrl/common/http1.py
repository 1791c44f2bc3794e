"""A lean HTTP/1.1 client for one hot call: a JSON POST over kept-alive connections to one
server, answered with a whole body (Content-Length or chunked). What it leaves out, next to
aiohttp, is what that call never uses (cookies, redirects, proxies, auth, compression, tracing,
per-request header and URL objects): ~15 us of client CPU a call against aiohttp's ~110 us,
which at one client was most of what the gateway added to an instant engine's /generate.

Errors are the standard library's: `OSError` (ConnectionError included) when the server cannot
be reached or drops the connection, `TimeoutError`, `BadReply` for a reply it cannot read.
A connection whose call was cancelled or failed is closed, never reused (the server sees the
client leave, as SGLang needs to abort the request).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 << 10  # a reply head past this is refused


class BadReply(Exception):
    """The server's reply is not HTTP/1.1 this client can read."""


class _Reply:
    """One reply being read: head, then body by Content-Length or chunks."""

    def __init__(self) -> None:
        self.status = 0
        self.keep_alive = True
        self.length: int | None = None  # None: chunked
        self.head_done = False

    def head(self, data: bytes) -> None:
        lines = data.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadReply(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
        self.status = int(parts[1])
        self.keep_alive = parts[0] == b"HTTP/1.1"
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                if not value.isdigit():
                    raise BadReply(f"bad Content-Length {value[:40]!r}")
                self.length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                self.keep_alive = b"close" not in value and (
                    self.keep_alive or b"keep-alive" in value
                )
        if chunked:
            self.length = None
        elif self.length is None:
            if self.status in (204, 304) or 100 <= self.status < 200:
                self.length = 0
            else:
                # A body up to the connection's end: read once it closes, never reused.
                self.keep_alive = False
                self.length = -1
        self.head_done = True


def dechunk(data: bytes | bytearray, start: int) -> tuple[bytes, int] | None:
    """A chunked body starting at `start` in `data`: (body, end offset), None while incomplete.
    Trailers are skipped."""
    out, at = [], start
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return None
        size_text = bytes(data[at:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadReply(f"bad chunk size {size_text[:20]!r}") from None
        at = line_end + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", at - 2)
            return (b"".join(out), end + 4) if end >= 0 else None
        if len(data) < at + size + 2:
            return None
        out.append(bytes(data[at : at + size]))
        at += size + 2


class _Connection(asyncio.Protocol):
    """One kept-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.reply: _Reply | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.reply is not None and self.reply.length == -1 and self.reply.head_done:
            self._done(bytes(self.buffer))  # a body that ends with the connection
            return
        self._fail(exc or ConnectionResetError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self._fail(BadReply("the server sent bytes nobody asked for"))
            self.close()
            return
        self.buffer += data
        try:
            self._parse()
        except BadReply as exc:
            self._fail(exc)
            self.close()

    def _parse(self) -> None:
        reply = self.reply
        assert reply is not None
        if not reply.head_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise BadReply("the reply's head is too long")
                return
            reply.head(bytes(self.buffer[:end]))
            del self.buffer[: end + 4]
        if reply.length is None:
            whole = dechunk(self.buffer, 0)
            if whole is not None:
                del self.buffer[: whole[1]]
                self._done(whole[0])
        elif reply.length >= 0 and len(self.buffer) >= reply.length:
            body = bytes(self.buffer[: reply.length])
            del self.buffer[: reply.length]
            self._done(body)

    def _done(self, body: bytes) -> None:
        if self.buffer:  # bytes past the reply: the connection is out of step
            self.reply.keep_alive = False  # type: ignore[union-attr]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(body)

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def request(self, data: bytes) -> tuple[_Reply, bytes]:
        self.reply = _Reply()
        self.buffer.clear()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        body = await self.waiter
        return self.reply, body

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class KeepAlivePool:
    """JSON POSTs to one `http://host:port` server over at most `max_connections` kept-alive
    connections (callers past that wait for one), each dropped once idle for `idle_s` (before
    the server drops it: a request sent on a socket the server is closing would fail)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 1024,
        idle_s: float = 3.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"KeepAlivePool speaks plain http://host[:port], not {base_url!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self.host_header = url.netloc.encode()
        self.idle_s = idle_s
        self.connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []

    def _take(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn

    async def post_json(self, path: str, body: bytes, timeout_s: float | None) -> tuple[int, bytes]:
        """POST `body` (JSON) to `path`: (status, reply body), within `timeout_s` in all."""
        target = (self.prefix + path).encode()
        head = (
            b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (target, self.host_header, len(body))
        )
        async with self._slots, asyncio.timeout(timeout_s):
            conn = self._take() or await self._connect()
            try:
                reply, data = await conn.request(head + body)
            except BaseException:
                conn.close()
                raise
            if reply.keep_alive and not conn.closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return reply.status, data

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
