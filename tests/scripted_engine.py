"""A real HTTP server (aiohttp) that answers SGLang's /generate from a script, for the few
client-side paths the real engine cannot be made to take on demand: a model that emits a tool
call, an engine that answers 5xx or garbage. Everything else is tested against the real engine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def sse(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    """Stream `events` as SGLang does: `data: {...}` lines, then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@contextlib.asynccontextmanager
async def scripted_engine(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """Serve `{path: handler}` on a free loopback port; yields the base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
