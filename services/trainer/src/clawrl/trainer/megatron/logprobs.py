"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds a vocab slice)."""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Padding rows of this rank's vocab slice set to -inf: logits [b, s, v/tp] -> same."""
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    keep = torch.arange(start, start + local, device=logits.device) < vocab_size
    return logits.masked_fill(~keep, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_rank: int
) -> torch.Tensor:
    """log p(target) under the full softmax: logits [b, s, v/tp], targets [b, s] -> [b, s].

    Megatron's vocab_parallel_cross_entropy overwrites its (fp32) input in place, so it gets a
    copy; its all-reduces run over the TP group, so every rank gets the same values.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank).clone()
    return -vocab_parallel_cross_entropy(logits, targets)


def token_entropy(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Entropy of the full softmax per position: logits [b, s, v/tp] -> [b, s].

    H = logsumexp(z) - sum_v p_v z_v, with the two vocab sums all-reduced over the TP group
    (Megatron's reduce region: all-reduce forward, identity backward, so gradients are exact).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    z_max = z.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            z_max,
            op=torch.distributed.ReduceOp.MAX,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
    shifted = z - z_max
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))
    log_norm = sum_exp.log()
    p = (shifted - log_norm.unsqueeze(-1)).exp()
    expected = reduce_from_tensor_model_parallel_region(
        torch.where(p > 0, p * shifted, torch.zeros_like(p)).sum(dim=-1)
    )
    return log_norm - expected
