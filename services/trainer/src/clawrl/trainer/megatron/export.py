"""An HF model directory from gathered tensors: config, safetensors, tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# Files of an HF model directory that are not weights: copied next to every export so an engine
# can load it on its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


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
