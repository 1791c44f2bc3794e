"""Benchmark: tokens/s of a training step (log-prob recompute + PPO step), the Megatron backend
at TP=1 and TP=N against the PyTorch backend, on CPU with the same fixed batch, and the time of
an HF export for the disk sync (Megatron: through mbridge). Prints a table; asserts nothing.

SmolLM2-135M has 9 attention heads and 3 KV heads, so TP=2 is impossible for it (the layout check
refuses it, printed below); its multi-rank figure is at TP=3. On this 2-core machine TP>1 runs
more ranks than cores: the figure shows the cost of the collectives, not a speed-up.

At TP>1 sequence parallelism is on by default; `--sequence-parallel both` times each TP>1 with it
off and on, side by side (it adds a gather and a reduce-scatter per layer).

    .venv/bin/python tests/bench/bench_megatron.py [--model SmolLM2-135M-Instruct] [--tp 1 3]
        [--batch 8] [--prompt 128] [--response 128] [--steps 2] [--skip-torch]
        [--sequence-parallel on|off|both]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.common.models import resolve_model_dir  # noqa: E402
from clawrl.common.records import Sample  # noqa: E402
from clawrl.common.settings import ModelSettings  # noqa: E402
from clawrl.trainer.driver import ActorGroup, InProcess  # noqa: E402
from clawrl.trainer.megatron.actors import check_layout, start_actors, stop_actors  # noqa: E402
from clawrl.trainer.megatron.layout import LayoutError  # noqa: E402
from clawrl.trainer.samples import collate  # noqa: E402
from clawrl.trainer.settings import TrainerSettings  # noqa: E402
from clawrl.trainer.torch_backend import TorchBackend  # noqa: E402


def batch_of(args: argparse.Namespace):
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(args.batch):
        ids = torch.randint(0, 49152, (args.prompt + args.response,), generator=gen).tolist()
        prompt, response = ids[: args.prompt], ids[args.prompt :]
        reward = 1.0 if i % 2 else -1.0
        samples.append(Sample(sample_id=f"b:{i}", session_id=f"b{i}", prompt_ids=prompt,
                              response_ids=response, old_logprobs=[-1.0] * len(response),
                              loss_mask=[1.0] * len(response), reward=reward))  # fmt: skip
    return collate(samples)


async def measure(name: str, backend, model_dir: Path, args) -> dict:
    started = time.perf_counter()
    await backend.call("load", model_dir, load_reference=False)
    load_s = time.perf_counter() - started
    batch = batch_of(args)
    settings = TrainerSettings()
    times = []
    for step in range(args.steps + 1):  # the first is a warm-up
        started = time.perf_counter()
        old = await backend.call("compute_logprobs", batch)
        advantages = batch.reward[:, None] * batch.loss_mask
        metrics = await backend.call("train_step", batch.with_targets(old, advantages),
                                     settings.ppo.loss_config())  # fmt: skip
        if step:
            times.append(time.perf_counter() - started)
    step_s = sum(times) / len(times)
    tokens = int(batch.lengths.sum())
    with tempfile.TemporaryDirectory() as export_dir:
        started = time.perf_counter()
        await backend.call("export_hf", Path(export_dir))
        export_s = time.perf_counter() - started
    return {"backend": name, "load_s": load_s, "step_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "loss": metrics["loss"],
            "export_s": export_s}  # fmt: skip


def settings_for(args, backend: str, tp: int, sequence_parallel: bool = True) -> TrainerSettings:
    return TrainerSettings(
        model={"path": args.model},
        train={"backend": backend, "device": "cpu", "micro_batch_tokens": args.micro_batch_tokens},
        ray={"actor_num_cpus": max(1, 2 // tp)},
        megatron={"tensor_parallel_size": tp, "sequence_parallel": sequence_parallel},
    )


async def main(args: argparse.Namespace) -> None:
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    try:
        check_layout(settings_for(args, "megatron", 2), model_dir)
        print("TP=2: accepted")
    except LayoutError as exc:
        print(f"TP=2 refused: {exc}")
    ray.init(num_cpus=max(2, *args.tp), include_dashboard=False, log_to_driver=False)
    print(f"{args.model}: batch {args.batch} x ({args.prompt} prompt + {args.response} "
          f"response), micro-batch budget {args.micro_batch_tokens}, {args.steps} timed steps "
          f"(+1 warm-up); a step = log-prob recompute + PPO step")  # fmt: skip
    print(f"{'backend':<16}{'load s':>9}{'step s':>9}{'tokens/s':>10}{'loss':>10}{'export s':>10}",
          flush=True)  # fmt: skip

    def show(r: dict) -> None:
        print(f"{r['backend']:<16}{r['load_s']:>9.1f}{r['step_s']:>9.1f}"
              f"{r['tokens_per_s']:>10.1f}{r['loss']:>10.4f}{r['export_s']:>10.1f}",
              flush=True)  # fmt: skip

    torch.set_num_threads(2)
    if not args.skip_torch:
        torch_settings = settings_for(args, "torch", 1)
        backend = InProcess(TorchBackend(torch_settings.train, torch_settings.ppo))
        show(await measure("torch", backend, model_dir, args))
        del backend  # its model, optimizer and activations: gigabytes the Megatron ranks need
        gc.collect()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.sequence_parallel]
    for tp in args.tp:
        for sequence_parallel in modes if tp > 1 else [False]:
            name = f"megatron TP={tp}" + (" SP" if sequence_parallel else "")
            actors = start_actors(settings_for(args, "megatron", tp, sequence_parallel))
            show(await measure(name, ActorGroup(actors), model_dir, args))
            stop_actors(actors)
    ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--skip-torch", action="store_true", help="only the Megatron backend")
    parser.add_argument("--sequence-parallel", choices=["on", "off", "both"], default="on",
                        help="at TP>1: with sequence parallelism, without, or both")  # fmt: skip
    asyncio.run(main(parser.parse_args()))
