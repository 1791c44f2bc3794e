"""Iteration-level (continuous) batching on one model thread.

Each turn of the loop: run queued control commands (weight swaps, pause), drop aborted
sequences, admit waiting requests and prefill them together, then one decode step for every
running sequence at once. New requests therefore join the running batch between decode steps,
and finished ones leave it, without waiting for the batch to drain.

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

from clawrl.engine.cpu.runner import KvBatch, ModelRunner, merge_kv, select_kv
from clawrl.engine.cpu.sampling import sample_next_tokens, token_logprobs
from clawrl.engine.cpu.stops import find_stop_string, token_finish
from clawrl.engine.generation import (
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

    def __init__(self, request: GenerationRequest, emit: Emit, generator: torch.Generator | None):
        self.request = request
        self.emit = emit
        self.generator = generator
        self.output_ids: list[int] = []
        self.aborted: str | None = None
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None

    @property
    def reserved_tokens(self) -> int:
        return len(self.request.input_ids) + self.request.max_new_tokens

    def abort(self, reason: str) -> None:
        self.aborted = reason


class Scheduler:
    """Owns the model thread, the waiting queue and the running batch."""

    def __init__(
        self,
        runner: ModelRunner,
        settings: EngineServerSettings,
        metrics: EngineMetrics,
        decode_text: Decode,
    ):
        self.runner = runner
        self.settings = settings
        self.metrics = metrics
        self.decode_text = decode_text
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        self._stopping = False
        self._paused = False
        self._running: list[Sequence] = []
        self._pending: torch.Tensor | None = None  # [B] last sampled token, not yet in the KV
        self._kv: KvBatch | None = None
        self._default_generator = torch.Generator().manual_seed(settings.random_seed)
        self._max_batch = 0
        self._window_tokens = 0
        self._window_start = time.perf_counter()
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
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: GenerationRequest, emit: Emit) -> Sequence:
        """Queue a request; raises QueueFullError when the queue is at its limit."""
        generator = None
        if request.seed is not None and not request.sampling.greedy:
            generator = torch.Generator().manual_seed(request.seed)
        seq = Sequence(request, emit, generator)
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

    # ----- commands (run on the model thread through `call`) -------------------------------

    def pause(self, mode: str) -> None:
        """`abort` ends every running and waiting request; `in_place`/`retract` freeze them.
        Either way nothing is decoded or admitted until `resume`."""
        self._paused = True
        if mode == "abort":
            self.abort_all("generation paused (mode=abort)", "pause")

    def resume(self) -> None:
        self._paused = False

    # ----- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_num_threads(self.settings.torch_threads or torch.get_num_threads())
        while not self._stopping:
            self._wakeup.clear()
            self._run_commands()
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
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _step(self) -> bool:
        self._drop_aborted()
        admitted = self._admit()
        if admitted:
            try:
                self._prefill(admitted)
            except Exception:
                # A prompt that cannot be prefilled (e.g. out of memory) fails alone; the
                # running batch is untouched and keeps decoding.
                log.exception("prefill of %d requests failed; aborting them", len(admitted))
                self.metrics.engine_errors.inc()
                for seq in admitted:
                    if seq not in self._running:
                        self.metrics.aborted_requests.labels(reason="error").inc()
                        seq.emit(GenerationUpdate(finish=abort_reason("engine error in prefill")))
        if self._running:
            self._decode()
            return True
        return bool(admitted)

    def _admit(self) -> list[Sequence]:
        """Waiting requests that fit: batch slots, the KV budget, the prefill budget."""
        admitted: list[Sequence] = []
        reserved = sum(seq.reserved_tokens for seq in self._running)
        widest = 0
        with self._lock:
            while self._waiting and len(self._running) + len(admitted) < (
                self.settings.max_running_requests
            ):
                seq = self._waiting[0]
                if seq.aborted:
                    self._waiting.popleft()
                    self._count_abort(seq)
                    continue
                width = max(widest, len(seq.request.input_ids))
                fits_kv = reserved + seq.reserved_tokens <= self.settings.max_total_tokens
                fits_prefill = width * (len(admitted) + 1) <= self.settings.max_prefill_tokens
                nothing_else = not self._running and not admitted
                if not nothing_else and not (fits_kv and fits_prefill):
                    break
                self._waiting.popleft()
                admitted.append(seq)
                reserved += seq.reserved_tokens
                widest = width
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> None:
        prompts = [seq.request.input_ids for seq in seqs]
        result = self.runner.prefill(prompts)
        self.metrics.prefill_batch_size.observe(len(seqs))
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        input_lp = [self._input_logprobs(seq, result.hidden[row]) for row, seq in enumerate(seqs)]
        live = [row for row, seq in enumerate(seqs) if seq.request.max_new_tokens > 0]
        for row, seq in enumerate(seqs):
            if seq.request.max_new_tokens == 0:  # prompt log-probs only (the teacher path)
                lps, tops = input_lp[row]
                self._finish(
                    seq,
                    GenerationUpdate(input_logprobs=lps, input_top=tops, finish=length_reason(0)),
                )
        if not live:
            return
        logits = result.last_logits[live]
        new = [seqs[row] for row in live]
        next_ids = self._sample(new, logits)
        kv = select_kv(result.kv, live) if len(live) < len(seqs) else result.kv
        kept = self._emit_tokens(new, logits, next_ids, [input_lp[row] for row in live])
        self._join(new, next_ids, kv, kept)

    def _decode(self) -> None:
        assert self._kv is not None and self._pending is not None
        self.metrics.decode_batch_size.observe(len(self._running))
        if len(self._running) > self._max_batch:
            self._max_batch = len(self._running)
            self.metrics.max_decode_batch_size.set(self._max_batch)
        logits = self.runner.decode(self._kv, self._pending)
        next_ids = self._sample(self._running, logits)
        kept = self._emit_tokens(self._running, logits, next_ids, None)
        self._keep(kept, next_ids)

    # ----- per-step bookkeeping ------------------------------------------------------------

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        generators = [seq.generator or self._default_generator for seq in seqs]
        return sample_next_tokens(logits, [seq.request.sampling for seq in seqs], generators)

    def _input_logprobs(self, seq: Sequence, hidden: torch.Tensor):
        req = seq.request
        if not req.return_logprob or req.logprob_start_len < 0:
            return None, None
        prompt = req.input_ids
        real = hidden[hidden.shape[0] - len(prompt) :]
        return self.runner.prompt_logprobs(
            real, prompt, req.logprob_start_len, req.top_logprobs_num
        )

    def _emit_tokens(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        next_ids: torch.Tensor,
        input_lp: list | None,
    ) -> list[int]:
        """Append each row's new token, tell its request, and return the rows still going."""
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
            finish, stop_text = self._check_finish(seq)
            update = GenerationUpdate(
                new_ids=[token],
                new_logprobs=[logps[i]] if i in logps else [],
                new_top=[tops[i]] if i in tops else [],
                input_logprobs=input_lp[i][0] if input_lp else None,
                input_top=input_lp[i][1] if input_lp else None,
                finish=finish,
                stop_text=stop_text,
            )
            if finish is not None:
                self._finish(seq, update)
            else:
                seq.emit(update)
                kept.append(i)
        return kept

    def _check_finish(self, seq: Sequence):
        req = seq.request
        finish = token_finish(req.stop, seq.output_ids)
        if finish is not None or not req.stop.stop_strings:
            return finish, None
        text = self.decode_text(seq.output_ids, req.skip_special_tokens)
        found = find_stop_string(text, req.stop.stop_strings)
        if found is None:
            return None, None
        matched, at = found
        stop_text = text if req.no_stop_trim else text[:at]
        return {"type": "stop", "matched": matched}, stop_text

    def _finish(self, seq: Sequence, update: GenerationUpdate) -> None:
        self.metrics.num_requests.inc()
        self.metrics.e2e_request_latency.observe(time.perf_counter() - seq.arrived)
        seq.emit(update)

    def _join(self, seqs: list[Sequence], next_ids: torch.Tensor, kv: KvBatch, kept: list[int]):
        """Add freshly prefilled rows (those in `kept`) to the running batch."""
        if not kept:
            return
        if len(kept) < len(seqs):
            kv = select_kv(kv, kept)
        new_pending = next_ids[kept]
        if self._kv is None:
            self._kv, self._pending = kv, new_pending
        else:
            assert self._pending is not None
            self._kv = merge_kv(self._kv, kv)
            self._pending = torch.cat([self._pending, new_pending])
        self._running.extend(seqs[i] for i in kept)

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

    def _count_abort(self, seq: Sequence) -> None:
        self.metrics.aborted_requests.labels(reason=seq.aborted or "client_gone").inc()

    def _abort_running(self, message: str, reason: str) -> None:
        for seq in self._running:
            self.metrics.aborted_requests.labels(reason=reason).inc()
            seq.emit(GenerationUpdate(finish=abort_reason(message)))
        self._running, self._kv, self._pending = [], None, None

    def abort_all(self, message: str, reason: str) -> None:
        self._abort_running(message, reason)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in waiting:
            self.metrics.aborted_requests.labels(reason=reason).inc()
            seq.emit(GenerationUpdate(finish=abort_reason(message)))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.num_running_reqs.set(len(self._running))
        m.num_queue_reqs.set(len(self._waiting))
        used = self._kv.real_tokens() if self._kv is not None else 0
        m.num_used_tokens.set(used)
        m.token_usage.set(used / self.settings.max_total_tokens)
        now = time.perf_counter()
        elapsed = now - self._window_start
        if elapsed >= THROUGHPUT_WINDOW_S:
            m.gen_throughput.set(self._window_tokens / elapsed)
            self._window_tokens, self._window_start = 0, now
