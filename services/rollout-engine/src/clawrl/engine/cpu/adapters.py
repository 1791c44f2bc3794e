"""Reading a PEFT LoRA adapter directory and checking it against the served model, before it is
handed to peft on the model thread.

Everything slow or fallible happens here, in a worker thread: reading adapter_config.json and
the weights, checking every tensor against the module it adapts, the rank and the target
modules against the server's limits. What is left for the model thread is peft's injection of
already-checked tensors.

The runner wraps its decoder (the causal LM's body), not the whole causal LM, so the adapter's
keys (`base_model.model.<path in the causal LM>.lora_A.weight`) are re-rooted at the decoder.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from clawrl.engine.lora import LoraError, normalized_modules
from clawrl.engine.settings import LORA_TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
SAVED_PREFIX = "base_model.model."  # how peft's save_pretrained roots a causal LM's keys
# peft config fields whose adapters the engine cannot serve exactly (or SGLang refuses).
UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "layers_to_transform": "layers_to_transform",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable tokens",
}


@dataclass
class PreparedAdapter:
    """An adapter ready for `ModelRunner.add_adapter`: the peft config to inject (targets as
    short module names) and its tensors keyed for the decoder-rooted peft model."""

    config: object  # peft LoraConfig
    weights: dict[str, torch.Tensor]
    rank: int
    modules: set[str]  # short names (q_proj, ...)


def _linear(module: nn.Module) -> nn.Linear | None:
    """The plain Linear a path names, also when peft already wraps it (base_layer)."""
    base = getattr(module, "base_layer", module)
    return base if isinstance(base, nn.Linear) else None


def read_adapter(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    """The LoraConfig and tensors of a PEFT adapter directory (local files only: a name that is
    not a directory here is an error, never a Hub download)."""
    from peft import LoraConfig, PeftConfig
    from peft.utils import load_peft_weights

    root = Path(path).expanduser()
    if not root.is_dir():
        raise LoraError(f"Can't find an adapter directory at '{path}'")
    if not (root / CONFIG_FILE).is_file():
        raise LoraError(f"Can't find '{CONFIG_FILE}' at '{path}': not a PEFT adapter directory")
    try:
        config = PeftConfig.from_pretrained(str(root))
    except Exception as exc:  # malformed JSON, unknown peft_type
        raise LoraError(f"cannot read {root / CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, LoraConfig):
        raise LoraError(f"{path} holds a {type(config).__name__}, not a LoRA adapter")
    if not any((root / name).is_file() for name in WEIGHT_FILES):
        raise LoraError(f"no adapter weights ({' or '.join(WEIGHT_FILES)}) in '{path}'")
    try:
        weights = load_peft_weights(str(root), device="cpu")
    except Exception as exc:  # corrupt file
        raise LoraError(f"cannot read the adapter weights in '{path}': {exc}") from exc
    return config, weights


def prepare_adapter(
    name: str,
    path: str,
    decoder: nn.Module,
    decoder_prefix: str,
    *,
    max_rank: int,
    allowed_modules: set[str],
    dtype: torch.dtype,
) -> PreparedAdapter:
    """Read and check adapter `name` at `path` for `decoder` (reached as `decoder_prefix` +
    "." in the causal LM). Raises LoraError with the reason it cannot be served."""
    config, saved = read_adapter(path)
    for attr, what in UNSUPPORTED.items():
        if getattr(config, attr, None):
            raise LoraError(
                f"Failed to load {name} because LoRA serving currently doesn't support {what}"
            )
    root = SAVED_PREFIX + decoder_prefix + "."
    weights: dict[str, torch.Tensor] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # module path -> {lora_A/B: shape}
    for key, tensor in saved.items():
        module_path, _, leaf = key.rpartition(".lora_")
        if not key.startswith(root) or leaf not in ("A.weight", "B.weight"):
            raise LoraError(
                f"Failed to load {name}: tensor {key} is not a LoRA A/B weight of a "
                f"projection in the decoder"
            )
        rel = module_path[len(root) :]
        shapes.setdefault(rel, {})[leaf[0]] = tuple(tensor.shape)
        weights[f"{SAVED_PREFIX}{rel}.lora_{leaf}"] = tensor.to(dtype)
    if not shapes:
        raise LoraError(f"Failed to load {name}: the adapter has no LoRA weights")
    modules = {rel.rsplit(".", 1)[-1] for rel in shapes}
    unsupported = sorted(modules - set(LORA_TARGET_MODULES))
    if unsupported:
        raise LoraError(
            f"Failed to load {name}: LoRA on {', '.join(unsupported)} is not supported "
            f"(supported: {', '.join(LORA_TARGET_MODULES[:7])})"
        )
    rank = _check_shapes(name, shapes, decoder)
    if rank != config.r:
        raise LoraError(f"Failed to load {name}: its weights have rank {rank}, its config says "
                        f"r={config.r}")  # fmt: skip
    # Every projection of the targeted kinds must be adapted: peft wraps them all.
    wanted = {
        path_ for path_, module in decoder.named_modules() if path_.rsplit(".", 1)[-1] in modules
    }
    wanted = {p for p in wanted if _linear(decoder.get_submodule(p)) is not None}
    missing = sorted(wanted - set(shapes))
    if missing:
        raise LoraError(
            f"Failed to load {name}: the adapter has no weights for {len(missing)} of the "
            f"{len(wanted)} {'/'.join(sorted(modules))} projections (e.g. {missing[0]})"
        )
    if rank > max_rank or not normalized_modules(modules) <= allowed_modules:
        raise LoraError(
            f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory "
            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
            "configured `--max-lora-rank` and that the target modules are included in "
            "`--lora-target-modules`."
        )
    inject = copy.deepcopy(config)
    inject.target_modules = sorted(modules)
    inject.inference_mode = True
    inject.lora_dropout = 0.0
    return PreparedAdapter(inject, weights, rank, modules)


def _check_shapes(
    name: str, shapes: dict[str, dict[str, tuple[int, ...]]], decoder: nn.Module
) -> int:
    """The adapter's rank, after checking each A [r, in] and B [out, r] against its module."""
    ranks = set()
    for rel, pair in sorted(shapes.items()):
        try:
            linear = _linear(decoder.get_submodule(rel))
        except AttributeError:
            linear = None
        if linear is None:
            raise LoraError(f"Failed to load {name}: the model has no projection {rel}")
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoraError(f"Failed to load {name}: {rel} lacks its lora_A or lora_B weight")
        if len(a) != 2 or len(b) != 2 or a[1] != linear.in_features:
            raise LoraError(f"Failed to load {name}: {rel}.lora_A is {a}, the model needs [r, "
                            f"{linear.in_features}]")  # fmt: skip
        if b != (linear.out_features, a[0]):
            raise LoraError(f"Failed to load {name}: {rel}.lora_B is {b}, the model needs "
                            f"[{linear.out_features}, {a[0]}]")  # fmt: skip
        ranks.add(a[0])
    if len(ranks) > 1:
        raise LoraError(f"Failed to load {name}: its modules have different ranks {sorted(ranks)}")
    return ranks.pop()


class ResidentSet:
    """Which loaded adapters are injected in the model (resident: a batch can use them), at most
    `capacity` of them, and which one makes room for another, as SGLang's LoRA memory pool
    chooses: never one the running batch uses nor a pinned one; of the rest the least recently
    used (`lru`) or the first injected (`fifo`). Bookkeeping only: the scheduler injects."""

    def __init__(self, capacity: int, policy: str = "lru"):
        if policy not in ("lru", "fifo"):
            raise ValueError(f"lora_eviction_policy {policy!r}: choose lru or fifo")
        self.capacity = capacity
        self.policy = policy
        self._order: dict[str, None] = {}  # eviction order, first out first
        self.pinned: set[str] = set()  # keys, resident or not

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> list[str]:
        """The resident adapters, the next to evict first."""
        return list(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) >= self.capacity

    def add(self, key: str) -> None:
        if self.full:
            raise RuntimeError(f"no free adapter slot for {key} ({self.capacity} resident)")
        self._order[key] = None

    def discard(self, key: str) -> None:
        self._order.pop(key, None)

    def touch(self, keys) -> None:
        """`keys` are in use now: under lru they are evicted last."""
        if self.policy != "lru":
            return
        for key in keys:
            if key in self._order:
                self._order[key] = self._order.pop(key)

    def victim(self, busy: set) -> str | None:
        """The resident adapter to evict for a new one, or None when every one is busy (used
        by the running batch) or pinned."""
        return next((k for k in self._order if k not in busy and k not in self.pinned), None)
