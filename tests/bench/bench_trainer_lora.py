"""Benchmark of LoRA against full fine-tuning in the PyTorch backend on CPU: the step time
(old log-probs + forward/backward + optimizer) on a batch of replies sampled from the model, at
1 and 2 torch threads; the export's time and size on disk (a PEFT adapter vs the whole model).
Prints a table; asserts nothing.

    .venv/bin/python tests/bench/bench_trainer_lora.py [--model SmolLM2-135M-Instruct]
        [--batch 8] [--new-tokens 64] [--steps 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.common.models import resolve_model_dir  # noqa: E402
from clawrl.common.settings import ModelSettings  # noqa: E402
from clawrl.trainer.samples import collate  # noqa: E402
from clawrl.trainer.settings import LoraSettings, PPOSettings, TrainSettings  # noqa: E402
from clawrl.trainer.torch_backend import TorchBackend  # noqa: E402
from tests.integration.trainer.test_lora_learning import sample_replies  # noqa: E402


def size_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(model_dir: Path, batch, lora: bool, threads: int, steps: int) -> dict[str, float]:
    backend = TorchBackend(
        TrainSettings(num_threads=threads), PPOSettings(lr=5e-4), lora=LoraSettings(enabled=lora)
    )
    backend.load(model_dir, load_reference=False)
    cfg = PPOSettings().loss_config()
    advantages = batch.reward[:, None] * batch.loss_mask
    times, fwd_bwd, opt = [], [], []
    for i in range(steps + 1):  # the first one warms up allocators and Adam's moments
        started = time.perf_counter()
        old = backend.compute_logprobs(batch)
        figures = backend.train_step(batch.with_targets(old, advantages), cfg)
        if i:
            times.append(time.perf_counter() - started)
            fwd_bwd.append(figures["forward_backward_s"])
            opt.append(figures["optimizer_s"])
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        backend.export_hf(Path(tmp))
        export_s = time.perf_counter() - started
        size = size_on_disk(Path(tmp))
    trainable = sum(p.numel() for p in backend._trainable().values())
    return {"step_s": statistics.median(times), "fwd_bwd_s": statistics.median(fwd_bwd),
            "opt_s": statistics.median(opt), "export_s": export_s, "export_mb": size / 2**20,
            "trainable_m": trainable / 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    model_dir = resolve_model_dir(ModelSettings(path=args.model))
    batch = collate(sample_replies(model_dir, args.batch, args.new_tokens))
    reply = float(batch.response_lengths.float().mean())
    print(f"{args.model}: batch {batch.size}, replies of {reply:.0f} tokens "
          f"({int(batch.lengths.sum())} tokens in all), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'threads':>7} {'mode':>5} {'trainable':>10} {'step s':>7} {'fwd/bwd s':>9} "
          f"{'opt s':>6} {'export s':>8} {'export MiB':>10}")  # fmt: skip
    for threads in args.threads:
        for lora in (False, True):
            m = measure(model_dir, batch, lora, threads, args.steps)
            print(f"{threads:>7} {'lora' if lora else 'full':>5} {m['trainable_m']:>9.2f}M "
                  f"{m['step_s']:>7.2f} {m['fwd_bwd_s']:>9.2f} {m['opt_s']:>6.3f} "
                  f"{m['export_s']:>8.2f} {m['export_mb']:>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
