"""PEFT adapters for tests and benchmarks, as the trainer exports them (`save_pretrained`), with
random lora_B: peft starts it at zero, and such an adapter would change nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(model_dir: Path, target: Path, seed: int, rank: int, scale: float) -> Path:
    """An adapter of rank `rank` on all seven projections of `model_dir`, lora_alpha 2 * rank,
    lora_B ~ N(0, scale^2); saved to `target`, which is returned."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, lora_dropout=0.0)
    lora = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    lora.save_pretrained(target)
    return target
