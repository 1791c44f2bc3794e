"""The floor of any gateway built like ours: an ASGI app on the gateway's own server stack
(uvicorn with uvloop and httptools) that forwards each POST body to the engine's /generate with
the gateway's HTTP client (aiohttp, one kept-alive connection pool) and returns the reply's
bytes, doing nothing else: no parsing, no template, no session, no Redis. What it adds over
calling the engine directly is the cost of the extra hop itself, which no work inside the
gateway can remove.

    .venv/bin/python tests/bench/null_proxy.py --port 30120 --engine-url http://127.0.0.1:30110
"""

from __future__ import annotations

import argparse

import aiohttp
import uvicorn


def make_app(engine_url: str):
    session: aiohttp.ClientSession | None = None

    async def app(scope, receive, send) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if session is not None:
                await session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if session is None:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        async with session.post(
            f"{engine_url}/generate", data=body, headers={"Content-Type": "application/json"}
        ) as reply:
            payload = await reply.read()
            status = reply.status
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-url", required=True)
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.engine_url),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
