"""Benchmark of the CPU engine serving LoRA adapters, side by side in one run: decode throughput
of N concurrent streams (default 8) on the base model with LoRA off, on the base model with
LoRA on, with 1, 4 and 8 distinct adapters in one batch (max_loras_per_batch 8), and with 8
adapters over 4 slots (max_loras_per_batch 4: adapters are evicted and injected again while
serving). Real PEFT adapters of the served model (rank 16, all seven projections) are made
first. Prints a table; asserts nothing.

    .venv/bin/python tests/bench/bench_adapters.py [--model SmolLM2-135M-Instruct]
        [--streams 8] [--new-tokens 32] [--rounds 2] [--torch-threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: make the tests package importable
from tests.bench.bench_engine import PROMPTS, chat_prompt, start_engine  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.integration.engine.helpers import metric  # noqa: E402
from tests.integration.engine.lora_adapters import make_adapter  # noqa: E402

COUNTERS = {
    "on-demand loads": ("clawrl_engine_lora_on_demand_loads_total", {}),
    "evictions": ("clawrl_engine_lora_evictions_total", {"level": "resident"}),
    "slot waits": ("clawrl_engine_lora_slot_waits_total", {}),
}


async def one_request(client, url: str, prompt: str, lora: str | None, new_tokens: int) -> int:
    body = {
        "text": chat_prompt(prompt),
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    response = await client.post(f"{url}/generate", json=body)
    response.raise_for_status()
    return response.json()["meta_info"]["completion_tokens"]


async def run_row(url: str, loras: list[str | None], new_tokens: int, rounds: int) -> dict:
    """`rounds` rounds of len(loras) concurrent requests, request i under loras[i]."""
    walls, tokens = [], 0
    before = {name: metric(url, m, **labels) for name, (m, labels) in COUNTERS.items()}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        for r in range(rounds):
            start = time.perf_counter()
            done = await asyncio.gather(
                *(
                    one_request(client, url, PROMPTS[(r + i) % len(PROMPTS)], lora, new_tokens)
                    for i, lora in enumerate(loras)
                )
            )
            walls.append(time.perf_counter() - start)
            tokens += sum(done)
    after = {name: metric(url, m, **labels) for name, (m, labels) in COUNTERS.items()}
    return {
        "tok_s": tokens / sum(walls),
        "round_s": statistics.median(walls),
        **{name: (after[name] - before[name]) / rounds for name in COUNTERS},
    }


def serve(model: str, threads: int, *flags: str):
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"bench-adapters-{port}.log"
    proc = start_engine(model, port, log_path, "--torch-threads", str(threads), *flags)
    return proc, f"http://127.0.0.1:{port}"


def measure(model: str, threads: int, flags: list[str], rows: dict, args) -> dict:
    """Start an engine with `flags`, run each row (name -> adapters per stream), stop it."""
    proc, url = serve(model, threads, *flags)
    try:
        asyncio.run(run_row(url, [None, None], 4, 1))  # warm-up
        return {name: run_row_sync(url, loras, args) for name, loras in rows.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_row_sync(url: str, loras: list[str | None], args) -> dict:
    # One warm-up request per adapter first: peft's first pass through an adapter is slower.
    asyncio.run(run_row(url, sorted(set(loras), key=str), 2, 1))
    return asyncio.run(run_row(url, loras, args.new_tokens, args.rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()

    from clawrl.common.models import resolve_model_dir
    from clawrl.common.settings import ModelSettings

    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    names = [f"t{i}" for i in range(8)]
    paths = {
        name: make_adapter(model_dir, root / name, rank=16, alpha=32, seed=i, scale=0.02)
        for i, name in enumerate(names)
    }
    lora = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all",
            "--lora-paths", *(f"{n}={p}" for n, p in paths.items())]  # fmt: skip
    n = args.streams

    def spread(k: int) -> list[str | None]:
        return [names[i % k] for i in range(n)]

    results = {}
    results.update(measure(args.model, args.torch_threads, [], {"base, LoRA off": [None] * n},
                           args))  # fmt: skip
    results.update(
        measure(
            args.model, args.torch_threads, [*lora, "--max-loras-per-batch", "8"],
            {"base, LoRA on": [None] * n, "1 adapter": spread(1), "4 adapters": spread(4),
             "8 adapters": spread(8)},
            args,
        )
    )  # fmt: skip
    results.update(
        measure(
            args.model, args.torch_threads, [*lora, "--max-loras-per-batch", "4"],
            {"8 adapters, 4 slots": spread(8)}, args,
        )
    )  # fmt: skip

    base = results["base, LoRA off"]["tok_s"]
    print(
        f"\nCPU engine, {args.model}, {n} concurrent streams x {args.new_tokens} new tokens, "
        f"{args.rounds} rounds, {args.torch_threads} torch threads, {os.cpu_count()} CPUs"
    )
    print(f"{'batch':<22} {'tok/s':>7} {'vs base':>8} {'round s':>8} "
          f"{'on-demand loads':>16} {'evictions':>10} {'slot waits':>11}")  # fmt: skip
    for name, row in results.items():
        print(
            f"{name:<22} {row['tok_s']:>7.1f} {row['tok_s'] / base:>7.2f}x {row['round_s']:>8.1f} "
            f"{row['on-demand loads']:>16.1f} {row['evictions']:>10.1f} {row['slot waits']:>11.1f}"
        )
    print("(loads, evictions and waits are per round)")


if __name__ == "__main__":
    main()
