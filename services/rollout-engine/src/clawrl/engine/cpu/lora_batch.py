"""Mixed-adapter LoRA for a batch in two matrix products per projection, whatever the adapters.

peft's mixed-batch inference (`adapter_names=`) loops over the adapters of a batch in every
LoRA projection (select the rows, A, B, scale, add back: ~8 small ops an adapter) and registers
and removes a forward hook on every projection per pass; on SmolLM2-135M (210 projections) with
4 adapters over 8 decode rows that cost more than the base model's own step. Here each
projection keeps its adapters stacked: A of every adapter as one [R, in] matrix and B (times
the adapter's scaling) as one [out, R] matrix, R the sum of their ranks. A pass multiplies every
row by all of A, zeroes the columns of the adapters the row does not use (a [rows, R] mask built
once per pass), and multiplies by B: each row gets exactly its own adapter's x A^T s B^T (the
other columns add exact zeros), base rows nothing. The stacks are float32 whatever the base
dtype (small products are much cheaper in float32 on CPU, and more exact), rebuilt when the set
of adapters or their tensors change.

peft still injects, replaces and removes adapters; only its forward is replaced."""

from __future__ import annotations

import types

import torch
from torch import nn


class StackedLora:
    """The per-pass plan (which adapter each row uses) and the stacks of every LoRA projection
    of one peft model."""

    def __init__(self) -> None:
        self.rows: list[str | None] | None = None  # peft adapter name per row; None: base
        self._masks: dict[tuple, torch.Tensor | None] = {}  # layout -> [rows, R] for this pass
        self._modules: list[nn.Module] = []

    def attach(self, model: nn.Module) -> None:
        """Take over the forward of every peft LoRA Linear in `model` (again after adapters
        were added, replaced or removed: the stacks are rebuilt at the next pass)."""
        from peft.tuners.lora import Linear as LoraLinear

        self._modules = [m for m in model.modules() if isinstance(m, LoraLinear)]
        for module in self._modules:
            module._clawrl_stack = None
            module.forward = types.MethodType(_stacked_forward, module)
            module._clawrl_plan = self

    def plan(self, rows: list[str | None] | None) -> None:
        """Set each row's adapter for the next pass (None when it is done)."""
        self.rows = rows
        self._masks = {}

    def mask(self, layout: tuple, ranges: dict[str, tuple[int, int]], rank: int):
        """[rows, R] float32 with ones over each row's adapter columns; None when no row uses
        an adapter of this layout (the pass is the base model's there)."""
        if layout in self._masks:
            return self._masks[layout]
        rows = self.rows or []
        mask = None
        if any(name in ranges for name in rows):
            mask = torch.zeros(len(rows), rank)
            for row, name in enumerate(rows):
                if name in ranges:
                    lo, hi = ranges[name]
                    mask[row, lo:hi] = 1.0
        self._masks[layout] = mask
        return mask


def _stack(module) -> tuple:
    """(layout, ranges, A^T [in, R], (sB)^T [R, out]) of a peft LoRA Linear's adapters, float32
    and contiguous as the products read them (x @ W^T through a transposed view is up to twice
    as slow for these small shapes)."""
    names = tuple(sorted(module.lora_A.keys()))
    ranges, a_parts, b_parts, start = {}, [], [], 0
    for name in names:
        a = module.lora_A[name].weight.detach().float()
        b = module.lora_B[name].weight.detach().float() * module.scaling[name]
        ranges[name] = (start, start + a.shape[0])
        start += a.shape[0]
        a_parts.append(a)
        b_parts.append(b)
    a_t = torch.cat(a_parts).t().contiguous()
    b_t = torch.cat(b_parts, dim=1).t().contiguous()
    return names, ranges, a_t, b_t


def _stacked_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA Linear's forward under a StackedLora plan: the base layer, plus each row's
    adapter (x: [rows, ..., in])."""
    result = self.base_layer(x, *args, **kwargs)
    plan: StackedLora = self._clawrl_plan
    if plan.rows is None or not self.lora_A:
        return result
    if self._clawrl_stack is None:
        self._clawrl_stack = _stack(self)
    layout, ranges, a_t, b_t = self._clawrl_stack
    mask = plan.mask(layout, ranges, a_t.shape[1])
    if mask is None:
        return result
    mask = mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
    hidden = torch.matmul(x.float(), a_t) * mask
    return result + torch.matmul(hidden, b_t).to(result.dtype)
