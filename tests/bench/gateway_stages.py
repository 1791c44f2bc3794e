"""The gateway benchmark's in-process parts (tests/bench/bench_gateway.py): the CPU each stage
of the gateway's own work costs per main request, the HTTP server's cost alone, and rendering a
growing agent conversation with and without the tokeniser's piece cache. Prints; asserts nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx
import orjson

if TYPE_CHECKING:
    from tests.bench.bench_gateway import Stack


def stage_costs(redis_url: str, model: str, stack: Stack | None = None) -> None:
    """CPU per main request of each stage of the gateway's own work, in-process with the real
    objects (a one-message chat, a 6-token reply); the record script against a real Redis. What
    the gateway spends beyond their sum is HTTP (server and engine client) and the event loop."""
    from instant_engine import reply
    from redis.asyncio import Redis

    from clawrl.common.chat import ChatRenderer
    from clawrl.common.settings import ModelSettings
    from clawrl.gateway.generation import Generation, assistant_message
    from clawrl.gateway.metrics import GatewayMetrics
    from clawrl.gateway.protocol import parse_chat_request
    from clawrl.gateway.recording import Recorder, ServedTurn
    from clawrl.gateway.sessions import SessionStore

    renderer = ChatRenderer.from_settings(ModelSettings(path=model))
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hi (1)"}]})
    headers = {"content-type": "application/json"}
    request = parse_chat_request(body, headers)
    prompt = renderer.render_ids(request.render_messages)
    engine_reply = orjson.dumps(reply(len(prompt), 6, 6))

    def generation() -> Generation:
        generated = Generation()
        generated.update(orjson.loads(engine_reply))
        return generated

    generated = generation()
    message = assistant_message(generated.text, [])
    served = ServedTurn(
        model=model,
        policy_version=0,
        admitted_policy_version=0,
        weight_version="0",
        messages=request.messages,
        tools=None,
        prompt_ids=prompt,
        response_ids=generated.ids,
        response_logprobs=generated.logprobs,
        response_text=generated.text,
        response_message=message,
        finish_reason="length",
        temperature=1.0,
        top_p=1.0,
    )

    def cpu_ms(step, n: int = 2000) -> float:
        step()
        start = time.process_time()
        for _ in range(n):
            step()
        return (time.process_time() - start) / n * 1e3

    costs = {
        "parse + validate request": cpu_ms(lambda: parse_chat_request(body, headers)),
        "render + tokenise prompt": cpu_ms(lambda: renderer.render_ids(request.render_messages)),
        "encode engine payload": cpu_ms(lambda: orjson.dumps({"input_ids": prompt})),
        "decode engine reply": cpu_ms(generation),
        "encode response": cpu_ms(lambda: orjson.dumps({"choices": [{"message": message}]})),
    }

    async def record_costs() -> None:
        redis = Redis.from_url(redis_url)
        store = SessionStore(redis, prefix="stages", stream="stages:turns", maxlen=1000, ttl_s=60)
        recorder = Recorder(
            store,
            GatewayMetrics(),
            gateway_id="bench",
            anonymous_matching=True,
            idle_timeout_s=60,
            sweep_interval_s=60,
            sweep_batch=10,
        )
        counter = iter(range(10**9))

        def begin():
            context = recorder.begin(
                f"stage-{next(counter)}",
                None,
                request.render_messages,
                request.messages,
                scope="-",
                done=False,
            )
            # What the gateway works out while the engine generates (hashes, request fields).
            recorder.prepare(context, model=model, tools=None, prompt_ids=prompt)
            return context

        costs["record prepared (during generation)"] = cpu_ms(begin)
        await recorder.finish(begin(), served)  # loads the script
        n = 500
        contexts = [begin() for _ in range(n)]
        start = time.process_time()
        for context in contexts:
            await recorder.finish(context, served)
        costs["record: bytes + 1 Redis round trip"] = (time.process_time() - start) / n * 1e3
        await redis.aclose()

    asyncio.run(record_costs())
    print("\nthe gateway's own stages, CPU ms per main request (in-process)")
    for name, ms in costs.items():
        print(f"  {name:<36} {ms:6.3f} ms")
    print(f"  {'sum':<36} {sum(costs.values()):6.3f} ms")
    if stack is not None and "gateway" in stack.urls:
        print(f"  {'HTTP server alone (GET /healthz)':<36} {healthz_cpu_ms(stack):6.3f} ms")


def healthz_cpu_ms(stack: Stack, n: int = 1000, concurrency: int = 8) -> float:
    """The gateway's CPU per GET /healthz: uvicorn + Starlette for a request that does nothing."""
    url = f"{stack.urls['gateway']}/healthz"

    async def hit() -> None:
        remaining = list(range(n))
        async with httpx.AsyncClient(timeout=60) as client:

            async def worker() -> None:
                while remaining:
                    remaining.pop()
                    (await client.get(url)).raise_for_status()

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    asyncio.run(hit())  # warm up
    before = stack.cpu_seconds()["gateway"]
    asyncio.run(hit())
    return (stack.cpu_seconds()["gateway"] - before) / n * 1e3


def render_costs(model: str) -> None:
    """CPU per prompt of rendering + tokenising a growing agent conversation (big system prompt,
    8 tool schemas), with and without the tokeniser's piece cache (identical ids, checked)."""
    from clawrl.common.chat import ChatRenderer
    from clawrl.common.settings import ModelSettings

    cached = ChatRenderer.from_settings(ModelSettings(path=model))
    plain = ChatRenderer(cached.tokenizer, cached.template)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "does things " * 20,
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
        for i in range(8)
    ]
    print("\nprompt render + tokenise, CPU ms per request (a new last message each time)")
    for turns in (1, 10, 30):
        messages = [{"role": "system", "content": "You are an agent. " * 200}]
        for t in range(turns):
            messages += [
                {"role": "user", "content": f"Step {t}: " + "please look at this output " * 40},
                {"role": "assistant", "content": f"Done {t}. " + "result text " * 30},
            ]
        messages.append({"role": "user", "content": "next?"})
        costs = {}
        for name, renderer in (("full", plain), ("pieces", cached)):
            start = time.process_time()
            for i in range(20):
                messages[-1]["content"] = f"next {i}?"
                ids = renderer.render_ids(messages, tools)
            costs[name] = (time.process_time() - start) / 20 * 1e3
            assert ids == plain.render_ids(messages, tools)
        chars = sum(len(m["content"]) for m in messages)
        print(
            f"  {turns:3d} turns {chars:6d} chars: full {costs['full']:6.2f} ms   "
            f"piece cache {costs['pieces']:6.2f} ms"
        )
