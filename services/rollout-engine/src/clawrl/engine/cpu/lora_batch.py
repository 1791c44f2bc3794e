"""Mixed-adapter LoRA for a batch in two matrix products per projection, whatever the adapters.

peft's mixed-batch inference (`adapter_names=`) loops over the adapters of a batch in every
LoRA projection (select the rows, A, B, scale, add back: ~8 small ops an adapter) and registers
and removes a forward hook on every projection per pass; on SmolLM2-135M (210 projections) with
4 adapters over 8 decode rows that cost more than the base model's own step. Here each
projection keeps its adapters stacked: A of every adapter as one [in, R] matrix (A^T) and B as
one [R, out] matrix (B^T), R the sum of their ranks, an adapter's ranks side by side. A
pass multiplies every row by A, scales the columns of the row's own adapter by its scaling and
zeroes the others (a [rows, R] mask built once per pass), and multiplies by B: each row gets
exactly its own adapter's s x A^T B^T (the other columns add exact zeros), base rows nothing.
The stacks are float32 whatever the base dtype (small products are much cheaper in float32 on
CPU: ~2 us against ~20 us of oneDNN's fixed cost in bfloat16, and more exact), rebuilt when the
set of adapters or their tensors change.

A decode step streams every weight it uses from memory once, and so do these products: 4
rank-16 adapters on all seven projections are 14 % of SmolLM2-135M's parameters, 29 % of its
bytes in bfloat16 once stacked in float32 (a step of 8 rows over all 4 costs ~30 % more CPU
than the bare model's; storing the stacks in bfloat16 and widening them per product, or one
A product shared by q/k/v, did not measure better). So a pass reads only the ranks between the
first and the last adapter its rows use: one stream, or a batch under one adapter, reads that
adapter alone, however many are loaded (SmolLM2-135M bf16, 4 loaded, 1 thread: one row +29 %
CPU a step -> +18 %, 8 rows under one adapter +29 % -> +21 %). The scaling rides in the mask.

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
        self._spans: dict[tuple, Span | None] = {}  # stack layout -> this pass's span
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
        self._spans = {}

    def span(self, stack: Stack) -> Span | None:
        """The ranks of `stack` this pass reads and its mask; None when no row uses an adapter
        of the stack (the pass is the base model's there). Projections with the same layout
        share it."""
        if stack.layout in self._spans:
            return self._spans[stack.layout]
        rows = self.rows or []
        used = {name for name in rows if name in stack.ranges}
        span = None
        if used:
            lo = min(stack.ranges[name][0] for name in used)
            hi = max(stack.ranges[name][1] for name in used)
            mask = torch.zeros(len(rows), hi - lo)
            for row, name in enumerate(rows):
                if name in used:
                    start, end = stack.ranges[name]
                    mask[row, start - lo : end - lo] = stack.scaling[name]
            span = Span(lo, hi, mask, stack.b_t.shape[0])
        self._spans[stack.layout] = span
        return span


class Stack:
    """A projection's adapters stacked in float32, contiguous as the products read them (x @ W^T
    through a transposed view is up to twice as slow for these small shapes). layout: the
    adapters' names and ranks (projections with the same layout share a pass's span); ranges:
    name -> its ranks; a_t: [in, R]; b_t: [R, out]; scaling: name -> peft's scaling."""

    def __init__(self, module) -> None:
        names = sorted(module.lora_A.keys())
        self.ranges: dict[str, tuple[int, int]] = {}
        self.scaling = {name: float(module.scaling[name]) for name in names}
        start = 0
        for name in names:
            rank = module.lora_A[name].weight.shape[0]
            self.ranges[name] = (start, start + rank)
            start += rank
        self.layout = tuple((name, *self.ranges[name]) for name in names)
        a = torch.cat([module.lora_A[name].weight.detach().float() for name in names])
        self.a_t = a.t().contiguous()
        b = torch.cat([module.lora_B[name].weight.detach().float() for name in names], dim=1)
        self.b_t = b.t().contiguous()


class Span:
    """The stacked ranks lo:hi a pass reads, and its mask [rows, hi - lo] float32: each row's
    own adapter's ranks hold its scaling, the others zero."""

    def __init__(self, lo: int, hi: int, mask: torch.Tensor, total: int) -> None:
        self.lo, self.hi, self.mask = lo, hi, mask
        self.full = lo == 0 and hi == total  # the whole stacks (no slice to take)


def _stacked_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA Linear's forward under a StackedLora plan: the base layer, plus each row's
    adapter (x: [rows, ..., in])."""
    result = self.base_layer(x, *args, **kwargs)
    plan: StackedLora = self._clawrl_plan
    if plan.rows is None or not self.lora_A:
        return result
    if self._clawrl_stack is None:
        self._clawrl_stack = Stack(self)
    stack: Stack = self._clawrl_stack
    span = plan.span(stack)
    if span is None:
        return result
    a_t = stack.a_t if span.full else stack.a_t[:, span.lo : span.hi]
    b_t = stack.b_t if span.full else stack.b_t[span.lo : span.hi]
    mask = span.mask.view(span.mask.shape[0], *([1] * (x.dim() - 2)), span.mask.shape[1])
    delta = torch.matmul(torch.matmul(x.float(), a_t) * mask, b_t)
    return result + delta.to(result.dtype)
