"""The CPU engine's attention: transformers' SDPA, except for a prefill chunk that follows cached
tokens, which attends in two unmasked passes joined by their log-sum-exps (chunk_attention).

Those passes need the log-sum-exp of each, which public SDPA does not return; the CPU
flash-attention kernel behind it does, but is a private aten op
(`_scaled_dot_product_flash_attention_for_cpu`) whose name or signature a torch release may
change. It is used only once checked at import against public SDPA (`verified_flash_attention`);
a torch without it, or with one that answers otherwise, gets transformers' masked SDPA for those
chunks: the same numbers, ~20% slower at 4k tokens, and a warning in the log."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"


def verified_flash_attention(op: Callable | None) -> Callable | None:
    """`op` (the CPU flash kernel: (q, k, v, is_causal=, scale=) -> (out, lse)) when it gives
    public SDPA's output and the log-sum-exp of the scores on a small causal and a small
    non-causal case; None (and a warning) when it is missing, fails or disagrees."""
    if op is None:
        log.warning("torch has no aten.%s: prefill chunks after cached tokens use masked SDPA",
                    FLASH_OP)  # fmt: skip
        return None
    generator = torch.Generator().manual_seed(0)
    query, key, value = torch.randn(3, 1, 2, 5, 8, generator=generator)
    try:
        for causal in (False, True):
            out, lse = op(query, key, value, is_causal=causal, scale=0.5)
            scores = query @ key.transpose(-1, -2) * 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf)
            expected = F.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                                      scale=0.5)  # fmt: skip
            if not (
                torch.allclose(out, expected, atol=1e-5)
                and torch.allclose(lse.reshape(1, 2, 5), scores.logsumexp(-1), atol=1e-5)
            ):
                raise ValueError("its output or log-sum-exp differs from SDPA's")
    except Exception as exc:  # any failure means: do not use it
        log.warning("aten.%s is unusable (%s): prefill chunks after cached tokens use masked "
                    "SDPA", FLASH_OP, exc)  # fmt: skip
        return None
    return op


# The CPU flash-attention kernel behind SDPA, for its log-sum-exp; None when it did not verify.
_flash_attention = verified_flash_attention(getattr(torch.ops.aten, FLASH_OP, None))


def grouped_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs
):
    """transformers' SDPA attention, except for a prefill chunk after cached tokens (one
    sequence, the causal mask shifted by what is cached): chunk_attention, two passes without
    a mask. Everything else (decode, a first chunk, padded batches) is transformers' own.

    query: [B, H, q, D]; key, value: [B, H_kv, kv, D]; attention_mask: [B, 1, q, kv] bool."""
    batch, _, length, _ = query.shape
    past = key.shape[2] - length
    extras = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if (
        batch == 1
        and length > 1
        and past > 0
        and not dropout
        and not extras
        and query.device.type == "cpu"
        and _flash_attention is not None
        and is_shifted_causal(attention_mask, past)
    ):
        out = chunk_attention(query, key, value, past, scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def is_shifted_causal(mask: torch.Tensor | None, past: int) -> bool:
    """Whether `mask` ([1, 1, q, past + q] bool) lets query i see keys 0..past + i, no more.
    Every layer of a forward pass gets the same mask: it is read once per pass."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1):
        return False
    ref, checked_past, verdict = _last_mask
    if ref() is mask and checked_past == past:
        return verdict
    length = mask.shape[2]
    own = torch.ones(length, length, dtype=torch.bool).tril()
    verdict = (
        mask.shape[3] == past + length
        and bool(mask[0, 0, :, :past].all())
        and torch.equal(mask[0, 0, :, past:], own)
    )
    _last_mask[:] = [weakref.ref(mask), past, verdict]
    return verdict


# The mask is_shifted_causal read last (weakly held), its `past`, and the verdict.
_last_mask: list = [lambda: None, -1, False]


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a chunk of q queries that follow `past` cached tokens: query i sees every
    cached key and the chunk's keys up to its own. Run as two passes that need no mask: against
    the cached keys (each KV head's query heads as one longer query: no copy of the KV per
    query head) and causal within the chunk; joined by their log-sum-exps into the softmax over
    both. SDPA with the [q, past + q] mask instead converts and adds a mask block per key
    block, and the grouped mask is 3x larger again: ~20% slower at 4k tokens.

    query: [1, H, q, D]; key, value: [1, H_kv, past + q, D] -> [1, H, q, D]."""
    _, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    grouped = query.reshape(1, kv_heads, groups * length, dim)
    cached, cached_lse = _flash_attention(
        grouped, key[:, :, :past], value[:, :, :past], scale=scale
    )
    own_keys = key[:, :, past:].repeat_interleave(groups, dim=1)
    own_values = value[:, :, past:].repeat_interleave(groups, dim=1)
    own, own_lse = _flash_attention(query, own_keys, own_values, is_causal=True, scale=scale)
    cached_lse = cached_lse.reshape(1, heads, length, 1)
    own_lse = own_lse.unsqueeze(-1)
    top = torch.maximum(cached_lse, own_lse)
    cached_weight, own_weight = (cached_lse - top).exp(), (own_lse - top).exp()
    out = cached.reshape(1, heads, length, dim) * cached_weight + own * own_weight
    return (out / (cached_weight + own_weight)).to(query.dtype)


# The engine's attention implementation: SDPA's, with chunk_attention for prefill chunks.
ATTENTION = "clawrl_grouped_sdpa"
AttentionInterface.register(ATTENTION, grouped_sdpa)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
