"""The CPU engine as the asyncio side sees it: load the model, submit generations and stream
their state, swap weights, pause and resume. Torch work happens on the scheduler's thread or
in worker threads, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from clawrl.common.models import context_length, resolve_model_dir
from clawrl.common.process_groups import join_group, receive_broadcast
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import CheckpointError, ModelRunner, read_checkpoint
from clawrl.engine.cpu.scheduler import Scheduler, Sequence
from clawrl.engine.generation import GenerationRequest, GenerationState, GenerationUpdate
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import EngineSettings

log = logging.getLogger(__name__)

LOAD_FORMATS = (None, "auto", "safetensors")


@dataclass(frozen=True)
class UpdateResult:
    """Reply of /update_weights_from_disk, /init_weights_update_group and
    /update_weights_from_distributed."""

    success: bool
    message: str
    num_paused_requests: int = 0


class CpuEngine:
    """One model served with iteration-level batching. Build with `await CpuEngine.load(...)`."""

    def __init__(self, settings: EngineSettings, metrics: EngineMetrics):
        self.settings = settings
        self.metrics = metrics
        self.model_dir = resolve_model_dir(settings.model)
        self.context_length = context_length(settings.model, self.model_dir)
        self._token_texts: dict[int, str] = {}
        self._update_lock = asyncio.Lock()
        self._groups: dict[str, object] = {}  # weight update groups joined, by name
        self.tokenizer = None
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None

    @classmethod
    async def load(cls, settings: EngineSettings, metrics: EngineMetrics) -> CpuEngine:
        engine = cls(settings, metrics)
        await asyncio.to_thread(engine._load)
        assert engine.scheduler is not None
        engine.scheduler.start()
        return engine

    def _load(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        serving = self.settings.engine
        self.runner = ModelRunner(
            self.model_dir, serving.dtype, self.context_length, self.settings.model.rope_scaling
        )
        if self.runner.long_context:
            log.warning("LONG CONTEXT: %s", self.runner.long_context)
        self.scheduler = Scheduler(
            self.runner, serving, self.metrics, self.decode, serving.weight_version
        )
        log.info(
            "loaded %s (vocab %d, context %d)",
            self.model_dir,
            self.runner.vocab_size,
            self.context_length,
        )

    async def close(self) -> None:
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)

    # ----- model facts ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        assert self.runner is not None
        return self.runner.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's eos and the generation config's (SGLang stops on both)."""
        assert self.runner is not None and self.tokenizer is not None
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            self.runner.model.generation_config.eos_token_id,
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, as log-prob entries show it (decoded once per id)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], False)
        return text

    @property
    def weight_version(self) -> str:
        """The version of the weights new requests are served with."""
        assert self.scheduler is not None
        return self.scheduler.weight_version

    @property
    def paused(self) -> bool:
        """Paused, or holding new requests back until a weight swap is done."""
        return self.scheduler is not None and (self.scheduler.paused or self.scheduler.swapping)

    # ----- generation ----------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationState]:
        """Queue `request` now (raising QueueFullError when the queue is full) and return an
        iterator of its state after each batch of updates, ending with the finished state.
        Closing the iterator early (client gone) aborts the request in the scheduler."""
        assert self.scheduler is not None
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[GenerationUpdate] = asyncio.Queue()

        def emit(update: GenerationUpdate) -> None:
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        seq = self.scheduler.submit(request, emit)
        return self._follow(seq, updates, GenerationState(request))

    @staticmethod
    async def _follow(
        seq: Sequence, updates: asyncio.Queue[GenerationUpdate], state: GenerationState
    ) -> AsyncIterator[GenerationState]:
        try:
            while not state.finished:
                state.apply(await updates.get())
                while not updates.empty():  # coalesce: the yielded fields are cumulative
                    state.apply(updates.get_nowait())
                yield state
        finally:
            if not state.finished:
                seq.abort("client_gone")

    async def generate_once(self, request: GenerationRequest) -> GenerationState:
        """Run a request to its end and return the finished state."""
        last = None
        async with contextlib.aclosing(self.generate(request)) as states:
            async for state in states:
                last = state
        assert last is not None
        return last

    # ----- weights and control -------------------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, load_format: str | None = None
    ) -> UpdateResult:
        """Read and check the checkpoint in a worker thread, then swap it in on the model thread
        once the running requests have finished (or at once, retracting them, when generation
        is paused). Any failure leaves the old weights serving."""
        assert self.runner is not None and self.scheduler is not None
        if load_format not in LOAD_FORMATS:
            return self._update_failed(
                f"load_format {load_format!r} is not supported (safetensors)"
            )
        async with self._update_lock:
            try:
                path = self._checkpoint_path(model_path)
                tensors = await asyncio.to_thread(read_checkpoint, path)
                await asyncio.to_thread(self.runner.check_checkpoint, tensors)
            except CheckpointError as exc:
                return self._update_failed(f"cannot load weights from {model_path}: {exc}")
            num_paused = await self._swap_in(tensors, weight_version)
        log.info("weights updated from %s (weight_version=%s)", path, self.weight_version)
        return UpdateResult(
            True, f"Succeeded to update model weights from {path}.", num_paused_requests=num_paused
        )

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> UpdateResult:  # fmt: skip
        """Join the trainer's broadcast group (SGLang's NCCL path, here over gloo) as rank
        `rank_offset`; returns once every rank has joined."""
        if backend != "gloo":
            return self._update_failed(f"backend {backend!r}: the CPU engine receives over gloo")
        if group_name in self._groups:
            return self._update_failed(f"weight update group {group_name!r} already joined")
        try:
            self._groups[group_name] = await asyncio.to_thread(
                join_group, backend, master_address, master_port, rank_offset, world_size,
                group_name, self.settings.engine.weight_group_timeout_s,
            )  # fmt: skip
        except Exception as exc:  # rendezvous timeout, refused connection
            return self._update_failed(f"cannot join weight update group {group_name}: {exc}")
        log.info("joined weight update group %s as rank %d of %d", group_name, rank_offset,
                 world_size)  # fmt: skip
        return UpdateResult(True, f"Joined weight update group {group_name}.")

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None = None,
    ) -> UpdateResult:  # fmt: skip
        """Receive the next tensors rank 0 broadcasts, check them against the model, and swap
        them in like a disk load (each bucket as it arrives, as SGLang does; `weight_version`
        is taken with the bucket that carries it)."""
        assert self.runner is not None and self.scheduler is not None
        group = self._groups.get(group_name)
        if group is None:
            return self._update_failed(
                f"no weight update group {group_name!r}: call /init_weights_update_group first"
            )
        async with self._update_lock:
            try:
                # Received before anything is checked: the sender broadcasts regardless.
                received = await asyncio.to_thread(receive_broadcast, group, dtypes, shapes)
            except Exception as exc:
                return self._update_failed(f"receiving the broadcast failed: {exc}")
            tensors = dict(zip(names, received, strict=True))
            try:
                self.runner.check_checkpoint(tensors, partial=True)
            except CheckpointError as exc:
                return self._update_failed(f"cannot load the broadcast weights: {exc}")
            num_paused = await self._swap_in(tensors, weight_version)
        if weight_version is not None:
            log.info("weights updated by broadcast (weight_version=%s)", weight_version)
        return UpdateResult(
            True, f"Succeeded to update {len(names)} tensors.", num_paused_requests=num_paused
        )

    async def _swap_in(self, tensors: dict, weight_version: str | None) -> int:
        """Swap checked tensors in on the model thread (when no request runs, or at once when
        paused) and count the update; -> requests retracted."""
        runner, scheduler = self.runner, self.scheduler
        num_paused = await asyncio.wrap_future(
            scheduler.swap_weights(lambda: runner.load_weights(tensors), weight_version)
        )
        self.metrics.weight_updates.labels(result="success").inc()
        return num_paused

    def _checkpoint_path(self, model_path: str) -> Path:
        """A directory or file as given, else a model prepared in the cache by name."""
        path = Path(model_path).expanduser()
        if path.exists():
            return path
        try:
            return resolve_model_dir(
                ModelSettings(path=model_path, cache_dir=self.settings.model.cache_dir)
            )
        except Exception as exc:
            raise CheckpointError(f"no checkpoint at {model_path}") from exc

    def _update_failed(self, message: str) -> UpdateResult:
        self.metrics.weight_updates.labels(result="failure").inc()
        log.warning("weight update failed: %s", message)
        return UpdateResult(False, message)

    async def pause(self, mode: str) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        await asyncio.wrap_future(scheduler.call(lambda: scheduler.pause(mode)))

    async def resume(self) -> None:
        assert self.scheduler is not None
        await asyncio.wrap_future(self.scheduler.call(self.scheduler.resume))

    async def abort_all(self) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        await asyncio.wrap_future(
            scheduler.call(lambda: scheduler.abort_all("aborted for a weight update", "pause"))
        )

    async def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run or wait."""
        assert self.scheduler is not None
        return await asyncio.wrap_future(self.scheduler.call(self.scheduler.flush_cache))
