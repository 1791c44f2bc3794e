"""Real PEFT adapters for the engine's LoRA tests: peft's get_peft_model on the served model,
lora_B drawn non-zero (a fresh adapter's B is zero, so it would change nothing), then
save_pretrained, exactly the directory a trainer export is."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_PROJECTIONS,
    seed: int = 0,
    scale: float = 0.05,
) -> Path:
    """Save an adapter of `model_dir` into `out_dir`, its B weights ~ N(0, scale^2)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets))
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir
