"""The model and its forward passes: batched prefill, batched decode over a left-padded KV
cache, prompt log-probs, and in-place weight swaps. Only the scheduler thread calls into a
ModelRunner (torch is not re-entrant across our batch state)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

from clawrl.engine.cpu.sampling import token_logprobs

# Positions whose full-vocabulary log-softmax is computed at once for prompt log-probs
# (a [chunk, V] float tensor: 512 x 49152 x 4 B ~ 100 MB).
PROMPT_LOGPROB_CHUNK = 512

TopLogprobs = list[tuple[float, int]]


class CheckpointError(ValueError):
    """A checkpoint that cannot replace the running weights (bad path, names or shapes)."""


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
class PrefillResult:
    """last_logits: [B, V] at each prompt's last token; hidden: [B, T, H] (left-padded)."""

    last_logits: torch.Tensor
    hidden: torch.Tensor
    kv: KvBatch


class ModelRunner:
    """A causal LM loaded from a Hugging Face directory (safetensors)."""

    def __init__(self, model_dir: Path, dtype: str = "float32"):
        self.model_dir = Path(model_dir)
        self.dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype)
        model.eval()
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

    # ----- forward passes -------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> PrefillResult:
        """One forward pass over left-padded prompts, starting a fresh KV cache."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        out = self.decoder(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        hidden = out.last_hidden_state
        return PrefillResult(self.lm_head(hidden[:, -1]).float(), hidden, KvBatch(out.cache, mask))

    def decode(self, kv: KvBatch, token_ids: torch.Tensor) -> torch.Tensor:
        """Append one token per row and return the next-token logits. token_ids: [B] -> [B, V]."""
        positions = kv.mask.sum(dim=-1, keepdim=True)
        mask = torch.cat([kv.mask, torch.ones(kv.size, 1, dtype=kv.mask.dtype)], dim=-1)
        out = self.decoder(
            input_ids=token_ids.unsqueeze(-1),
            attention_mask=mask,
            position_ids=positions,
            cache=kv.cache,
            use_cache=True,
        )
        kv.mask = mask
        return self.lm_head(out.last_hidden_state[:, -1]).float()

    def prompt_logprobs(
        self, hidden: torch.Tensor, prompt: list[int], start: int, top_n: int
    ) -> tuple[list[float | None], list[TopLogprobs | None]]:
        """Log-probs of prompt[start:] under the model, each given everything before it; the
        first token of the sequence has none (None), as in SGLang.

        hidden: [L, H] for this prompt's L real positions.
        """
        logps: list[float | None] = []
        tops: list[TopLogprobs | None] = []
        if start == 0:
            logps.append(None)
            tops.append(None)
            start = 1
        targets = torch.tensor(prompt, dtype=torch.long)
        for lo in range(start, len(prompt), PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, len(prompt))
            logits = self.lm_head(hidden[lo - 1 : hi - 1])
            logp, top_vals, top_ids = token_logprobs(logits, targets[lo:hi], top_n)
            logps.extend(logp.tolist())
            tops.extend(_tops(top_vals, top_ids, hi - lo))
        return logps, tops

    # ----- weights ------------------------------------------------------------------------

    def check_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise CheckpointError unless `tensors` names exactly this model's weights (tied
        aliases may be left out) with the same shapes. Reads nothing the decode loop writes."""
        unknown = sorted(set(tensors) - set(self.shapes))
        missing = sorted(set(self.shapes) - set(tensors) - self._aliases)
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
