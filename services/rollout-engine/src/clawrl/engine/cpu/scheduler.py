"""Iteration-level (continuous) batching on one model thread, with a prefix cache and chunked
prefill.

Each turn of the loop: run queued control commands, drop aborted sequences, admit waiting
requests (their longest cached prefix comes from the prefix cache), prefill at most
`chunked_prefill_size` prompt tokens (`solo_prefill_size` while nothing decodes), then one
decode step for every running sequence at once. A long prompt is thus prefilled a chunk per
turn while the running batch keeps decoding, and a sequence joins the batch when its whole
prompt is in its KV.

Weight swaps follow SGLang: a swap waits until no request is running (new ones wait in the
queue meanwhile), so every token of a sequence comes from one version; when generation is
paused, the running requests are retracted instead (their KV dropped) and re-prefilled with
the new weights on resume. A request reports the version that produced its tokens.

LoRA: each sequence runs through its own adapter (or the base model) inside one mixed batch;
which adapters a batch can hold and which are resident is `LoraSlots`'s (see lora_slots.py).
Adapters are added and removed between two steps (`add_adapter`, `remove_adapter`).

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

from clawrl.engine.cpu.adapters import PreparedAdapter
from clawrl.engine.cpu.lora_slots import LoraSlots
from clawrl.engine.cpu.prefix_cache import LayerKV, PrefixCache
from clawrl.engine.cpu.runner import KvBatch, ModelRunner, layer_kv, merge_kv, select_kv
from clawrl.engine.cpu.sampling import sample_next_tokens, sampled_logprobs
from clawrl.engine.cpu.sequence import Decode, Emit, Sequence
from clawrl.engine.generation import (
    GenerationRequest,
    GenerationUpdate,
    abort_reason,
    length_reason,
)
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import EngineServerSettings

log = logging.getLogger(__name__)

# How long the idle loop sleeps before looking again (a submit wakes it at once).
IDLE_WAIT_S = 0.5
# Window over which sglang:gen_throughput is measured.
THROUGHPUT_WINDOW_S = 2.0


class QueueFullError(RuntimeError):
    """No room in the waiting queue."""


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
        self.lora = LoraSlots(runner, settings, metrics)
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
        self.lora.add(key, adapter, pinned, name)
        self._update_gauges()

    @property
    def resident_adapters(self) -> list[str]:
        """Keys of the injected adapters, first to be evicted first."""
        return self.lora.resident.keys()

    def remove_adapter(self, key: str) -> None:
        """Delete an adapter and its cached KV (run through `call`). Its requests have ended
        (the registry waited for them); an aborted one may still sit in the batch until this
        step drops it, so drop it first."""
        start = time.perf_counter()
        self._drop_aborted()
        self.lora.remove(key)
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
        room for their adapter (see lora_slots.py)."""
        s = self.settings
        used = self._kv_in_use()
        round_tokens = 0
        busy = self._running + self._prefilling
        adapters = {seq.adapter for seq in busy}
        self.lora.resident.touch(adapters)
        held_back: list[Sequence] = []  # no room for their adapter now
        inject: tuple[Sequence, str | None] | None = None  # (request, adapter to evict)
        with self._lock:
            self.lora.update_draining(busy, adapters, self._waiting)
            while self._waiting and self.num_running < s.max_running_requests:
                seq = self._waiting.popleft()
                if seq.aborted:
                    self._count_abort(seq)
                    continue
                key = seq.adapter
                full = key not in adapters and len(adapters) >= s.max_loras_per_batch
                if full or key in self.lora.draining:
                    self.lora.wait_for_slot(seq, held_back)
                    continue
                need = len(seq.feed) + 1
                alone = not self._running and not self._prefilling
                fits = used + need <= s.max_total_tokens and (
                    round_tokens == 0 or round_tokens + need <= s.max_prefill_tokens
                )
                if not (fits or alone):
                    self._waiting.appendleft(seq)
                    break
                resident = self.lora.resident
                if key is not None and key not in resident:
                    victim = resident.victim(adapters) if resident.full else None
                    if resident.full and victim is None:  # every slot busy or pinned
                        self.lora.wait_for_slot(seq, held_back)
                        continue
                    inject = (seq, victim)  # slow: done below, outside the lock
                    break
                used += need
                round_tokens += need
                adapters.add(key)
                self._admitted(seq)
            self._waiting.extendleft(reversed(held_back))
        if inject is not None and self.lora.make_resident(*inject):
            self._admitted(inject[0])

    def _admitted(self, seq: Sequence) -> None:
        self.lora.admitted(seq)
        self._start_prefill(seq)

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
        """Prefill up to chunked_prefill_size tokens of the prefilling sequences, in order;
        up to solo_prefill_size while no sequence decodes (no stream to keep responsive: a
        larger pass reads the weights fewer times)."""
        budget = self.settings.chunked_prefill_size
        if not self._running:
            budget = max(budget, self.settings.solo_prefill_size or 0)
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
                    seq.add_input_logprobs(result.hidden, self.runner.logprobs_of)
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

    def _prefilled(self, seq: Sequence, last_logits: torch.Tensor) -> None:
        """A sequence's whole prompt is in its KV: cache it, sample its first token, and join
        the running batch."""
        prefix = layer_kv(seq.cache)
        self._cache_insert(seq.feed, prefix, seq.adapter)
        if seq.request.max_new_tokens == 0:  # prompt log-probs only (the teacher path)
            update = seq.first_update()
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
        top_n = [seq.request.top_logprobs_num for seq in seqs]
        logps, tops = sampled_logprobs(logits, next_ids, want, top_n)
        kept: list[int] = []
        ids = next_ids.tolist()
        self.metrics.generation_tokens.inc(len(ids))
        self._window_tokens += len(ids)
        for i, seq in enumerate(seqs):
            if seq.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - seq.arrived)
            else:
                self.metrics.inter_token_latency.observe(now - seq.last_token_at)
            seq.last_token_at = now
            update = seq.append(ids[i], logps.get(i), tops.get(i))
            if update.finish is not None:
                self._cache_insert(*kv_of(i), seq.adapter)
                self._finish(seq, update)
            else:
                seq.emit(update)
                kept.append(i)
        return kept

    def _cache_insert(self, ids: list[int], kv: LayerKV, adapter: str | None) -> None:
        # Never under an adapter already unloaded (an aborted request's last chunks).
        if self.prefix_cache is not None and ids and self.lora.known(adapter):
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
        m.lora_resident.set(len(self.lora.resident))
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
