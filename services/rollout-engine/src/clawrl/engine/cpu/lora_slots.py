"""The LoRA adapters a scheduler holds: which are loaded, which are injected in the model
(resident, so a batch can use them), and which running adapter drains to make room.

Each sequence runs through its own adapter (or the base model) inside one mixed batch; a batch
holds at most max_loras_per_batch distinct adapters (the base model counting as one), a request
that would exceed it waits while later ones that fit are admitted (as SGLang does). Every loaded
adapter's checked tensors stay in host memory; at most max_loras_per_batch of them are injected
in the model (resident). A request for a loaded but non-resident adapter has it injected when it
is admitted, evicting the least recently used (or first injected) resident adapter that no
running request uses and that is not pinned, as SGLang's LoRA memory pool does; without such a
slot the request waits. One adapter is injected per turn, outside the queue's lock. So that busy
adapters cannot keep the batch full forever, once a request has waited
lora_drain_wait_threshold seconds for a slot, the running adapter with the fewest tokens left
takes no new requests until its running ones end (SGLang's LoRA drainer), and the slot it frees
goes to the oldest waiting request. Everything here runs on the model thread, between two steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from clawrl.engine.cpu.adapters import PreparedAdapter, ResidentSet
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.engine.cpu.sequence import Sequence
from clawrl.engine.generation import GenerationUpdate, abort_reason
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import EngineServerSettings

log = logging.getLogger(__name__)


class LoraSlots:
    """Every loaded adapter's checked tensors by key, at most max_loras_per_batch of them
    resident, and the running adapters draining to make room for a starving one."""

    def __init__(self, runner: ModelRunner, settings: EngineServerSettings, metrics: EngineMetrics):
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.adapters: dict[str, PreparedAdapter] = {}
        self.names: dict[str | None, str] = {None: "(base model)"}  # key -> name, for logs
        self.resident = ResidentSet(settings.max_loras_per_batch, settings.lora_eviction_policy)
        # A running adapter taking no new requests -> the adapter it makes room for.
        self.draining: dict[str | None, str | None] = {}

    def known(self, key: str | None) -> bool:
        """The base model, or an adapter still loaded."""
        return key is None or key in self.adapters

    def add(self, key: str, adapter: PreparedAdapter, pinned: bool, name: str) -> None:
        """Keep a checked adapter in host memory, and inject it now when a slot is free."""
        self.adapters[key] = adapter
        self.names[key] = name or key
        if pinned:
            self.resident.pinned.add(key)
        if not self.resident.full:
            try:
                self.inject(key)
            except BaseException:
                self.forget(key)
                raise

    def remove(self, key: str) -> None:
        """Forget an adapter, and take it out of the model when it is resident."""
        self.forget(key)
        if key in self.resident:
            self.resident.discard(key)
            self.runner.remove_adapter(key)

    def inject(self, key: str) -> None:
        start = time.perf_counter()
        self.runner.add_adapter(key, self.adapters[key])
        self.resident.add(key)
        self.metrics.lora_swap_seconds.labels(op="load").observe(time.perf_counter() - start)

    def forget(self, key: str) -> None:
        self.adapters.pop(key, None)
        self.names.pop(key, None)
        self.resident.pinned.discard(key)
        self.draining.pop(key, None)

    def named(self, keys: Iterable[str | None]) -> list[str]:
        return [self.names.get(key, str(key)) for key in keys]

    def wait_for_slot(self, seq: Sequence, held_back: list[Sequence]) -> None:
        if seq.slot_wait_since is None:
            seq.slot_wait_since = time.perf_counter()
            self.metrics.lora_slot_waits.inc()
            log.info("request %s waits for a slot for LoRA adapter %s (resident: %s; "
                     "draining: %s)", seq.request.rid, self.names.get(seq.adapter),
                     self.named(self.resident.keys()), self.named(self.draining))  # fmt: skip
        held_back.append(seq)

    def admitted(self, seq: Sequence) -> None:
        """`seq` starts now: its wait for a slot (if any) ends and its adapter was just used."""
        if seq.slot_wait_since is not None:
            waited = time.perf_counter() - seq.slot_wait_since
            self.metrics.lora_slot_wait_seconds.observe(waited)
            seq.slot_wait_since = None
        self.resident.touch([seq.adapter])

    def make_resident(self, seq: Sequence, victim: str | None) -> bool:
        """Inject the adapter `seq` needs (in place of `victim`, when the slots are full). On
        failure `seq` is aborted; returns whether it may start."""
        key = seq.adapter
        assert key is not None
        start = time.perf_counter()
        try:
            if victim is None:
                self.inject(key)
            else:
                self.replace(victim, key)
        except Exception:  # peft refused what the checks let through
            log.exception("injecting LoRA adapter %s failed; aborting request %s", key,
                          seq.request.rid)  # fmt: skip
            self.metrics.engine_errors.inc()
            self.metrics.aborted_requests.labels(reason="error").inc()
            seq.emit(GenerationUpdate(finish=abort_reason("engine error loading the adapter")))
            return False
        self.metrics.lora_on_demand_loads.inc()
        log.info("LoRA adapter %s made resident for request %s in %.3f s", self.names.get(key),
                 seq.request.rid, time.perf_counter() - start)  # fmt: skip
        return True

    def replace(self, victim: str, key: str) -> None:
        """Evict `victim` (its tensors stay in host memory, its cached KV stays valid) for
        `key`. An adapter of the victim's shape takes over its injected modules (milliseconds);
        any other is injected anew once the victim is deleted."""
        start = time.perf_counter()
        self.resident.discard(victim)
        self.metrics.lora_evictions.labels(level="resident").inc()
        log.info("evicting LoRA adapter %s to make room for %s", self.names.get(victim),
                 self.names.get(key))  # fmt: skip
        if self.runner.replace_adapter(victim, key, self.adapters[key]):
            self.resident.add(key)
            elapsed = time.perf_counter() - start
            self.metrics.lora_swap_seconds.labels(op="replace").observe(elapsed)
            return
        self.runner.remove_adapter(victim)
        self.metrics.lora_swap_seconds.labels(op="evict").observe(time.perf_counter() - start)
        self.inject(key)

    def update_draining(
        self, busy: list[Sequence], adapters: set[str | None], waiting: Iterable[Sequence]
    ) -> None:
        """Stop new requests for running adapters that must make room for one whose request
        waited past lora_drain_wait_threshold (the batch being full); an adapter drains until
        its last running request ends. Called with the queue's lock held."""
        for key in [k for k in self.draining if k not in adapters]:
            del self.draining[key]
        threshold = self.settings.lora_drain_wait_threshold
        if threshold <= 0 or len(adapters) < self.settings.max_loras_per_batch:
            return
        now = time.perf_counter()
        served = set(self.draining.values())
        starving: list[str | None] = []
        for seq in waiting:  # oldest first
            since = seq.slot_wait_since
            if since is None or now - since <= threshold or seq.adapter in adapters:
                continue
            if seq.adapter not in served and seq.adapter not in starving:
                starving.append(seq.adapter)
        left = tokens_left(busy)
        for key in starving:
            candidates = [k for k in adapters if k not in self.draining]
            if not candidates:
                break
            drained = min(candidates, key=lambda k: left[k])
            self.draining[drained] = key
            self.metrics.lora_drains.inc()
            log.info("draining LoRA adapter %s (%d tokens left) to make room for %s",
                     self.names.get(drained), left[drained], self.names.get(key))  # fmt: skip


def tokens_left(seqs: list[Sequence]) -> dict[str | None, int]:
    """Per adapter, the most tokens one of its sequences may still generate (how long it takes
    to drain)."""
    left: dict[str | None, int] = {}
    for seq in seqs:
        n = seq.request.max_new_tokens - len(seq.output_ids)
        left[seq.adapter] = max(left.get(seq.adapter, 0), n)
    return left
