"""Benchmark of the two ways a new policy version reaches the CPU engine: loading the export
from disk (/update_weights_from_disk) and receiving it by broadcast (/init_weights_update_group
once, then /update_weights_from_distributed per bucket, gloo; the path of
`weight_sync.transport = nccl`). SmolLM2-135M in one CPU engine; each round sends a copy of the
model with changed weights both ways and checks that the engine then serves the same outputs.
Prints seconds per round and the medians. Asserts nothing (CPU figures; on GPUs the broadcast
is NCCL into SGLang, which this does not measure).

    .venv/bin/python tests/bench/bench_broadcast.py [--rounds 3] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_weight_sync import BIN, checkpoint, free_port, wait_http

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import read_checkpoint
from clawrl.trainer.megatron.nccl_sync import BroadcastSender, Engine


def fingerprint(url: str) -> list[float]:
    """Greedy log-probs on a fixed prompt: equal outputs mean equal weights."""
    reply = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": [1, 2, 3, 4, 5], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()  # fmt: skip
    return [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


async def rounds(url: str, model_dir: Path, work: Path, count: int, bucket_mb: int) -> None:
    sender = BroadcastSender([Engine(url)], "127.0.0.1", free_port(), group_name="bench",
                             backend="gloo", bucket_bytes=bucket_mb << 20)  # fmt: skip
    started = time.perf_counter()
    await sender.connect()
    print(f"group formed in {time.perf_counter() - started:.2f}s")
    disk, broadcast = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(count):
            path = checkpoint(model_dir, work / f"v{i}", 1.0 + 0.01 * (i + 1))
            started = time.perf_counter()
            body = {"model_path": str(path), "weight_version": f"d{i}"}
            reply = await client.post(f"{url}/update_weights_from_disk", json=body)
            disk.append(time.perf_counter() - started)
            assert reply.json()["success"], reply.text
            from_disk = await asyncio.to_thread(fingerprint, url)
            tensors = sorted((await asyncio.to_thread(read_checkpoint, path)).items())
            started = time.perf_counter()
            buckets = await sender.send(tensors, version=i)
            broadcast.append(time.perf_counter() - started)
            same = await asyncio.to_thread(fingerprint, url) == from_disk
            print(f"round {i}: disk {disk[-1]:.2f}s, broadcast {broadcast[-1]:.2f}s "
                  f"({buckets} buckets); same outputs: {same}")  # fmt: skip
    await sender.aclose()
    size = sum(t.numel() * t.element_size() for _, t in tensors) / 2**20
    print(
        f"median over {count} rounds ({size:.0f} MiB of weights): disk "
        f"{statistics.median(disk):.2f}s, broadcast {statistics.median(broadcast):.2f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args()
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen([str(BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port",
                               str(port), "--model", args.model])  # fmt: skip
    try:
        wait_http(f"{url}/health", engine, "engine")
        with tempfile.TemporaryDirectory() as work:
            asyncio.run(rounds(url, model_dir, Path(work), args.rounds, args.bucket_mb))
    finally:
        engine.terminate()
        engine.wait(30)


if __name__ == "__main__":
    sys.exit(main())
