"""Benchmark of the CPU engine's prefix cache and chunked prefill with the real model. Prints
figures; asserts nothing.

1. Time to first token of each turn of a growing 10-turn conversation (chat-template rendered,
   each turn's prompt = the previous prompt + its answer + a new user message), with the prefix
   cache and without it (--disable-radix-cache).
2. Decode tokens/s of a short stream while a 13k-token prompt is prefilled, with chunked
   prefill (the default chunk) and without (one pass), and that prompt's time to first token.
   On a busy host the prefill takes minutes: `--prefill-window-s S` watches the short stream
   for at most S seconds of it, then hangs up the long request (its TTFT then shows as > S).

    .venv/bin/python tests/bench/bench_engine_cache.py [--model NAME] [--turns 10]
        [--new-tokens 48] [--long-prompt 13000] [--prefill-window-s 600]
        [--skip-conversation] [--skip-chunking]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from bench_engine import free_port, start_engine
from transformers import AutoTokenizer

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings

TIMEOUT = httpx.Timeout(1800.0)
SYSTEM = "You are a helpful assistant that answers questions about the history of science. " * 8
QUESTIONS = [
    "Who first measured the speed of light, and how did the method work in detail?",
    "Explain why the ultraviolet catastrophe mattered for the birth of quantum theory.",
    "What did the Michelson-Morley experiment try to detect, and what did it find instead?",
    "How did Mendel's pea experiments lead to the idea of discrete units of heredity?",
    "Describe how Lavoisier's careful weighing changed our understanding of combustion.",
    "Why was the discovery of the cosmic microwave background so important for cosmology?",
    "What problem did Kepler solve with elliptical orbits that circles could not explain?",
    "How did Pasteur's swan-neck flask experiment argue against spontaneous generation?",
    "What was surprising about Rutherford's gold foil results, and what model followed?",
    "Explain how Faraday's experiments connected electricity and magnetism.",
]


class Engine:
    """A clawrl-engine process for one configuration, stopped on exit."""

    def __init__(self, model: str, *extra: str):
        port = free_port()
        log_path = Path(tempfile.gettempdir()) / f"bench-engine-cache-{port}.log"
        self.proc = start_engine(model, port, log_path, *extra)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in a long forward pass
            self.proc.kill()
            self.proc.wait()


def stream(url: str, body: dict, on_token=None, timeout=TIMEOUT) -> tuple[float, dict]:
    """(time to first token, last event) of one streaming /generate."""
    start = time.perf_counter()
    ttft, last = None, None
    with httpx.stream(
        "POST", f"{url}/generate", json={**body, "stream": True}, timeout=timeout
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line[6:])
            if last["output_ids"]:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                if on_token is not None and on_token(last):
                    break
    assert last is not None and ttft is not None
    return ttft, last


def conversation(
    url: str, tokenizer, turns: int, new_tokens: int, system: str = SYSTEM
) -> list[tuple[float, int, int]]:
    """(TTFT s, prompt tokens, cached tokens) per turn."""
    messages = [{"role": "system", "content": system}]
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text)
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        }
        ttft, last = stream(url, body)
        rows.append((ttft, len(ids), last["meta_info"]["cached_tokens"]))
        messages.append({"role": "assistant", "content": last["text"]})
    return rows


def decode_during_prefill(url: str, long_prompt: int, window_s: float) -> dict:
    """Short-stream tokens/s while a long prompt is prefilled (for at most `window_s`), and
    that prompt's TTFT (None: not done within the window)."""
    rng = random.Random(0)
    long_ids = [rng.randrange(1000, 40000) for _ in range(long_prompt)]
    arrivals: list[float] = []
    done = threading.Event()
    short = {
        "text": "Tell me a long story about the sea.",
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
    }

    def on_token(_event) -> bool:
        arrivals.append(time.perf_counter())
        return done.is_set()

    worker = threading.Thread(target=lambda: stream(url, short, on_token))
    worker.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    before = (arrivals[-1] - arrivals[-11]) / 10  # inter-token time before the long prompt
    sent = time.perf_counter()
    body = {"input_ids": long_ids, "sampling_params": {"max_new_tokens": 1}}
    try:
        # No byte comes before the first token: a read timeout is the window's end.
        ttft, _ = stream(url, body, timeout=httpx.Timeout(30.0, read=window_s))
    except httpx.ReadTimeout:
        ttft = None  # hung up: the engine drops the request (after the pass in progress)
    end = sent + (ttft if ttft is not None else window_s)
    during = [t for t in arrivals if sent < t <= end]
    done.set()
    worker.join(timeout=600)
    return {
        "long_ttft_s": ttft,
        "short_tok_s_before": 1 / before,
        "short_tok_s_during": len(during) / (end - sent),
        "longest_gap_s": max(
            (b - a for a, b in zip([sent, *during], [*during, end], strict=True)),
            default=end - sent,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=48, help="answer length per turn")
    parser.add_argument("--long-prompt", type=int, default=13000)
    parser.add_argument("--context-length", type=int, default=16384)
    parser.add_argument(
        "--prefill-window-s",
        type=float,
        default=600.0,
        help="watch the short stream for at most this long of the long prefill",
    )
    parser.add_argument("--skip-conversation", action="store_true")
    parser.add_argument("--skip-chunking", action="store_true")
    args = parser.parse_args()
    print(f"CPU engine, {args.model}, {os.cpu_count()} CPUs")

    if not args.skip_conversation:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelSettings(path=args.model)))
        results = {}
        for name, extra in (("cache", ()), ("no cache", ("--disable-radix-cache",))):
            with Engine(args.model, *extra) as engine:
                conversation(engine.url, tokenizer, 1, 4, system="Be brief.")  # warm-up
                results[name] = conversation(engine.url, tokenizer, args.turns, args.new_tokens)
        print(f"\nTTFT per turn of a growing conversation ({args.new_tokens}-token answers)")
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT cache ms':>14} {'no cache ms':>12}")
        for turn, (c, n) in enumerate(zip(results["cache"], results["no cache"], strict=True), 1):
            print(f"{turn:>4} {c[1]:>7} {c[2]:>7} {c[0] * 1000:>14.0f} {n[0] * 1000:>12.0f}")

    if not args.skip_chunking:
        rows = {}
        context = ("--context-length", str(args.context_length))
        for name, extra in (
            ("chunked (default)", ()),
            ("one pass", ("--chunked-prefill-size", str(args.long_prompt + 1))),
        ):
            with Engine(args.model, *context, *extra) as engine:
                rows[name] = decode_during_prefill(
                    engine.url, args.long_prompt, args.prefill_window_s
                )
        print(f"\nA short stream while a {args.long_prompt}-token prompt is prefilled")
        print(
            f"{'prefill':>18} {'long TTFT s':>12} {'short tok/s before':>19} "
            f"{'during':>7} {'longest gap s':>14}"
        )
        for name, row in rows.items():
            ttft = row["long_ttft_s"]
            ttft_text = f"{ttft:.1f}" if ttft is not None else f"> {args.prefill_window_s:.0f}"
            print(
                f"{name:>18} {ttft_text:>12} {row['short_tok_s_before']:>19.1f} "
                f"{row['short_tok_s_during']:>7.1f} {row['longest_gap_s']:>14.2f}"
            )


if __name__ == "__main__":
    main()
