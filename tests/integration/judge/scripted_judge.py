"""A scripted judge behind a real OpenAI-compatible HTTP API (aiohttp): it answers each chat
completion from a function of the request's messages and records every request, so tests can
drive exact votes (the small real model is too weak a judge to be deterministic) and see the
prompts the judge sent."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from clawrl.judge.prompts import HINT_SYSTEM, PRM_SYSTEM

Answer = Callable[[str, str], str]  # (kind "prm" | "hint", user prompt text) -> reply text


@dataclass
class ScriptedJudge:
    answer: Answer
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def prompts(self, kind: str) -> list[str]:
        system = PRM_SYSTEM if kind == "prm" else HINT_SYSTEM
        return [
            r["messages"][1]["content"]
            for r in self.requests
            if r["messages"][0]["content"] == system
        ]


def kind_of(messages: list[dict[str, Any]]) -> str:
    return "prm" if messages[0]["content"] == PRM_SYSTEM else "hint"


@contextlib.asynccontextmanager
async def scripted_judge(answer: Answer, port: int = 0) -> AsyncIterator[ScriptedJudge]:
    """Serve /v1/chat/completions on `port` (0 = a free one); yields the judge with `url` set
    to the API base (…/v1)."""
    judge = ScriptedJudge(answer)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        judge.requests.append(body)
        messages = body["messages"]
        text = answer(kind_of(messages), messages[-1]["content"])
        return web.json_response(
            {
                "id": "chatcmpl-scripted",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "scripted"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    judge.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    try:
        yield judge
    finally:
        await runner.cleanup()


def openai_backend(judge_url: str, engine_url: str | None = None) -> dict[str, Any]:
    """`backend` settings voting through the scripted judge (and the teacher on `engine_url`)."""
    return {
        "kind": "openai",
        "openai_base_url": judge_url,
        "openai_model": "scripted",
        "api_key": "test-key",
        "engine_url": engine_url,
    }
