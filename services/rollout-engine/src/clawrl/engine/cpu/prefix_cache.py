"""The prefix cache: KV of token-id prefixes that earlier requests computed, in a radix tree
(SGLang's RadixAttention idea on CPU tensors), evicted least-recently-used under a token budget.

Each edge holds a run of token ids and, per layer, their keys and values ([H_kv, n, D]). A
request that shares a prefix with an earlier one gets that prefix's KV and prefills only the
rest. Only the model thread touches a PrefixCache. Tensors handed out are concatenated copies,
so a running sequence never shares storage with the tree, and eviction never touches a running
request.

KV depends on the weights that computed it, so each LoRA adapter (by its per-load key; None for
the base model) has a tree of its own: the same prompt under two adapters never shares KV, and
an unloaded adapter's tree is dropped whole.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

# Per layer: (keys, values), each [H_kv, n, D] for n tokens.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Node:
    ids: tuple[int, ...]
    kv: LayerKV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0


def slice_kv(kv: LayerKV, start: int, end: int, copy: bool = False) -> LayerKV:
    """Tokens [start, end) of every layer (a view, or its own storage when `copy`)."""
    out = []
    for k, v in kv:
        k, v = k[:, start:end], v[:, start:end]
        out.append((k.clone(), v.clone()) if copy else (k, v))
    return out


def concat_kv(parts: list[LayerKV]) -> LayerKV:
    """The token runs of `parts` one after the other, per layer."""
    return [
        (
            torch.cat([p[layer][0] for p in parts], dim=1),
            torch.cat([p[layer][1] for p in parts], dim=1),
        )
        for layer in range(len(parts[0]))
    ]


class PrefixCache:
    """Radix tree of token-id prefixes and their KV, at most `budget_tokens` tokens."""

    def __init__(self, budget_tokens: int):
        self.budget_tokens = budget_tokens
        self._roots: dict[str | None, _Node] = {}  # by adapter key (None: base model)
        self._clock = itertools.count(1)
        self.tokens = 0

    def _root(self, adapter: str | None) -> _Node:
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node(ids=(), kv=[], parent=None)
        return root

    def match(
        self, ids: list[int], limit: int, adapter: str | None = None
    ) -> tuple[int, LayerKV | None]:
        """The longest prefix of `ids[:limit]` cached under `adapter`: its length and its KV
        (a copy)."""
        node, matched, parts = self._root(adapter), 0, []
        now = next(self._clock)
        while matched < limit:
            child = node.children.get(ids[matched])
            if child is None:
                break
            run = _common_length(child.ids, ids, matched, limit)
            parts.append(slice_kv(child.kv, 0, run) if run < len(child.ids) else child.kv)
            child.last_used = now
            matched += run
            if run < len(child.ids):
                break
            node = child
        if not matched:
            return 0, None
        return matched, concat_kv(parts)

    def insert(self, ids: list[int], kv: LayerKV, adapter: str | None = None) -> int:
        """Keep the KV of `ids` computed under `adapter` (kv covers exactly these tokens); only
        the part not cached yet is copied. Returns how many tokens were added. Evicts to stay
        within the budget."""
        node, at = self._root(adapter), 0
        now = next(self._clock)
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                leaf = _Node(
                    tuple(ids[at:]), slice_kv(kv, at, len(ids), copy=True), node, last_used=now
                )
                node.children[ids[at]] = leaf
                self.tokens += len(leaf.ids)
                self._evict()
                return len(ids) - at
            run = _common_length(child.ids, ids, at, len(ids))
            if run < len(child.ids):
                child = self._split(child, run)
            child.last_used = now
            node, at = child, at + run
        return 0

    def flush(self) -> int:
        """Drop everything; returns the number of tokens dropped."""
        dropped, self.tokens = self.tokens, 0
        self._roots.clear()
        return dropped

    def drop(self, adapter: str | None) -> int:
        """Drop the tree of one adapter; returns the number of tokens dropped."""
        root = self._roots.pop(adapter, None)
        if root is None:
            return 0
        dropped = sum(len(node.ids) for node in _nodes(root))
        self.tokens -= dropped
        return dropped

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s run at `at`; returns the new upper half (its parent's child now). Both
        halves get their own storage so evicting one frees its memory."""
        assert node.parent is not None
        ids, kv = node.ids, node.kv
        upper = _Node(
            ids[:at], slice_kv(kv, 0, at, copy=True), node.parent, last_used=node.last_used
        )
        node.parent.children[ids[0]] = upper
        node.ids, node.kv, node.parent = ids[at:], slice_kv(kv, at, len(ids), copy=True), upper
        upper.children[node.ids[0]] = node
        return upper

    def _evict(self) -> None:
        """Remove least-recently-used leaves until the tree fits its budget (a run just
        inserted is the most recently used, so it goes last)."""
        while self.tokens > self.budget_tokens:
            victim = min(self._leaves(), key=lambda n: n.last_used, default=None)
            if victim is None or victim.parent is None:
                return
            del victim.parent.children[victim.ids[0]]
            self.tokens -= len(victim.ids)

    def _leaves(self):
        for root in self._roots.values():
            for node in _nodes(root):
                if not node.children:
                    yield node


def _nodes(root: _Node):
    """Every node below `root`."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        yield node


def _common_length(run: tuple[int, ...], ids: list[int], start: int, limit: int) -> int:
    """How many of `run`'s ids equal ids[start:limit] from the beginning."""
    n = min(len(run), limit - start)
    i = 0
    while i < n and run[i] == ids[start + i]:
        i += 1
    return i
