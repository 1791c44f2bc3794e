"""Benchmark of what /v1/responses and /v1/messages add over /v1/chat/completions: one gateway in
front of the instant engine stand-in (tests/bench/instant_engine.py: answers at once, so only the
gateway's own work shows), the same one-question conversations sent through each route, main
turns (recorded in Redis; a Responses turn also stores its response for previous_response_id)
and side turns, whole and streamed, the routes interleaved in rounds. Prints req/s, p50 and p99
latency at `--concurrency` clients and at one client, and each route's difference from chat
completions; asserts nothing.

    .venv/bin/python tests/bench/bench_gateway_apis.py [--requests 300] [--concurrency 16]
        [--rounds 3] [--serial-requests 150]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent))  # instant_engine
from tests.bench.bench_gateway import MODEL, QUESTIONS, Stack, load, percentile

MAX_TOKENS = 6
BATCH = 10  # requests of one route in a row at one client, before the next route's


def bodies(route: str, n: int, stream: bool) -> list[dict]:
    """The same conversations in each route's request shape."""
    out = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"
        common = {"model": MODEL, "temperature": 0.7, "stream": stream}
        if route == "chat":
            out.append(
                {**common, "messages": [{"role": "user", "content": question}],
                 "max_tokens": MAX_TOKENS}
            )  # fmt: skip
        elif route == "responses":
            out.append({**common, "input": question, "max_output_tokens": MAX_TOKENS})
        else:
            out.append(
                {**common, "messages": [{"role": "user", "content": question}],
                 "max_tokens": MAX_TOKENS}
            )  # fmt: skip
    return out


# How each route's stream says it failed.
FAILED = (b'data: {"error"', b"event: error", b"event: response.failed")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


async def run(args: argparse.Namespace, gateway_url: str) -> None:
    targets = {}  # name -> (url, bodies, headers)
    chat_of = {}  # name -> the chat-completions target of the same kind
    for stream in (False, True):
        for turn in ("main", "side"):
            headers = {"X-Turn-Type": turn, "Authorization": "Bearer bench"}
            for route, path in PATHS.items():
                kind = f"{turn} {'stream' if stream else 'whole'}"
                name = f"{route:<9} {kind}"
                chat_of[name] = f"{'chat':<9} {kind}"
                targets[name] = (
                    f"{gateway_url}{path}",
                    bodies(route, args.requests, stream),
                    headers,
                )
    for url, requests, headers in targets.values():  # warm every path up
        await load(url, requests[: args.concurrency * 2], headers, args.concurrency, FAILED)
    loaded: dict[str, tuple[list[float], float, int]] = {name: ([], 0.0, 0) for name in targets}
    serial: dict[str, list[float]] = {name: [] for name in targets}
    # Rounds interleave the routes so drift (other load on the host) hits them alike; at one
    # client the three routes of a kind take turns every BATCH requests.
    for _ in range(args.rounds):
        for name, (url, requests, headers) in targets.items():
            latencies, wall = await load(url, requests, headers, args.concurrency, FAILED)
            before = loaded[name]
            loaded[name] = (before[0] + latencies, before[1] + wall, before[2] + len(requests))
        async with httpx.AsyncClient(timeout=120) as client:
            for start in range(0, args.serial_requests, BATCH):
                for name, (url, requests, headers) in targets.items():
                    for body in requests[start : start + BATCH]:
                        began = time.perf_counter()
                        response = await client.post(url, json=body, headers=headers)
                        serial[name].append(time.perf_counter() - began)
                        assert response.status_code == 200, response.text
    print(
        f"\n{args.requests} requests x {args.rounds} rounds at {args.concurrency} clients, "
        f"{args.serial_requests} x {args.rounds} at 1 client; instant engine, {MAX_TOKENS} "
        f"tokens a reply, {os.cpu_count()} CPUs\n"
    )
    print(
        f"{'route':<24} {args.concurrency:>2} clients: {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
        f"   1 client: {'p50 ms':>7} {'p90 ms':>7}   vs chat: 1-client p50, req/s"
    )
    for name in targets:
        latencies, wall, count = loaded[name]
        rps, p50, p99 = count / wall, percentile(latencies, 0.5), percentile(latencies, 0.99)
        one = serial[name]
        chat = chat_of[name]
        versus = ""
        if chat != name:
            _, chat_wall, chat_count = loaded[chat]
            difference = percentile(one, 0.5) - percentile(serial[chat], 0.5)
            versus = f"{1e3 * difference:+6.2f} ms  {100 * rps / (chat_count / chat_wall):5.1f}%"
        print(
            f"{name:<24}             {rps:7.1f} {1e3 * p50:7.2f} {1e3 * p99:7.2f}"
            f"             {1e3 * percentile(one, 0.5):7.2f} {1e3 * percentile(one, 0.9):7.2f}"
            f"   {versus}"
        )


def api_costs(iterations: int) -> None:
    """CPU per request of each route's own work, in-process: parsing and converting the
    request (one question, one function tool), and formatting a 6-token reply whole and as a
    stream; what the three routes share (render, engine call, recording) is left out."""
    import orjson
    from instant_engine import reply

    from clawrl.gateway.anthropic_messages import (
        MessageEvents,
        message_object,
        parse_messages_request,
    )
    from clawrl.gateway.chat_completions import ChatChunks, chat_completion
    from clawrl.gateway.control import Admission
    from clawrl.gateway.generation import Completion, Generation, assistant_message
    from clawrl.gateway.openai_responses import continued, parse_responses_request
    from clawrl.gateway.openai_responses_output import ResponseEvents, response_body
    from clawrl.gateway.protocol import parse_chat_request
    from clawrl.gateway.serving import StreamState
    from clawrl.gateway.tool_calls import Delta

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = {
        "chat": orjson.dumps({"model": MODEL, "messages": question, "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}),
        "responses": orjson.dumps({"model": MODEL, "input": question[0]["content"], "tools": [
            {"type": "function", "name": "get_weather", "parameters": schema}]}),
        "messages": orjson.dumps({"model": MODEL, "max_tokens": 6, "messages": question,
                                  "tools": [{"name": "get_weather", "input_schema": schema}]}),
    }  # fmt: skip
    headers = {"content-type": "application/json"}
    parse = {
        "chat": lambda: parse_chat_request(raw["chat"], headers),
        "responses": lambda: continued(parse_responses_request(raw["responses"], headers), [],
                                       None),
        "messages": lambda: parse_messages_request(raw["messages"], headers),
    }  # fmt: skip
    generation = Generation(streamed=True)
    generation.update(reply(20, MAX_TOKENS, MAX_TOKENS))
    done = Completion("id", generation, generation.text, [],
                      assistant_message(generation.text, []), "length", 20, 0)  # fmt: skip
    requests = {api: make() for api, make in parse.items()}
    whole = {
        "chat": lambda: orjson.dumps(chat_completion(done, MODEL, False)),
        "responses": lambda: orjson.dumps(response_body(requests["responses"], done, MODEL)),
        "messages": lambda: orjson.dumps(message_object(requests["messages"], done, MODEL)),
    }

    class Service:
        model_name, retry_after_s = MODEL, 5

    encoders = {
        "chat": ChatChunks,
        "responses": ResponseEvents.factory(requests["responses"]),
        "messages": MessageEvents,
    }
    pieces = [Delta(content=f" w{i}") for i in range(MAX_TOKENS)]

    def streamed(api: str):
        def run():
            state = StreamState(requests[api].chat if api == "responses" else requests[api],
                                "id", None, [0] * 20, Admission(0), generation)  # fmt: skip
            encoder = encoders[api](state, Service())
            out = encoder.opening()
            for piece in pieces:
                out += encoder.piece(piece)
            return out + encoder.closing(done)

        return run

    print(f"\nin-process CPU per request, microseconds ({iterations} iterations)")
    print(f"{'':<10} {'parse':>8} {'whole':>8} {'stream':>8}   vs chat: parse + whole, + stream")
    costs = {}
    for api in parse:
        row = []
        for work in (parse[api], whole[api], streamed(api)):
            work()
            began = time.process_time()
            for _ in range(iterations):
                work()
            row.append(1e6 * (time.process_time() - began) / iterations)
        costs[api] = row
        versus = ""
        if api != "chat":
            chat = costs["chat"]
            whole_more = row[0] + row[1] - chat[0] - chat[1]
            stream_more = row[0] + row[2] - chat[0] - chat[2]
            versus = f"{whole_more:+7.1f}  {stream_more:+7.1f}"
        print(f"{api:<10} {row[0]:8.1f} {row[1]:8.1f} {row[2]:8.1f}   {versus}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serial-requests", type=int, default=150)
    parser.add_argument("--iterations", type=int, default=3000, help="of the in-process costs")
    args = parser.parse_args()
    api_costs(args.iterations)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-apis-") as workdir:
        stack = Stack(Path(workdir))
        try:
            _, gateway_url = stack.start(instant=True)
            asyncio.run(run(args, gateway_url))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
