"""Next-token selection and log-probs, as pure functions of logits.

Log-prob semantics: every log-prob the engine reports is of the *raw* model distribution,
`log_softmax(logits)`, before temperature, top-k, top-p and min-p. That is what RL trainers
recompute (`logp` of the policy at temperature 1), and what SGLang reports with
SGLANG_RETURN_ORIGINAL_LOGPROB=1 (SGLang's own default divides by the temperature first; the
two agree at temperature 1).

Masking follows SGLang's torch sampler: top-k, top-p and min-p are all judged on the same
sorted, temperature-scaled probabilities (not renormalised between filters), and the most
likely token is always kept.
"""

from __future__ import annotations

import torch

from clawrl.engine.generation import GREEDY_TEMPERATURE, SamplingRow, TopLogprobs


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k / top-p / min-p set to -inf.

    logits: [B, V]; temperature, top_p, min_p: [B] float; top_k: [B] int (<= 0: off) -> [B, V].
    """
    scaled = logits / temperature.clamp(min=GREEDY_TEMPERATURE).unsqueeze(-1)
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    remove = ranks >= k
    # Mass strictly before a token already reaches top_p -> the token is outside the nucleus.
    remove |= (probs.cumsum(dim=-1) - probs) > top_p.unsqueeze(-1)
    remove |= probs < (min_p.unsqueeze(-1) * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample_next_tokens(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One next token per row: argmax for greedy rows, else a draw from the filtered
    distribution with the row's own generator (so a seeded request is reproducible whatever
    else shares its batch).

    logits: [B, V] raw -> [B] int64.
    """
    next_ids = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if not sampled:
        return next_ids
    index = torch.tensor(sampled)
    sub = logits.index_select(0, index).float()
    sub_rows = [rows[i] for i in sampled]
    if any(row.needs_filter for row in sub_rows):
        scaled = filter_logits(
            sub,
            torch.tensor([r.temperature for r in sub_rows]),
            torch.tensor([r.top_k for r in sub_rows]),
            torch.tensor([r.top_p for r in sub_rows]),
            torch.tensor([r.min_p for r in sub_rows]),
        )
    else:
        scaled = sub / torch.tensor([r.temperature for r in sub_rows]).unsqueeze(-1)
    probs = scaled.softmax(dim=-1)
    for j, i in enumerate(sampled):
        next_ids[i] = torch.multinomial(probs[j], 1, generator=generators[i]).squeeze(0)
    return next_ids


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw log-probs of the chosen tokens, and the top-n (values, ids) if asked.

    logits: [N, V], token_ids: [N] -> logp [N], top values [N, top_n], top ids [N, top_n].
    """
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    if top_n <= 0:
        return logp, None, None
    values, ids = logp_all.topk(top_n, dim=-1)
    return logp, values, ids


def sampled_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, rows: list[int], top_n: list[int]
) -> tuple[dict[int, float], dict[int, TopLogprobs]]:
    """By row, for `rows` only: the raw log-prob of the sampled token, and the row's top
    `top_n[row]` (log-prob, id) alternatives when it asks for any.

    logits: [B, V], next_ids: [B] -> {row: logp}, {row: [(logp, id)] * top_n[row]}.
    """
    logps: dict[int, float] = {}
    tops: dict[int, TopLogprobs] = {}
    if not rows:
        return logps, tops
    index = torch.tensor(rows)
    lp, top_vals, top_ids = token_logprobs(
        logits.index_select(0, index), next_ids.index_select(0, index), max(top_n[i] for i in rows)
    )
    for j, i in enumerate(rows):
        logps[i] = float(lp[j])
        n = top_n[i]
        if n > 0 and top_vals is not None and top_ids is not None:
            tops[i] = list(zip(top_vals[j, :n].tolist(), top_ids[j, :n].tolist(), strict=True))
    return logps, tops
