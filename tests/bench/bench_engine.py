"""Benchmark of the CPU engine with the real model: total generated tokens/s and time to first
token at 1 and N concurrent streams. Prints a table; asserts nothing.

    .venv/bin/python tests/bench/bench_engine.py [--model NAME] [--new-tokens 128] [--streams 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.conftest import free_port  # noqa: E402

BIN = Path(sys.executable).parent
PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how photosynthesis works.",
    "List some tips for learning a new language.",
    "Describe the water cycle.",
    "What makes a good cup of coffee?",
    "Summarise the history of the printing press.",
    "How do airplanes stay in the air?",
    "Give advice to a new programmer.",
]


def chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def start_engine(model: str, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    log = log_path.open("wb")
    argv = [
        str(BIN / "clawrl-engine"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        *extra,
    ]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a loaded host loads slowly
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("engine did not become healthy")


async def one_stream(client: httpx.AsyncClient, url: str, prompt: str, new_tokens: int):
    """(time to first token, completion tokens) of one streaming request."""
    body = {
        "text": chat_prompt(prompt),
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    ttft, last = None, None
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            if ttft is None and last["output_ids"]:
                ttft = time.perf_counter() - start
    assert last is not None and ttft is not None
    return ttft, last["meta_info"]["completion_tokens"]


async def run_level(url: str, streams: int, new_tokens: int, rounds: int) -> dict:
    ttfts, tokens, wall = [], 0, 0.0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for r in range(rounds):
            prompts = [PROMPTS[(r + i) % len(PROMPTS)] for i in range(streams)]
            start = time.perf_counter()
            results = await asyncio.gather(
                *(one_stream(client, url, p, new_tokens) for p in prompts)
            )
            wall += time.perf_counter() - start
            ttfts += [t for t, _ in results]
            tokens += sum(n for _, n in results)
    return {
        "streams": streams,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "per_stream_tok_s": tokens / wall / streams,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2, help="repetitions per level")
    parser.add_argument("--url", help="benchmark an engine already running here instead")
    args = parser.parse_args()

    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        port = free_port()
        log_path = Path(tempfile.gettempdir()) / f"bench-engine-{port}.log"
        proc = start_engine(args.model, port, log_path)
        url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_level(url, 2, 8, 1))  # warm-up
        rows = [asyncio.run(run_level(url, n, args.new_tokens, args.rounds)) for n in args.streams]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)

    base = rows[0]["tok_s"]
    print(
        f"\nCPU engine, {args.model}, {args.new_tokens} new tokens per stream, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"{'streams':>7} {'total tok/s':>12} {'tok/s/stream':>13} {'TTFT p50 ms':>12} {'vs 1':>6}"
    )
    for row in rows:
        print(
            f"{row['streams']:>7} {row['tok_s']:>12.1f} {row['per_stream_tok_s']:>13.1f} "
            f"{row['ttft_p50_ms']:>12.0f} {row['tok_s'] / base:>5.1f}x"
        )


if __name__ == "__main__":
    main()
