"""The PyTorch backend on one GPU in bfloat16 autocast (only on a GPU machine): log-probs close to
the float32 CPU ones, a step that follows the advantage sign, a bfloat16 export that
transformers reloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.common.models import SMOLLM2, resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        ids = torch.randint(0, 49152, (96,), generator=gen).tolist()
        out.append(Sample(sample_id=f"g:{i}", session_id="g", prompt_ids=ids[:32],
                          response_ids=ids[32:], old_logprobs=[-1.0] * 64, loss_mask=[1.0] * 64,
                          reward=1.0 if i % 2 else -1.0))  # fmt: skip
    return out


def test_bf16_on_gpu(tmp_path: Path) -> None:
    model_dir = resolve_model_dir(ModelSettings(path=SMOLLM2))
    gpu = TorchBackend(TrainSettings(device="cuda"), PPOSettings(lr=1e-4))
    gpu.load(model_dir, load_reference=False)
    assert gpu.dtype == torch.bfloat16  # compute dtype; the weights stay float32
    assert next(gpu.model.parameters()).dtype == torch.float32
    cpu = TorchBackend(TrainSettings(device="cpu"), PPOSettings())
    cpu.load(model_dir, load_reference=False)
    batch = collate(samples())
    old = gpu.compute_logprobs(batch)
    gap = float((old - cpu.compute_logprobs(batch)).abs().mean())
    print(f"mean |bf16 GPU - fp32 CPU| log-prob: {gap:.4f}")
    assert gap < 0.1
    gpu.train_step(batch.with_targets(old, batch.reward[:, None] * batch.loss_mask), LossConfig())
    delta = (gpu.compute_logprobs(batch) - old).mean(dim=1)
    assert (delta[batch.reward > 0] > 0).all() and (delta[batch.reward < 0] < 0).all()
    gpu.export_hf(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.dtype == torch.bfloat16
