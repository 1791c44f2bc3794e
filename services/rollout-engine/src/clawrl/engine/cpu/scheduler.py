"""Iteration-level (continuous) batching on one model thread, with a prefix cache and chunked
prefill.

Each turn of the loop: run queued control commands, drop aborted sequences, admit waiting
requests (their longest cached prefix comes from the prefix cache), prefill at most
`chunked_prefill_size` prompt tokens, then one decode step for every running sequence at once.
A long prompt is thus prefilled a chunk per turn while the running batch keeps decoding, and
a sequence joins the batch when its whole prompt is in its KV.

Weight swaps follow SGLang: a swap waits until no request is running (new ones wait in the
queue meanwhile), so every token of a sequence comes from one version; when generation is
paused, the running requests are retracted instead (their KV dropped) and re-prefilled with
the new weights on resume. A request reports the version that produced its tokens.

LoRA: each sequence runs through its own adapter (or the base model) inside one mixed batch;
a batch holds at most max_loras_per_batch distinct adapters (the base model counting as one), a
request that would exceed it waits while later ones that fit are admitted (as SGLang does).
Every loaded adapter's checked tensors stay in host memory; at most max_loras_per_batch of them
are injected in the model (resident). A request for a loaded but non-resident adapter has it
injected when it is admitted, evicting the least recently used (or first injected) resident
adapter that no running request uses and that is not pinned, as SGLang's LoRA memory pool
does; without such a slot the request waits. One adapter is injected per turn, outside the
queue's lock. So that busy adapters cannot keep the batch full forever, once a request has
waited lora_drain_wait_threshold seconds for a slot, the running adapter with the fewest tokens
left takes no new requests until its running ones end (SGLang's LoRA drainer), and the slot it
frees goes to the oldest waiting request. Adapters are added and removed between two steps
(`add_adapter`, `remove_adapter`).

The asyncio side never touches torch: it submits requests and commands through thread-safe
queues and receives GenerationUpdates through each sequence's `emit` callback (which hops onto
the event loop with call_soon_threadsafe).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from clawrl.engine.cpu.adapters import PreparedAdapter, ResidentSet
from clawrl.engine.cpu.detokenizer import IncrementalDetokenizer
from clawrl.engine.cpu.prefix_cache import LayerKV, PrefixCache
from clawrl.engine.cpu.runner import KvBatch, ModelRunner, layer_kv, merge_kv, select_kv
from clawrl.engine.cpu.sampling import sample_next_tokens, token_logprobs
from clawrl.engine.cpu.stops import find_stop_string, token_finish
from clawrl.engine.generation import (
    FinishReason,
    GenerationRequest,
    GenerationUpdate,
    abort_reason,
    length_reason,
)
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import EngineServerSettings

log = logging.getLogger(__name__)

Emit = Callable[[GenerationUpdate], None]
Decode = Callable[[list[int], bool], str]

# How long the idle loop sleeps before looking again (a submit wakes it at once).
IDLE_WAIT_S = 0.5
# Window over which sglang:gen_throughput is measured.
THROUGHPUT_WINDOW_S = 2.0


class QueueFullError(RuntimeError):
    """No room in the waiting queue."""


class Sequence:
    """One request inside the scheduler. `aborted` may be set from any thread."""

    def __init__(
        self,
        request: GenerationRequest,
        emit: Emit,
        generator: torch.Generator | None,
        decode: Decode,
    ):
        self.request = request
        self.emit = emit
        self.generator = generator
        self.output_ids: list[int] = []
        self.aborted: str | None = None
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None
        self.detok = IncrementalDetokenizer(decode, request.skip_special_tokens)
        self.text_sent = 0  # characters of detok.text already emitted
        self.stop_scanned = 0  # characters of detok.text already searched for stop strings
        self.weight_version = ""
        self.cached_tokens: int | None = None  # set at the first prefill
        self.adapter = request.lora_id  # LoRA adapter key; None: the base model
        self.slot_wait_since: float | None = None  # when it first waited for an adapter slot
        # Prefill state: the tokens to put in the KV (the prompt, plus the output so far when
        # a retracted sequence comes back), how many are in already, and that KV.
        self.feed: list[int] = list(request.input_ids)
        self.fed = 0
        self.cache: Any = None  # DynamicCache or prefix-cache KV while prefilling
        self.prev_hidden: torch.Tensor | None = None  # [H] of the last fed token
        self.input_logprobs: list[float | None] = []
        self.input_top: list = []
        self.input_sent = False

    @property
    def wants_input_logprobs(self) -> bool:
        req = self.request
        return req.return_logprob and req.logprob_start_len >= 0 and not self.input_sent

    def retract(self) -> None:
        """Drop this sequence's KV; it will be prefilled again with its output so far."""
        self.feed = list(self.request.input_ids) + self.output_ids
        self.fed, self.cache, self.prev_hidden = 0, None, None

    def abort(self, reason: str) -> None:
        self.aborted = reason


class Scheduler:
    """Owns the model thread, the waiting queue, the prefilling and running sequences and the
    prefix cache."""

    def __init__(
        self,
        runner: ModelRunner,
        settings: EngineServerSettings,
        metrics: EngineMetrics,
        decode_text: Decode,
        weight_version: str,
    ):
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.decode_text = decode_text
        self.weight_version = weight_version
        self.prefix_cache = (
            None if settings.disable_radix_cache else PrefixCache(settings.prefix_cache_tokens)
        )
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._stopping = False
        self._paused = False
        self._prefilling: list[Sequence] = []
        self._running: list[Sequence] = []
        self._pending: torch.Tensor | None = None  # [B] last sampled token, not yet in the KV
        self._kv: KvBatch | None = None
        # Weight swaps waiting for the running batch to drain: (load, version, future).
        self._swaps: list[tuple[Callable[[], None], str | None, concurrent.futures.Future]] = []
        self._default_generator = torch.Generator().manual_seed(settings.random_seed)
        self._max_batch = 0
        self._window_tokens = 0
        self._window_start = time.perf_counter()
        self._prompt_total = 0
        self._cached_total = 0
        # Every loaded adapter's checked tensors, by key; at most max_loras_per_batch resident.
        self._adapters: dict[str, PreparedAdapter] = {}
        self._names: dict[str | None, str] = {None: "(base model)"}  # key -> name, for logs
        self._resident = ResidentSet(settings.max_loras_per_batch, settings.lora_eviction_policy)
        # A running adapter taking no new requests -> the adapter it makes room for.
        self._draining: dict[str | None, str | None] = {}
        self._thread = threading.Thread(target=self._loop, name="clawrl-model", daemon=True)

    # ----- called from the asyncio side ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def swapping(self) -> bool:
        """A weight swap is waiting for the running requests to finish."""
        return bool(self._swaps)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: GenerationRequest, emit: Emit) -> Sequence:
        """Queue a request; raises QueueFullError when the queue is at its limit."""
        generator = None
        if request.seed is not None and not request.sampling.greedy:
            generator = torch.Generator().manual_seed(request.seed)
        seq = Sequence(request, emit, generator, self.decode_text)
        with self._lock:
            if len(self._waiting) >= self.settings.max_queued_requests:
                raise QueueFullError(
                    f"{len(self._waiting)} requests already waiting "
                    f"(engine.max_queued_requests={self.settings.max_queued_requests})"
                )
            self._waiting.append(seq)
        self.metrics.num_queue_reqs.set(len(self._waiting))
        self._wakeup.set()
        return seq

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the model thread between two steps; its result comes in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    def swap_weights(
        self, load: Callable[[], None], version: str | None
    ) -> concurrent.futures.Future:
        """Run `load` (copies new weights in) once no request is running, or at once when
        paused (retracting the running requests); then flush the prefix cache and take
        `version`. The future's result is the number of requests retracted."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: self._swaps.append((load, version, future)), None))
        self._wakeup.set()
        return future

    # ----- commands (run on the model thread through `call`) -------------------------------

    def pause(self, mode: str) -> None:
        """`abort` ends every running and waiting request; `retract` drops the running ones'
        KV (they are re-prefilled on resume); `in_place` freezes them. Either way nothing is
        decoded or admitted until `resume`."""
        self._paused = True
        if mode == "abort":
            self.abort_all("generation paused (mode=abort)", "pause")
        elif mode == "retract":
            self._retract_all("pause")

    def resume(self) -> None:
        self._paused = False

    def add_adapter(
        self, key: str, adapter: PreparedAdapter, pinned: bool = False, name: str = ""
    ) -> None:
        """Take a checked adapter (run through `call`: between two steps): kept in host memory,
        and injected now when a slot is free (else when a request needs it)."""
        self._adapters[key] = adapter
        self._names[key] = name or key
        if pinned:
            self._resident.pinned.add(key)
        if not self._resident.full:
            try:
                self._inject(key)
            except BaseException:
                self._forget(key)
                raise
        self._update_gauges()

    @property
    def resident_adapters(self) -> list[str]:
        """Keys of the injected adapters, first to be evicted first."""
        return self._resident.keys()

    def _inject(self, key: str) -> None:
        start = time.perf_counter()
        self.runner.add_adapter(key, self._adapters[key])
        self._resident.add(key)
        self.metrics.lora_swap_seconds.labels(op="load").observe(time.perf_counter() - start)

    def _forget(self, key: str) -> None:
        self._adapters.pop(key, None)
        self._names.pop(key, None)
        self._resident.pinned.discard(key)
        self._draining.pop(key, None)

    def remove_adapter(self, key: str) -> None:
        """Delete an adapter and its cached KV (run through `call`). Its requests have ended
        (the registry waited for them); an aborted one may still sit in the batch until this
        step drops it, so drop it first."""
        start = time.perf_counter()
        self._drop_aborted()
        self._forget(key)
        if key in self._resident:
            self._resident.discard(key)
            self.runner.remove_adapter(key)
        self.metrics.lora_swap_seconds.labels(op="unload").observe(time.perf_counter() - start)
        if self.prefix_cache is not None:
            dropped = self.prefix_cache.drop(key)
            log.info("dropped %d cached tokens of adapter %s", dropped, key)
        self._update_gauges()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run or wait, as in SGLang."""
        if self._running or self._prefilling or self._waiting:
            return False
        if self.prefix_cache is not None:
            dropped = self.prefix_cache.flush()
            log.info("prefix cache flushed (%d tokens)", dropped)
        self._update_gauges()
        return True

    # ----- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self.settings.torch_threads or torch.get_num_threads())
        while not self._stopping:
            self._wakeup.clear()
            self._run_commands()
            self._run_swaps()
            if self._paused:
                self._wakeup.wait(IDLE_WAIT_S)
                continue
            try:
                with torch.inference_mode():
                    worked = self._step()
            except Exception:
                log.exception("forward pass failed; aborting the running batch")
                self.metrics.engine_errors.inc()
                self._abort_running("engine error during the forward pass", "error")
                worked = True
            self._update_gauges()
            if not worked:
                self._wakeup.wait(IDLE_WAIT_S)
        self.abort_all("engine shutting down", "error")

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is None:
                fn()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _run_swaps(self) -> None:
        if not self._swaps:
            return
        retracted = 0
        if self._paused:
            self._retract_all("weight_update")
            # Reported: the requests whose generation continues on the new weights.
            retracted = sum(1 for seq in self._waiting if seq.output_ids)
        elif self._running or self._prefilling:
            return  # wait for them to finish; nothing new is admitted meanwhile
        swaps, self._swaps = self._swaps, []
        for load, version, future in swaps:
            try:
                load()
            except BaseException as exc:
                log.exception("weight swap failed")
                future.set_exception(exc)
                continue
            if self.prefix_cache is not None:
                self.prefix_cache.flush()  # its KV was computed by the old weights
            if version is not None:
                self.weight_version = version
            future.set_result(retracted)

    def _step(self) -> bool:
        self._drop_aborted()
        if not self._swaps:
            self._admit()
        worked = self._prefill_chunk()
        if self._running:
            self._fit_kv_budget()
            self._decode()
            return True
        return worked

    def _kv_in_use(self) -> int:
        """Tokens the running and prefilling sequences hold (or will hold) in KV."""
        running = self._kv.real_tokens() + len(self._running) if self._kv is not None else 0
        return running + sum(len(seq.feed) for seq in self._prefilling)

    def _admit(self) -> None:
        """Waiting requests that fit now: a batch slot, the KV budget by current use (not by
        max_new_tokens: a request that outgrows it later is retracted), the prefill budget, and
        room for their adapter (see the module's docstring)."""
        s = self.settings
        used = self._kv_in_use()
        round_tokens = 0
        busy = self._running + self._prefilling
        adapters = {seq.adapter for seq in busy}
        self._resident.touch(adapters)
        held_back: list[Sequence] = []  # no room for their adapter now
        inject: tuple[Sequence, str | None] | None = None  # (request, adapter to evict)
        with self._lock:
            self._update_draining(busy, adapters)
            while self._waiting and self.num_running < s.max_running_requests:
                seq = self._waiting.popleft()
                if seq.aborted:
                    self._count_abort(seq)
                    continue
                key = seq.adapter
                full = key not in adapters and len(adapters) >= s.max_loras_per_batch
                if full or key in self._draining:
                    self._wait_for_slot(seq, held_back)
                    continue
                need = len(seq.feed) + 1
                alone = not self._running and not self._prefilling
                fits = used + need <= s.max_total_tokens and (
                    round_tokens == 0 or round_tokens + need <= s.max_prefill_tokens
                )
                if not (fits or alone):
                    self._waiting.appendleft(seq)
                    break
                if key is not None and key not in self._resident:
                    victim = self._resident.victim(adapters) if self._resident.full else None
                    if self._resident.full and victim is None:  # every slot busy or pinned
                        self._wait_for_slot(seq, held_back)
                        continue
                    inject = (seq, victim)  # slow: done below, outside the lock
                    break
                used += need
                round_tokens += need
                adapters.add(key)
                self._admitted(seq)
            self._waiting.extendleft(reversed(held_back))
        if inject is not None:
            self._make_resident(*inject)

    def _named(self, keys) -> list[str]:
        return [self._names.get(key, str(key)) for key in keys]

    def _wait_for_slot(self, seq: Sequence, held_back: list[Sequence]) -> None:
        if seq.slot_wait_since is None:
            seq.slot_wait_since = time.perf_counter()
            self.metrics.lora_slot_waits.inc()
            log.info("request %s waits for a slot for LoRA adapter %s (resident: %s; "
                     "draining: %s)", seq.request.rid, self._names.get(seq.adapter),
                     self._named(self._resident.keys()), self._named(self._draining))  # fmt: skip
        held_back.append(seq)

    def _admitted(self, seq: Sequence) -> None:
        if seq.slot_wait_since is not None:
            waited = time.perf_counter() - seq.slot_wait_since
            self.metrics.lora_slot_wait_seconds.observe(waited)
            seq.slot_wait_since = None
        self._resident.touch([seq.adapter])
        self._start_prefill(seq)

    def _make_resident(self, seq: Sequence, victim: str | None) -> None:
        """Inject the adapter `seq` needs (in place of `victim`, when the slots are full), then
        start `seq`."""
        key = seq.adapter
        assert key is not None
        start = time.perf_counter()
        try:
            if victim is None:
                self._inject(key)
            else:
                self._replace(victim, key)
        except Exception:  # peft refused what the checks let through
            log.exception("injecting LoRA adapter %s failed; aborting request %s", key,
                          seq.request.rid)  # fmt: skip
            self.metrics.engine_errors.inc()
            self.metrics.aborted_requests.labels(reason="error").inc()
            seq.emit(GenerationUpdate(finish=abort_reason("engine error loading the adapter")))
            return
        self.metrics.lora_on_demand_loads.inc()
        log.info("LoRA adapter %s made resident for request %s in %.3f s", self._names.get(key),
                 seq.request.rid, time.perf_counter() - start)  # fmt: skip
        self._admitted(seq)

    def _replace(self, victim: str, key: str) -> None:
        """Evict `victim` (its tensors stay in host memory, its cached KV stays valid) for
        `key`. An adapter of the victim's shape takes over its injected modules (milliseconds);
        any other is injected anew once the victim is deleted."""
        start = time.perf_counter()
        self._resident.discard(victim)
        self.metrics.lora_evictions.labels(level="resident").inc()
        log.info("evicting LoRA adapter %s to make room for %s", self._names.get(victim),
                 self._names.get(key))  # fmt: skip
        if self.runner.replace_adapter(victim, key, self._adapters[key]):
            self._resident.add(key)
            elapsed = time.perf_counter() - start
            self.metrics.lora_swap_seconds.labels(op="replace").observe(elapsed)
            return
        self.runner.remove_adapter(victim)
        self.metrics.lora_swap_seconds.labels(op="evict").observe(time.perf_counter() - start)
        self._inject(key)

    def _update_draining(self, busy: list[Sequence], adapters: set[str | None]) -> None:
        """Stop new requests for running adapters that must make room for one whose request
        waited past lora_drain_wait_threshold (the batch being full); an adapter drains until
        its last running request ends. Called with the queue's lock held."""
        for key in [k for k in self._draining if k not in adapters]:
            del self._draining[key]
        threshold = self.settings.lora_drain_wait_threshold
        if threshold <= 0 or len(adapters) < self.settings.max_loras_per_batch:
            return
        now = time.perf_counter()
        served = set(self._draining.values())
        starving: list[str | None] = []
        for seq in self._waiting:  # oldest first
            since = seq.slot_wait_since
            if since is None or now - since <= threshold or seq.adapter in adapters:
                continue
            if seq.adapter not in served and seq.adapter not in starving:
                starving.append(seq.adapter)
        left = tokens_left(busy)
        for key in starving:
            candidates = [k for k in adapters if k not in self._draining]
            if not candidates:
                break
            drained = min(candidates, key=lambda k: left[k])
            self._draining[drained] = key
            self.metrics.lora_drains.inc()
            log.info("draining LoRA adapter %s (%d tokens left) to make room for %s",
                     self._names.get(drained), left[drained], self._names.get(key))  # fmt: skip

    def _start_prefill(self, seq: Sequence) -> None:
        """Take the longest cached prefix (never the last token: its logits are needed, nor
        prompt positions whose log-probs are asked for) and queue the rest for prefill."""
        seq.weight_version = self.weight_version
        limit = len(seq.feed) - 1
        if seq.wants_input_logprobs:
            limit = min(limit, max(seq.request.logprob_start_len - 1, 0))
        matched = 0
        if self.prefix_cache is not None and limit > 0:
            matched, kv = self.prefix_cache.match(seq.feed, limit, seq.adapter)
            if matched:
                seq.cache, seq.fed = kv, matched
        if seq.cached_tokens is None:
            seq.cached_tokens = matched
            self._prompt_total += len(seq.request.input_ids)
            self._cached_total += matched
            self.metrics.prompt_tokens.inc(len(seq.request.input_ids))
            self.metrics.cached_tokens.inc(matched)
        self._prefilling.append(seq)

    def _prefill_chunk(self) -> bool:
        """Prefill up to chunked_prefill_size tokens of the prefilling sequences, in order."""
        budget = self.settings.chunked_prefill_size
        worked = False
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            n = min(budget, len(seq.feed) - seq.fed)
            budget -= n
            worked = True
            try:
                result = self.runner.extend(
                    seq.cache, seq.fed, seq.feed[seq.fed : seq.fed + n], seq.adapter
                )
                if seq.wants_input_logprobs:
                    self._input_logprobs(seq, result.hidden)
            except Exception:
                # A prompt that cannot be prefilled (e.g. out of memory) fails alone; the
                # running batch is untouched and keeps decoding.
                log.exception("prefill of request %s failed; aborting it", seq.request.rid)
                self.metrics.engine_errors.inc()
                self.metrics.aborted_requests.labels(reason="error").inc()
                self._prefilling.remove(seq)
                seq.emit(GenerationUpdate(finish=abort_reason("engine error in prefill")))
                continue
            self.metrics.prefill_chunk_tokens.observe(n)
            seq.cache, seq.fed = result.cache, seq.fed + n
            seq.prev_hidden = result.hidden[-1]
            if seq.fed == len(seq.feed):
                self._prefilling.remove(seq)
                self._prefilled(seq, result.last_logits)
        return worked

    def _input_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Collect the prompt log-probs this chunk (hidden: [n, H], positions fed-n..fed-1 of
        the prompt, not yet counted in seq.fed) makes computable."""
        req = seq.request
        first = seq.fed  # position of hidden[0]
        end = min(first + hidden.shape[0], len(req.input_ids))
        start = max(req.logprob_start_len, first)
        if start == 0:
            seq.input_logprobs.append(None)  # the first token has no log-prob, as in SGLang
            seq.input_top.append(None)
            start = 1
        if start >= end:
            return
        # Target p is predicted by the hidden state at p - 1 (the previous chunk's last one
        # when p is this chunk's first position).
        states = hidden if seq.prev_hidden is None else torch.cat([seq.prev_hidden[None], hidden])
        offset = first if seq.prev_hidden is None else first - 1
        logps, tops = self.runner.logprobs_of(
            states[start - 1 - offset : end - 1 - offset],
            req.input_ids[start:end],
            req.top_logprobs_num,
        )
        seq.input_logprobs.extend(logps)
        seq.input_top.extend(tops)

    def _prefilled(self, seq: Sequence, last_logits: torch.Tensor) -> None:
        """A sequence's whole prompt is in its KV: cache it, sample its first token, and join
        the running batch."""
        prefix = layer_kv(seq.cache)
        self._cache_insert(seq.feed, prefix, seq.adapter)
        if seq.request.max_new_tokens == 0:  # prompt log-probs only (the teacher path)
            update = self._first_update(seq)
            self._finish(seq, GenerationUpdate(**update, finish=length_reason(0)))
            return
        logits = last_logits.unsqueeze(0)
        next_ids = self._sample([seq], logits)
        kept = self._emit_tokens([seq], logits, next_ids, lambda _row: (seq.feed, prefix))
        if kept:
            mask = torch.ones(1, seq.fed, dtype=torch.long)
            kv = KvBatch(seq.cache, mask)
            if self._kv is None:
                self._kv, self._pending = kv, next_ids
            else:
                assert self._pending is not None
                self._kv = merge_kv(self._kv, kv)
                self._pending = torch.cat([self._pending, next_ids])
            self._running.append(seq)
        seq.cache = None

    def _fit_kv_budget(self) -> None:
        """Retract the newest running requests while the batch outgrows max_total_tokens."""
        while len(self._running) > 1 and self._kv_in_use() > self.settings.max_total_tokens:
            seq = self._running[-1]
            assert self._pending is not None
            self._keep(list(range(len(self._running) - 1)), self._pending)
            seq.retract()
            self._waiting.appendleft(seq)
            self.metrics.retracted_requests.labels(reason="kv_budget").inc()
            log.info("retracted request %s: the KV budget is full", seq.request.rid)

    def _retract_all(self, reason: str) -> int:
        """Drop the KV of every running and prefilling request; they go back to the front of
        the queue (in their order) and are prefilled again later. Returns how many."""
        seqs = [s for s in self._running + self._prefilling if not s.aborted]
        for seq in self._running + self._prefilling:
            if seq.aborted:
                self._count_abort(seq)
        self._running, self._prefilling, self._kv, self._pending = [], [], None, None
        for seq in reversed(seqs):
            seq.retract()
            self._waiting.appendleft(seq)
        if seqs:
            self.metrics.retracted_requests.labels(reason=reason).inc(len(seqs))
            log.info("retracted %d requests (%s)", len(seqs), reason)
        return len(seqs)

    def _decode(self) -> None:
        assert self._kv is not None and self._pending is not None
        self.metrics.decode_batch_size.observe(len(self._running))
        if len(self._running) > self._max_batch:
            self._max_batch = len(self._running)
            self.metrics.max_decode_batch_size.set(self._max_batch)
        adapters = [seq.adapter for seq in self._running]
        logits = self.runner.decode(self._kv, self._pending, adapters)
        next_ids = self._sample(self._running, logits)
        kv = self._kv

        def row_kv(row: int) -> tuple[list[int], LayerKV]:
            n = int(kv.mask[row].sum())
            seq = self._running[row]
            return (seq.request.input_ids + seq.output_ids)[:n], layer_kv(kv.cache, row, last=n)

        kept = self._emit_tokens(self._running, logits, next_ids, row_kv)
        self._keep(kept, next_ids)

    # ----- per-step bookkeeping ------------------------------------------------------------

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        generators = [seq.generator or self._default_generator for seq in seqs]
        return sample_next_tokens(logits, [seq.request.sampling for seq in seqs], generators)

    def _first_update(self, seq: Sequence) -> dict:
        """Fields only the first update of a request carries."""
        if seq.input_sent:
            return {}
        seq.input_sent = True
        fields: dict[str, Any] = {"cached_tokens": seq.cached_tokens}
        if seq.request.return_logprob and seq.request.logprob_start_len >= 0:
            fields.update(input_logprobs=seq.input_logprobs, input_top=seq.input_top)
        return fields

    def _emit_tokens(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        next_ids: torch.Tensor,
        kv_of: Callable[[int], tuple[list[int], LayerKV]],
    ) -> list[int]:
        """Append each row's new token, tell its request, and return the rows still going.
        `kv_of(row)` gives a finishing row's ids and KV for the prefix cache."""
        now = time.perf_counter()
        want = [i for i, seq in enumerate(seqs) if seq.request.return_logprob]
        logps: dict[int, float] = {}
        tops: dict[int, list] = {}
        if want:
            top_n = max(seqs[i].request.top_logprobs_num for i in want)
            index = torch.tensor(want)
            lp, top_vals, top_ids = token_logprobs(
                logits.index_select(0, index), next_ids.index_select(0, index), top_n
            )
            for j, i in enumerate(want):
                logps[i] = float(lp[j])
                n = seqs[i].request.top_logprobs_num
                if n > 0 and top_vals is not None and top_ids is not None:
                    tops[i] = list(
                        zip(top_vals[j, :n].tolist(), top_ids[j, :n].tolist(), strict=True)
                    )
        kept: list[int] = []
        ids = next_ids.tolist()
        self.metrics.generation_tokens.inc(len(ids))
        self._window_tokens += len(ids)
        for i, seq in enumerate(seqs):
            token = ids[i]
            seq.output_ids.append(token)
            if seq.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - seq.arrived)
            else:
                self.metrics.inter_token_latency.observe(now - seq.last_token_at)
            seq.last_token_at = now
            finish = token_finish(seq.request.stop, seq.output_ids)
            new_text, finish = self._new_text(seq, token, finish)
            update = GenerationUpdate(
                new_ids=[token],
                new_text=new_text,
                new_logprobs=[logps[i]] if i in logps else [],
                new_top=[tops[i]] if i in tops else [],
                finish=finish,
                weight_version=seq.weight_version,
                **self._first_update(seq),
            )
            if finish is not None:
                self._cache_insert(*kv_of(i), seq.adapter)
                self._finish(seq, update)
            else:
                seq.emit(update)
                kept.append(i)
        return kept

    def _new_text(
        self, seq: Sequence, token: int, finish: FinishReason | None
    ) -> tuple[str, FinishReason | None]:
        """The text `token` adds, and the finish reason once a stop string shows up. A matched
        stop token is not text (unless no_stop_trim); while stop strings may still match, their
        possible beginnings are held back so streamed text never has to be taken back."""
        req = seq.request
        matched_token = finish is not None and isinstance(finish.get("matched"), int)
        if not (matched_token and not req.no_stop_trim):
            seq.detok.push([token])
        if finish is not None:
            seq.detok.flush()
        text = seq.detok.text
        end = len(text)
        stops = req.stop.stop_strings
        if stops and finish is None:
            longest = max(len(s) for s in stops)
            window = max(0, seq.stop_scanned - longest + 1)
            found = find_stop_string(text[window:], stops)
            seq.stop_scanned = len(text)
            if found is not None:
                matched, at = found
                finish = {"type": "stop", "matched": matched}
                if req.no_stop_trim:
                    seq.detok.flush()
                    text, end = seq.detok.text, len(seq.detok.text)
                else:
                    end = window + at
            else:
                end = len(text) - (longest - 1)
        new = text[seq.text_sent : end] if end > seq.text_sent else ""
        seq.text_sent = max(seq.text_sent, end)
        return new, finish

    def _cache_insert(self, ids: list[int], kv: LayerKV, adapter: str | None) -> None:
        # Never under an adapter already unloaded (an aborted request's last chunks).
        known = adapter is None or adapter in self._adapters
        if self.prefix_cache is not None and ids and known:
            self.prefix_cache.insert(ids, kv, adapter)

    def _finish(self, seq: Sequence, update: GenerationUpdate) -> None:
        self.metrics.num_requests.inc()
        self.metrics.e2e_request_latency.observe(time.perf_counter() - seq.arrived)
        seq.emit(update)

    def _keep(self, kept: list[int], next_ids: torch.Tensor) -> None:
        """Keep only rows `kept` of the running batch, with their new pending tokens."""
        if not kept:
            self._running, self._kv, self._pending = [], None, None
            return
        if len(kept) < len(self._running):
            assert self._kv is not None
            self._kv = select_kv(self._kv, kept)
            self._running = [self._running[i] for i in kept]
        self._pending = next_ids[kept]

    def _drop_aborted(self) -> None:
        for seq in [s for s in self._prefilling if s.aborted]:
            self._prefilling.remove(seq)
            self._keep_prefilled_part(seq)
            self._count_abort(seq)
        if not any(seq.aborted for seq in self._running):
            return
        kept = []
        for i, seq in enumerate(self._running):
            if seq.aborted:
                self._count_abort(seq)
            else:
                kept.append(i)
        assert self._pending is not None
        self._keep(kept, self._pending)

    def _keep_prefilled_part(self, seq: Sequence) -> None:
        """The chunks of an abandoned prompt go to the prefix cache (as SGLang caches chunked
        prefills), so a client that gives up and retries (OpenAI clients retry after a timeout:
        a cold 13k-token prompt can outlast one on CPU) resumes the prefill instead of
        starting over."""
        if isinstance(seq.cache, DynamicCache) and seq.fed > 0:
            self._cache_insert(seq.feed[: seq.fed], layer_kv(seq.cache), seq.adapter)

    def _count_abort(self, seq: Sequence) -> None:
        self.metrics.aborted_requests.labels(reason=seq.aborted or "client_gone").inc()

    def _abort_running(self, message: str, reason: str) -> None:
        for seq in self._running + self._prefilling:
            self.metrics.aborted_requests.labels(reason=reason).inc()
            seq.emit(GenerationUpdate(finish=abort_reason(message)))
        self._running, self._prefilling, self._kv, self._pending = [], [], None, None

    def abort_all(self, message: str, reason: str) -> None:
        self._abort_running(message, reason)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in waiting:
            self.metrics.aborted_requests.labels(reason=reason).inc()
            seq.emit(GenerationUpdate(finish=abort_reason(message)))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.lora_resident.set(len(self._resident))
        m.num_running_reqs.set(self.num_running)
        m.num_queue_reqs.set(len(self._waiting))
        used = self._kv_in_use()
        m.num_used_tokens.set(used)
        m.token_usage.set(used / self.settings.max_total_tokens)
        if self.prefix_cache is not None:
            m.prefix_cache_tokens.set(self.prefix_cache.tokens)
        if self._prompt_total:
            m.cache_hit_rate.set(self._cached_total / self._prompt_total)
        now = time.perf_counter()
        elapsed = now - self._window_start
        if elapsed >= THROUGHPUT_WINDOW_S:
            m.gen_throughput.set(self._window_tokens / elapsed)
            self._window_tokens, self._window_start = 0, now


def tokens_left(seqs: list[Sequence]) -> dict[str | None, int]:
    """Per adapter, the most tokens one of its sequences may still generate (how long it takes
    to drain)."""
    left: dict[str | None, int] = {}
    for seq in seqs:
        n = seq.request.max_new_tokens - len(seq.output_ids)
        left[seq.adapter] = max(left.get(seq.adapter, 0), n)
    return left
