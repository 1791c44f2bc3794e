"""Benchmark of the trainer on CPU with the real model: samples/s and tokens/s of a step (batch
16, responses of ~64 tokens sampled by the CPU engine), the step split into log-prob recompute,
forward/backward, optimizer, export and checkpoint; the latency from a sample's XADD to the end
of the step that trained it; peak memory; and mean |old - rollout| on unchanged weights against
the engine's recorded log-probs. Prints a table; asserts nothing.

With --serving-clients N the engine keeps serving N looping clients while the steps run, as it
does in `make run`, so the CPU split between serving and training shows (--engine-threads and
--trainer-threads set each side's torch threads).

    .venv/bin/python tests/bench/bench_trainer.py [--model SmolLM2-135M-Instruct] [--steps 3]
        [--batch 16] [--new-tokens 64] [--state-interval 1] [--serving-clients 4
        --engine-threads 1 --trainer-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from redis.asyncio import Redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.common.proto.records_pb2 import SampleMode  # noqa: E402
from clawrl.common.records import Sample  # noqa: E402
from clawrl.common.streams import publish  # noqa: E402
from clawrl.trainer.driver import InProcess  # noqa: E402
from clawrl.trainer.metrics import TrainerMetrics  # noqa: E402
from clawrl.trainer.service import build_trainer  # noqa: E402
from clawrl.trainer.settings import TrainerSettings  # noqa: E402
from clawrl.trainer.torch_backend import TorchBackend  # noqa: E402
from tests.bench.bench_engine import PROMPTS as QUESTIONS  # noqa: E402
from tests.conftest import VENV_BIN, free_port, start_redis, wait_until  # noqa: E402


def start_engine(
    model: str, log_dir: Path, threads: int | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (log_dir / "engine.log").open("wb")
    proc = subprocess.Popen(
        [str(VENV_BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port", str(port),
         "--model", model, *(["--torch-threads", str(threads)] if threads else [])],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 300, "engine",
               proc)  # fmt: skip
    return proc, url


async def rollouts(url: str, tokenizer, count: int, new_tokens: int) -> list[Sample]:
    """`count` responses sampled by the engine (temperature 0.7, top-p 0.9) with their raw
    log-probs, as the judge would pass them on, with alternating rewards."""

    async def one(client: httpx.AsyncClient, i: int) -> Sample:
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        params = {"max_new_tokens": new_tokens, "temperature": 0.7, "top_p": 0.9}
        body = (await client.post(f"{url}/generate", json={"input_ids": prompt,
                "sampling_params": params, "return_logprob": True})).json()  # fmt: skip
        logprobs = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
        return Sample(sample_id=f"bench{i}:0", session_id=f"bench{i}", prompt_ids=prompt,
                      response_ids=body["output_ids"], old_logprobs=logprobs,
                      loss_mask=[1.0] * len(logprobs), reward=1.0 if i % 2 else -1.0,
                      temperature=0.7, top_p=0.9,
                      mode=SampleMode.SAMPLE_MODE_BINARY_RL)  # fmt: skip

    async with httpx.AsyncClient(timeout=3600) as client:
        return await asyncio.gather(*(one(client, i) for i in range(count)))


async def serve_forever(url: str, clients: int, new_tokens: int, served: list[int]) -> None:
    """`clients` users generating back to back (the serving load beside training); appends
    each reply's token count to `served`."""

    async def client_loop(client: httpx.AsyncClient, i: int) -> None:
        while True:
            reply = await client.post(f"{url}/generate", json={
                "text": QUESTIONS[i % len(QUESTIONS)],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.7}})  # fmt: skip
            served.append(reply.json()["meta_info"]["completion_tokens"])

    async with httpx.AsyncClient(timeout=3600) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(clients)))


async def run(args: argparse.Namespace, work: Path) -> None:
    from transformers import AutoTokenizer

    from clawrl.common.models import resolve_model_dir
    from clawrl.common.settings import ModelSettings

    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    engine, url = start_engine(args.model, work, args.engine_threads)
    try:
        started = time.perf_counter()
        try:
            samples = await rollouts(url, AutoTokenizer.from_pretrained(model_dir), args.batch,
                                     args.new_tokens)  # fmt: skip
        except Exception:
            print((work / "engine.log").read_text(errors="replace")[-3000:])
            raise
        rollout_s = time.perf_counter() - started
        await measure(args, work, url, samples, rollout_s)
    finally:
        engine.terminate()
        engine.wait()


async def measure(
    args: argparse.Namespace, work: Path, url: str, samples: list[Sample], rollout_s: float
) -> None:
    """The trainer's steps on `samples` (the engine at `url` serving beside them when asked),
    and the table."""
    redis_port = free_port()
    redis_proc = start_redis(redis_port, work, "bench-redis")
    redis = Redis.from_url(f"redis://127.0.0.1:{redis_port}/0")
    settings = TrainerSettings(
        model={"path": args.model},
        redis={"url": f"redis://127.0.0.1:{redis_port}/0"},
        rollout={"rollout_batch_size": args.batch},
        consumer={"block_ms": 100},
        checkpoint={"dir": work / "ck", "state_interval": args.state_interval},
        train={"micro_batch_tokens": args.micro_batch_tokens, "num_threads": args.trainer_threads},
    )
    backend = InProcess(TorchBackend(settings.train, settings.ppo))
    trainer = await build_trainer(settings, backend, redis, TrainerMetrics())
    served: list[int] = []
    serving = (
        asyncio.create_task(serve_forever(url, args.serving_clients, args.new_tokens, served))
        if args.serving_clients
        else None
    )
    serving_started = time.perf_counter()
    rows = []
    latencies = []
    for step in range(args.steps):
        for s in samples:
            s.sample_id = f"bench{step}-{s.session_id}:0"
            s.policy_version = trainer.state.policy_version
            await publish(redis, settings.redis.samples_stream, s, maxlen=100_000)
        xadd_done = time.time()
        collected = await trainer.intake.next_batch(
            trainer.state.policy_version, trainer.trained.__contains__, trainer.uncommitted,
            asyncio.Event(), block_ms=100,
        )  # fmt: skip
        report = await trainer.step(collected)
        end = time.time()
        latencies += [end - h.xadd_time_s for h in collected.held]
        rows.append((report.figures, end - xadd_done))
    serving_s = time.perf_counter() - serving_started
    if serving:
        serving.cancel()
    await redis.aclose()
    redis_proc.stop()

    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    response_tokens = sum(len(s.response_ids) for s in samples)
    print(f"\ntrainer benchmark: {args.model}, CPU, batch {args.batch}, {tokens} tokens per step "
          f"({response_tokens} response tokens, mean prompt "
          f"{statistics.mean(len(s.prompt_ids) for s in samples):.0f}), "
          f"rollouts from the CPU engine in {rollout_s:.1f}s")  # fmt: skip
    print(f"serving beside the steps: {args.serving_clients} clients; torch threads: engine "
          f"{args.engine_threads or 'default'}, trainer {args.trainer_threads or 'default'}; "
          f"served {sum(served) / serving_s:.1f} tokens/s during the steps")  # fmt: skip
    header = ("step", "total s", "logp s", "fwd/bwd s", "optim s", "export s", "ckpt s",
              "samples/s", "tokens/s", "|old-rollout|")  # fmt: skip
    print(" ".join(f"{h:>13}" for h in header))
    for i, (f, _) in enumerate(rows, 1):
        values = (i, f["step_s"], f["logprobs_s"], f["forward_backward_s"], f["optimizer_s"],
                  f.get("export_s", 0.0), f.get("checkpoint_s", 0.0), args.batch / f["step_s"],
                  f["tokens_per_second"], f["old_rollout_abs_diff"])  # fmt: skip
        print(" ".join(f"{v:>13.4g}" for v in values))
    print(
        f"XADD -> end of step latency: median {statistics.median(latencies):.2f}s, "
        f"max {max(latencies):.2f}s"
    )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak memory (RSS of this process: backend + driver): {peak_kib / 1024:.0f} MiB")
    print(
        f"mean |old - rollout| on unchanged weights (step 1, CPU engine): "
        f"{rows[0][0]['old_rollout_abs_diff']:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--state-interval", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--serving-clients", type=int, default=0, help="load beside the steps")
    parser.add_argument("--engine-threads", type=int, help="the engine's torch threads")
    parser.add_argument("--trainer-threads", type=int, help="the trainer's torch threads")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        asyncio.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
