"""The model and its forward passes: batched prefill, batched decode over a left-padded KV
cache, prompt log-probs, in-place weight swaps, and LoRA adapters. Only the scheduler thread
calls into a ModelRunner (torch is not re-entrant across our batch state).

LoRA: the first adapter wraps the decoder in a peft model (`PeftModel`, adapters injected
in place, so the decoder's own modules now carry them); a forward pass then sets each row's
adapter (None: the base model) and the injected projections apply them stacked, two matrix
products per projection for the whole batch (lora_batch.py; peft's own mixed-batch forward
looped over the adapters in every projection): each row gets exactly its own adapter. Until an
adapter is loaded (and with LoRA off) the decoder runs bare, as before."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from clawrl.common.models import stretch_config
from clawrl.engine.cpu.adapters import PreparedAdapter
from clawrl.engine.cpu.attention import ATTENTION
from clawrl.engine.cpu.lora_batch import StackedLora
from clawrl.engine.cpu.one_row import one_row_linears
from clawrl.engine.cpu.prefix_cache import LayerKV
from clawrl.engine.cpu.sampling import token_logprobs

# Positions whose full-vocabulary log-softmax is computed at once for prompt log-probs
# (a [chunk, V] float tensor: 512 x 49152 x 4 B ~ 100 MB).
PROMPT_LOGPROB_CHUNK = 512
# Spare room a KV buffer gets when it grows: a quarter of what it holds, at least this many
# tokens (a prefill chunk's worth, or that many decode steps).
KV_ROOM_TOKENS = 256

TopLogprobs = list[tuple[float, int]]
# CPU flags that mean native bfloat16 arithmetic (x86: AVX512-BF16 or AMX; Arm: FEAT_BF16).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

log = logging.getLogger(__name__)


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (/proc/cpuinfo's flags). Without it torch
    emulates bf16 matmuls, slower than float32; a host without /proc/cpuinfo counts as not."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(BF16_FLAGS & set(value.split()))
    return False


def resolve_dtype(name: str, cpuinfo: str | None = None) -> torch.dtype:
    """engine.dtype as a torch dtype: auto is bfloat16 on a CPU with native bf16, else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(cpuinfo) else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"engine.dtype {name!r}: expected auto, float32 or bfloat16")
    if name == "bfloat16" and not native_bf16(cpuinfo):
        log.warning("engine.dtype=bfloat16 on a CPU without native bf16: torch emulates it "
                    "(slower than float32)")  # fmt: skip
    return getattr(torch, name)


class CheckpointError(ValueError):
    """A checkpoint that cannot replace the running weights (bad path, names or shapes)."""


class RoomyLayer(DynamicLayer):
    """A cache layer whose keys and values are views of buffers with spare room after them: a
    prefill chunk or a decode step is written into the room, where transformers' DynamicLayer
    concatenates the whole KV again (a copy of everything per chunk and per decode step, which
    made a chunked prefill slower than one forward pass over the same ids). When the room runs
    out the buffer grows by a quarter. Code that assigns .keys/.values (merge_kv, select_kv)
    may: the next update then starts a new buffer from them."""

    def __init__(self) -> None:
        super().__init__()
        self._key_room: torch.Tensor | None = None
        self._value_room: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        total = held + key_states.shape[-2]
        if not (
            _backed(self.keys, self._key_room, total)
            and _backed(self.values, self._value_room, total)
        ):
            room = total + max(total // 4, KV_ROOM_TOKENS)
            self._key_room = _regrow(self.keys, key_states, held, room)
            self._value_room = _regrow(self.values, value_states, held, room)
        self._key_room[..., held:total, :] = key_states
        self._value_room[..., held:total, :] = value_states
        self.keys = self._key_room[..., :total, :]
        self.values = self._value_room[..., :total, :]
        return self.keys, self.values


def _backed(view: torch.Tensor, buffer: torch.Tensor | None, total: int) -> bool:
    """Whether `view` is still the head of `buffer` (nobody replaced it) with room up to
    `total` tokens."""
    return (
        buffer is not None
        and view.dim() == 4
        and view.data_ptr() == buffer.data_ptr()
        and view.shape[:2] == buffer.shape[:2]
        and view.stride() == buffer.stride()
        and buffer.shape[-2] >= total
    )


def _regrow(held: torch.Tensor, new: torch.Tensor, count: int, room: int) -> torch.Tensor:
    """A buffer of `room` tokens starting with the `count` tokens of `held`."""
    batch, heads, _, dim = new.shape
    buffer = new.new_empty(batch, heads, room, dim)
    if count:
        buffer[..., :count, :] = held
    return buffer


def new_cache(config) -> DynamicCache:
    """An empty cache for `config` whose full-attention layers are RoomyLayers."""
    cache = DynamicCache(config=config)
    cache.layers = [
        RoomyLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


@dataclass
class KvBatch:
    """The running batch's KV cache. Rows are left-padded to a common length: row r's real
    tokens are the trailing `mask[r].sum()` columns, so a new token is appended to every row
    at the same column and RoPE positions are `mask.cumsum - 1` per row.

    mask: [B, T] int64 (1 real token, 0 padding); cache layers hold [B, H_kv, T, D].
    """

    cache: DynamicCache
    mask: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def real_tokens(self) -> int:
        return int(self.mask.sum())


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [missing, 0]
    return F.pad(x, pad)


def merge_kv(a: KvBatch, b: KvBatch) -> KvBatch:
    """Rows of `a` then rows of `b`, left-padded to the wider of the two."""
    width = max(a.width, b.width)
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        la.keys = torch.cat([_left_pad(la.keys, width, 2), _left_pad(lb.keys, width, 2)])
        la.values = torch.cat([_left_pad(la.values, width, 2), _left_pad(lb.values, width, 2)])
    a.mask = torch.cat([_left_pad(a.mask, width, 1), _left_pad(b.mask, width, 1)])
    return a


def select_kv(kv: KvBatch, rows: list[int]) -> KvBatch:
    """Only `rows`, in that order, with the columns that became padding in every row dropped."""
    index = torch.tensor(rows, dtype=torch.long)
    mask = kv.mask.index_select(0, index)
    used = mask.any(dim=0)
    start = int(used.nonzero()[0]) if bool(used.any()) else mask.shape[1]
    for layer in kv.cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, start:]
        layer.values = layer.values.index_select(0, index)[:, :, start:]
    kv.mask = mask[:, start:]
    return kv


@dataclass
class ExtendResult:
    """One sequence's forward pass over new tokens. hidden: [C, H] of the C new tokens;
    cache: the sequence's KV (batch of 1); head: the LM head."""

    hidden: torch.Tensor
    cache: DynamicCache
    head: Callable[[torch.Tensor], torch.Tensor]

    @functools.cached_property
    def last_logits(self) -> torch.Tensor:
        """[V] after the last new token, computed when first asked: only a prompt's last
        chunk needs them, and the head reads all its weights (113 MB for SmolLM2-135M in
        float32) for one row."""
        with torch.no_grad():
            return self.head(self.hidden[-1]).float()


def layer_kv(cache: DynamicCache, row: int = 0, last: int | None = None) -> LayerKV:
    """Row `row`'s keys and values per layer ([H_kv, n, D]); only the `last` n columns if set."""
    out = []
    for layer in cache.layers:
        k, v = layer.keys[row], layer.values[row]
        if last is not None:
            k, v = k[:, k.shape[1] - last :], v[:, v.shape[1] - last :]
        out.append((k, v))
    return out


class ModelRunner:
    """A causal LM loaded from a Hugging Face directory (safetensors)."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str = "float32",
        context_length: int | None = None,
        rope_scaling: str = "yarn",
        lora_merge_after: int = 0,
        lora_merge_failed: Callable[[], None] | None = None,
    ):
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.dtype = resolve_dtype(dtype)
        config = AutoConfig.from_pretrained(str(model_dir))
        self.long_context = stretch_config(config, context_length, rope_scaling)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), config=config, dtype=self.dtype, attn_implementation=ATTENTION
        )
        model.eval()
        if self.dtype == torch.bfloat16:
            one_row_linears(model)
        # from_pretrained leaves the weights on a private mapping of the safetensors file, so
        # the first write into them (the first weight update, inside a sync's pause) would pay
        # ~1 s of copy-on-write faults for SmolLM2-135M. Pay it here, at start-up.
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
        self.model = model
        self.config = model.config
        self.decoder = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        params = dict(model.named_parameters())
        self._state = model.state_dict()
        # Names that alias another tensor (tied lm_head): a checkpoint may omit them.
        self._aliases = {name for name in self._state if name not in params}
        self.shapes = {name: tuple(t.shape) for name, t in self._state.items()}
        # The decoder's attribute in the causal LM ("model" for Llama): adapters are saved
        # with keys rooted at the causal LM.
        self.decoder_prefix = next(n for n, m in model.named_children() if m is self.decoder)
        self._peft = None  # PeftModel around the decoder once an adapter is loaded
        # Runs the injected adapters, a mixed batch at once; a batch under one adapter alone
        # on merged weights once that adapter had lora_merge_after passes in a row (0: never).
        self._stacked = StackedLora(lora_merge_after, lora_merge_failed)
        self.adapters: set[str] = set()  # keys of the loaded adapters
        # key -> peft's name for it (the key it was injected as; `replace_adapter` reuses it)
        self._names: dict[str, str] = {}
        self._shapes: dict[str, tuple] = {}  # peft name -> what its injected modules fit

    # ----- LoRA adapters --------------------------------------------------------------------

    def add_adapter(self, key: str, adapter: PreparedAdapter) -> None:
        """Inject a checked adapter as `key` (the model thread's quick step of a load)."""
        from peft import PeftModel, set_peft_model_state_dict

        first = self._peft is None
        try:
            if first:
                self._peft = PeftModel(
                    self.decoder, adapter.config, adapter_name=key, low_cpu_mem_usage=True
                )
            else:
                self._peft.add_adapter(key, adapter.config, low_cpu_mem_usage=True)
            result = set_peft_model_state_dict(
                self._peft, adapter.weights, adapter_name=key, low_cpu_mem_usage=True
            )
            wrong = [k for k in result.unexpected_keys if key in k or "lora_" in k]
            if wrong:
                raise ValueError(f"peft did not take tensors {wrong[:3]}")
            self._peft.eval()
        except Exception:
            self._drop(key, first)
            raise
        finally:
            if self._peft is not None:  # every injected projection runs stacked
                self._stacked.attach(self._peft)
        self.adapters.add(key)
        self._names[key] = key
        self._shapes[key] = adapter_shape(adapter)

    def replace_adapter(self, old: str, key: str, adapter: PreparedAdapter) -> bool:
        """Serve adapter `key` from the modules peft injected for `old` (which leaves): its
        tensors are put in place of old's, the same modules and scaling, milliseconds instead
        of a new injection (peft walks every module: ~0.4 s for SmolLM2-135M). False, with
        nothing changed, when the two differ in rank, alpha or target modules."""
        name = self._names[old]
        if self._shapes[name] != adapter_shape(adapter):
            return False
        assert self._peft is not None
        for saved, tensor in adapter.weights.items():
            path, _, leaf = saved.rpartition(".")  # ...lora_A + weight
            module = self._peft.get_submodule(f"{path}.{name}")
            setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
        self.adapters.discard(old)
        del self._names[old]
        self.adapters.add(key)
        self._names[key] = name
        self._stacked.attach(self._peft)  # its tensors changed: stack them again
        return True

    def remove_adapter(self, key: str) -> None:
        """Delete an adapter; with the last one gone the decoder is bare again."""
        self.adapters.discard(key)
        name = self._names.pop(key, key)
        self._shapes.pop(name, None)
        self._drop(name, not self.adapters)
        if self._peft is not None:
            self._stacked.attach(self._peft)
        else:
            self._stacked.detach()

    def _drop(self, key: str, last: bool) -> None:
        if self._peft is None:
            return
        if last:
            # peft's unload() puts the original Linear modules (the same tensors) back.
            self._peft.unload()
            self._peft = None
        elif key in self._peft.peft_config:
            self._peft.delete_adapter(key)

    def _forward(self, adapters: list[str | None], **inputs):
        if not self.adapters:
            return self.decoder(**inputs)
        self._stacked.plan([None if a is None else self._names[a] for a in adapters])
        try:
            return self.decoder(**inputs)  # its projections carry the injected adapters
        finally:
            self._stacked.plan(None)

    # ----- forward passes -------------------------------------------------------------------

    def extend(
        self,
        cache: DynamicCache | LayerKV | None,
        past: int,
        ids: list[int],
        adapter: str | None = None,
    ) -> ExtendResult:
        """Feed one sequence's next tokens after `past` cached ones (a prefix from the prefix
        cache, earlier chunks of its prompt, or nothing), through its adapter (None: base)."""
        if not isinstance(cache, DynamicCache):
            prefix = cache
            cache = new_cache(self.config)
            for index, (k, v) in enumerate(prefix or []):
                cache.update(k.unsqueeze(0), v.unsqueeze(0), index)
        tokens = torch.tensor([ids], dtype=torch.long)
        positions = torch.arange(past, past + len(ids)).unsqueeze(0)
        mask = torch.ones(1, past + len(ids), dtype=torch.long)
        out = self._forward(
            [adapter],
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[0]
        return ExtendResult(hidden, out.cache, self.lm_head)

    def decode(
        self, kv: KvBatch, token_ids: torch.Tensor, adapters: list[str | None] | None = None
    ) -> torch.Tensor:
        """Append one token per row and return the next-token logits. token_ids: [B] -> [B, V];
        adapters: each row's adapter (None: base)."""
        positions = kv.mask.sum(dim=-1, keepdim=True)
        mask = torch.cat([kv.mask, torch.ones(kv.size, 1, dtype=kv.mask.dtype)], dim=-1)
        out = self._forward(
            adapters or [None] * kv.size,
            input_ids=token_ids.unsqueeze(-1),
            attention_mask=mask,
            position_ids=positions,
            cache=kv.cache,
            use_cache=True,
        )
        kv.mask = mask
        return self.lm_head(out.last_hidden_state[:, -1]).float()

    def logprobs_of(
        self, hidden: torch.Tensor, targets: list[int], top_n: int
    ) -> tuple[list[float], list[TopLogprobs | None]]:
        """Log-probs of each target given the hidden state just before it.

        hidden: [N, H], targets: N ids -> N log-probs (and top-n per position if asked).
        """
        logps: list[float] = []
        tops: list[TopLogprobs | None] = []
        ids = torch.tensor(targets, dtype=torch.long)
        for lo in range(0, len(targets), PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, len(targets))
            logp, top_vals, top_ids = token_logprobs(self.lm_head(hidden[lo:hi]), ids[lo:hi], top_n)
            logps.extend(logp.tolist())
            tops.extend(_tops(top_vals, top_ids, hi - lo))
        return logps, tops

    # ----- weights ------------------------------------------------------------------------

    def check_checkpoint(self, tensors: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Raise CheckpointError unless `tensors` names exactly this model's weights (tied
        aliases may be left out; with `partial`, any subset: one bucket of a broadcast) with
        the same shapes. Reads nothing the decode loop writes."""
        unknown = sorted(set(tensors) - set(self.shapes))
        missing = [] if partial else sorted(set(self.shapes) - set(tensors) - self._aliases)
        wrong = sorted(
            f"{name}: {tuple(t.shape)} != {self.shapes[name]}"
            for name, t in tensors.items()
            if name in self.shapes and tuple(t.shape) != self.shapes[name]
        )
        problems = []
        if wrong:
            problems.append(f"shape mismatch ({len(wrong)}): {', '.join(wrong[:5])}")
        if unknown:
            problems.append(f"unknown tensors ({len(unknown)}): {', '.join(unknown[:5])}")
        if missing:
            problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:5])}")
        if problems:
            raise CheckpointError("; ".join(problems))

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors into the live parameters in place (tied weights follow)."""
        self._stacked.invalidate()  # merged weights hold the old base
        for name, tensor in tensors.items():
            self._state[name].copy_(tensor.to(self.dtype))


def _tops(
    values: torch.Tensor | None, ids: torch.Tensor | None, n: int
) -> list[TopLogprobs | None]:
    if values is None or ids is None:
        return [None] * n
    return [
        list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint: a directory (model.safetensors, or shards named
    by model.safetensors.index.json, or every *.safetensors) or one .safetensors file."""
    from safetensors.torch import load_file

    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    elif root.is_dir():
        index = root / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [root / name for name in names]
        else:
            files = sorted(root.glob("*.safetensors"))
    else:
        raise CheckpointError(f"no checkpoint at {root}")
    if not files:
        raise CheckpointError(f"no .safetensors files in {root}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # corrupt or not safetensors
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return tensors


def adapter_shape(adapter: PreparedAdapter) -> tuple:
    """What an adapter's injected peft modules fit: any adapter with the same shape can reuse
    them (`replace_adapter`)."""
    config = adapter.config
    return (adapter.rank, config.lora_alpha, bool(config.use_rslora), frozenset(adapter.modules))
