"""An HF model directory from gathered tensors: config, safetensors, tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from clawrl.trainer.torch_backend import TOKENIZER_FILES


def write_hf_dir(
    hf: dict[str, torch.Tensor], source_dir: Path, path: Path, dtype: torch.dtype
) -> None:
    """Write `hf` (full HF-named tensors) as `path`/model.safetensors with the source model's
    config (dtype updated) and tokenizer files."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source_dir)
    config.dtype = dtype
    config.save_pretrained(path)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in hf.items()}
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        source = Path(source_dir) / name
        if source.is_file():
            shutil.copy2(source, Path(path) / name)
