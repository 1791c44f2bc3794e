"""A stand-in SGLang engine for benchmarks: real HTTP (aiohttp), answers /generate at once with a
fixed short output (ids, log-probs, finish reason, weight_version), streamed or not, so that a
benchmark through the gateway measures only the gateway's own work.

    .venv/bin/python tests/bench/instant_engine.py --port 30110 [--tokens 6]
"""

from __future__ import annotations

import argparse

import orjson
from aiohttp import web


def reply(prompt_tokens: int, tokens: int, upto: int, *, incremental_from: int | None = None):
    """The /generate body after `upto` of `tokens` output tokens (all of them when non-streamed);
    incremental events carry only the ids from `incremental_from` on."""
    start = 0 if incremental_from is None else incremental_from
    ids = [100 + i for i in range(start, upto)]
    return {
        "text": "".join(f" w{i}" for i in range(start, upto)),
        "output_ids": ids,
        "meta_info": {
            "id": "instant",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": upto,
            "finish_reason": {"type": "length", "length": tokens} if upto == tokens else None,
            "output_token_logprobs": [[-0.5, i, None] for i in ids],
            "weight_version": "0",
        },
    }


def make_app(tokens: int) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        prompt = len(body.get("input_ids") or []) or 1
        wanted = min(tokens, (body.get("sampling_params") or {}).get("max_new_tokens") or tokens)
        if not body.get("stream"):
            return web.Response(
                body=orjson.dumps(reply(prompt, wanted, wanted)), content_type="application/json"
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, wanted + 1):
            event = reply(prompt, wanted, n, incremental_from=n - 1)
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "instant", "weight_version": "0"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=6, help="output tokens per request")
    args = parser.parse_args()
    web.run_app(make_app(args.tokens), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
