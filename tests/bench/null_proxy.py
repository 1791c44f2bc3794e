"""The floor of any gateway built like ours: an ASGI app on the gateway's own server stack
(uvicorn with uvloop and httptools) that forwards each POST body to the engine's /generate with
the gateway's HTTP client (aiohttp, one kept-alive connection pool) and returns the reply's
bytes, doing nothing else: no parsing, no template, no session, no Redis. What it adds over
calling the engine directly is the cost of the extra hop itself, which no work inside the
gateway can remove.

With `--redis-url` it also writes each reply to Redis (one SET, with the gateway's own Redis
client and settings) before answering: the floor of a gateway that, like ours, stores a turn
before the client sees its response.

    .venv/bin/python tests/bench/null_proxy.py --port 30120 --engine-url http://127.0.0.1:30110
        [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
import uvicorn

from clawrl.gateway.lifespan import create_redis
from clawrl.gateway.settings import GatewaySettings


def make_app(engine_url: str, redis_url: str | None = None):
    session: aiohttp.ClientSession | None = None
    redis = create_redis(GatewaySettings(redis={"url": redis_url})) if redis_url else None
    counter = itertools.count()

    async def app(scope, receive, send) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if session is not None:
                await session.close()
            if redis is not None:
                await redis.aclose()
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
        if redis is not None:
            await redis.set(f"null-proxy:{next(counter)}", payload, ex=60)
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
    parser.add_argument("--redis-url", help="also SET each reply in this Redis before answering")
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.engine_url, args.redis_url),
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
