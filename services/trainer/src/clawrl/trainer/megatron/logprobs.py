"""Per-token log-probs, entropy and top-K log-probs from vocab-parallel logits (each TP rank holds
a contiguous slice of the vocabulary); every rank gets the same full-softmax values."""

from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Padding rows of this rank's vocab slice set to -inf: logits [..., v/tp] -> same."""
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
    copy; its all-reduces run over the TP group.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_rank).clone(
        memory_format=torch.contiguous_format
    )
    return -vocab_parallel_cross_entropy(logits, targets)


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _tp_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP ranks: all-reduce forward, identity backward (each rank's slice gets the
    gradient of the replicated result), so gradients through it are exact."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return x if _tp_group() is None else reduce_from_tensor_model_parallel_region(x)


def _shifted_and_log_norm(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z [..., v/tp] -> (z - global max [..., v/tp], log sum exp(z - global max) [...])."""
    z_max = z.detach().max(dim=-1, keepdim=True).values
    group = _tp_group()
    if group is not None:
        torch.distributed.all_reduce(z_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - z_max
    return shifted, _tp_sum(shifted.exp().sum(dim=-1)).log()


def token_entropy(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Entropy of the full softmax: logits [b, s, v/tp] -> [b, s]; H = log Z - sum_v p_v z_v."""
    z = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    shifted, log_norm = _shifted_and_log_norm(z)
    p = (shifted - log_norm.unsqueeze(-1)).exp()
    # p == 0 exactly on padding rows, where shifted is -inf: 0 * -inf must count as 0.
    expected = _tp_sum(torch.where(p > 0, p * shifted, torch.zeros_like(p)).sum(dim=-1))
    return log_norm - expected


def logprobs_at(
    logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, tp_rank: int
) -> torch.Tensor:
    """log p(id) for several ids per position: logits [b, s, v/tp], ids [b, s, K] -> [b, s, K].
    Each id's logit lives on exactly one rank; the others contribute 0 to the TP sum."""
    z = mask_padded_vocab(logits.float(), vocab_size, tp_rank)
    shifted, log_norm = _shifted_and_log_norm(z)
    local = z.shape[-1]
    offset = ids - tp_rank * local
    mine = (offset >= 0) & (offset < local)
    picked = shifted.gather(-1, offset.clamp(0, local - 1))
    picked = _tp_sum(torch.where(mine, picked, torch.zeros_like(picked)))
    return picked - log_norm.unsqueeze(-1)
