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

A batch under one adapter alone (one stream, or every row of the adapter) still paid that
adapter's products: one stream +13-23 % CPU a token in float32, +18-32 % in bf16
(bench_engines.py, 1 thread, four runs). Such a pass now runs on merged weights instead, W' =
W + s B A (summed in float32, stored in the base dtype), so it costs what the bare model's does
(the same bench in steady state: f32 +1-4 %, bf16 +1-8 %): once one adapter has had
`merge_after` passes in a row to itself (engine.lora_merge_after, 8), its merged copy of every
projection it adapts is built (SmolLM2-135M, all seven projections: 0.15-0.25 s, 202 MiB in
bf16, 405 MiB in float32) and every later pass whose rows all use it runs on that copy. The
build costs about what ~16-25 one-row passes' stacked products do, so a short first request
gains little (32 tokens: f32 +18 %, bf16 +22 %, the merge included); later requests under the
same adapter gain it all. Only one adapter is merged at a time: another takes its place only
after `merge_after` passes in a row of its own, so batches that alternate between adapters (a
prefill under one between decode steps of another) never re-merge. A pass with a base row or
a second adapter runs stacked, never on merged weights. The copy is dropped whenever it could
be stale: a weight update (`invalidate`, from the runner's load_weights), the merged adapter
removed, or its tensors replaced in place under its name (`attach` checks each projection's A
and B by identity against those the copy was built from). Another adapter loaded or unloaded
keeps it, so a version switch (load v2 beside v1, serve v2, unload v1) merges v2 once.

Rows over several adapters stay stacked; the alternatives measured slower (the LoRA products
of one step alone, SmolLM2-135M shapes x 30 layers, 4 rank-16 adapters, 1 thread, CPU ms at 8 /
16 rows): stacked 11.3-11.7 / 12.9-13.3, grouped per adapter (index_select, two products,
index_add) 14.7-15.1 / 16.2-17.5, bmm over per-row gathered A and B 16.4 / 28.5 (the gather
copies an adapter per row), stacks and products in bfloat16 13.8 / 14.0. Nor did fewer small
ops: one float32 copy of a projection input shared by q/k/v and gate/up, and the delta added
in place (a whole bf16 decode step, 8 / 16 rows over 4 adapters, over the bare model's, in one
process: +33-36 % / +38-41 % against +31-33 % / +35-38 %).

peft still injects, replaces and removes adapters; only its forward is replaced."""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clawrl.engine.cpu.one_row import one_row_linear

log = logging.getLogger(__name__)


class StackedLora:
    """The per-pass plan (which adapter each row uses), the stacks of every LoRA projection
    of one peft model, and the merged weights of at most one adapter."""

    def __init__(self, merge_after: int = 0, on_merge_failure: Callable[[], None] | None = None):
        self.rows: list[str | None] | None = None  # peft adapter name per row; None: base
        self._spans: dict[tuple, Span | None] = {}  # stack layout -> this pass's span
        self._modules: list[nn.Module] = []
        # Passes in a row under one adapter alone before its weights are merged; 0: never.
        self.merge_after = merge_after
        self.merged: str | None = None  # the adapter whose merged weights the modules hold
        self.use_merged = False  # this pass runs on them
        self._streak: tuple[str | None, int] = (None, 0)  # adapter alone, passes in a row
        self.on_merge_failure = on_merge_failure  # counts a merge that raised
        self.merges = 0  # how many times weights were merged, and passes run on them
        self.merged_passes = 0

    def attach(self, model: nn.Module) -> None:
        """Take over the forward of every peft LoRA Linear in `model` (again after adapters
        were added, replaced or removed: the stacks are rebuilt at the next pass). The merged
        weights stay only when every projection of the merged adapter still holds the very A
        and B tensors they were built from (another adapter came or went); an adapter replaced
        in place (new tensors under the same name) or removed drops them."""
        from peft.tuners.lora import Linear as LoraLinear

        modules = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if not self._still_merged(modules):
            self.invalidate()
        self._modules = modules
        for module in modules:
            module._clawrl_stack = None
            if self.merged is None:
                module._clawrl_merged = module._clawrl_merged_from = None
            module.forward = types.MethodType(_stacked_forward, module)
            module._clawrl_plan = self

    def _still_merged(self, modules: list[nn.Module]) -> bool:
        name = self.merged
        if name is None:
            return False
        adapted = [m for m in modules if name in m.lora_A]
        return bool(adapted) and all(
            getattr(m, "_clawrl_merged", None) is not None
            and m._clawrl_merged_from[0] is m.lora_A[name].weight
            and m._clawrl_merged_from[1] is m.lora_B[name].weight
            for m in adapted
        )

    def detach(self) -> None:
        """The last adapter left: forget the modules (and free any merged weights)."""
        self.invalidate()
        self._modules = []

    def invalidate(self) -> None:
        """Drop the merged weights: the base weights or an adapter changed (a weight sync, an
        adapter added, replaced or removed). The next merge starts from the new tensors."""
        for module in self._modules:
            module._clawrl_merged = module._clawrl_merged_from = None
        self.merged = None
        self.use_merged = False
        self._streak = (None, 0)

    def plan(self, rows: list[str | None] | None) -> None:
        """Set each row's adapter for the next pass (None when it is done). A pass whose rows
        all use the merged adapter runs on its merged weights; an adapter that had
        `merge_after` passes in a row to itself is merged first (replacing any other)."""
        self.rows = rows
        self._spans = {}
        self.use_merged = False
        if rows is None:
            return
        sole = rows[0] if rows and all(name == rows[0] for name in rows) else None
        last, count = self._streak
        self._streak = (sole, count + 1 if sole == last else 1)
        if sole is None or self.merge_after <= 0:
            return
        if self.merged != sole and self._streak[1] >= self.merge_after:
            self._merge(sole)
        self.use_merged = self.merged == sole
        self.merged_passes += self.use_merged

    @torch.no_grad()
    def _merge(self, name: str) -> None:
        """W + s B A for every projection adapter `name` targets, summed in float32 and stored
        in the base dtype; the previous adapter's merged weights are freed first (one copy of
        the adapted weights at most)."""
        start = time.perf_counter()
        for module in self._modules:
            module._clawrl_merged = module._clawrl_merged_from = None
        self.merged = None
        nbytes = 0
        try:
            for module in self._modules:
                if name not in module.lora_A:
                    continue
                base = module.base_layer.weight
                a, b = module.lora_A[name].weight, module.lora_B[name].weight
                merged = torch.mm(b.float(), a.float()).mul_(float(module.scaling[name]))
                module._clawrl_merged = merged.add_(base).to(base.dtype)
                module._clawrl_merged_from = (a, b)  # what a later attach checks it against
                nbytes += module._clawrl_merged.nbytes
        except (RuntimeError, MemoryError):  # no memory for the copy: keep serving stacked
            log.exception("merging LoRA adapter %s failed; batches under one adapter run on "
                          "the stacked adapters from now on", name)  # fmt: skip
            self.invalidate()
            self.merge_after = 0
            if self.on_merge_failure is not None:
                self.on_merge_failure()
            return
        self.merged = name
        self.merges += 1
        log.info("LoRA adapter %s merged into a copy of its projections' weights (%.0f MiB, "
                 "%.2f s)", name, nbytes / 2**20, time.perf_counter() - start)  # fmt: skip

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
    adapter (x: [rows, ..., in]); or, when every row uses the merged adapter, its merged
    weight (the base layer where that adapter does not reach)."""
    plan: StackedLora = self._clawrl_plan
    if plan.use_merged:
        if plan.merged not in self.lora_A:
            return self.base_layer(x, *args, **kwargs)
        merged = self._clawrl_merged
        if merged.dtype != torch.bfloat16:  # one row is no faster as a product in float32
            return F.linear(x, merged, self.base_layer.bias)
        return one_row_linear(x, merged, self.base_layer.bias)
    result = self.base_layer(x, *args, **kwargs)
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
