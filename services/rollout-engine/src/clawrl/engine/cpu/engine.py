"""The CPU engine as the asyncio side sees it: load the model, submit generations and stream
their state, swap weights, load and unload LoRA adapters, pause and resume. Torch work happens
on the scheduler's thread or in worker threads, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from clawrl.common.models import context_length, resolve_model_dir
from clawrl.common.process_groups import destroy_group, join_group, receive_broadcast
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.adapters import PreparedAdapter, prepare_adapter
from clawrl.engine.cpu.runner import CheckpointError, ModelRunner, read_checkpoint
from clawrl.engine.cpu.scheduler import Scheduler
from clawrl.engine.cpu.sequence import Sequence
from clawrl.engine.generation import GenerationRequest, GenerationState, GenerationUpdate
from clawrl.engine.lora import (
    LoraError,
    LoraRef,
    LoraRegistry,
    never_loaded,
    normalized_modules,
    not_enabled,
    parse_lora_path,
)
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import SOLO_PREFILL_BF16, EngineSettings

log = logging.getLogger(__name__)

LOAD_FORMATS = (None, "auto", "safetensors")
BROADCAST_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class UpdateResult:
    """Reply of /update_weights_from_disk, /init_weights_update_group and
    /update_weights_from_distributed."""

    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass(frozen=True)
class LoraUpdate:
    """Reply of /load_lora_adapter and /unload_lora_adapter (SGLang's LoRAUpdateOutput)."""

    success: bool
    error_message: str
    loaded_adapters: dict[str, str]


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
        # SGLang receives a broadcast only inside /begin_weight_update../end_weight_update.
        self._weight_session = False
        self.tokenizer = None
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self.lora = LoraRegistry()
        self._lora_lock = asyncio.Lock()  # loads and unloads one at a time, as in SGLang
        self.max_lora_rank = 0  # what a loaded adapter may have (set at load)
        self.lora_modules: set[str] = set()

    @classmethod
    async def load(cls, settings: EngineSettings, metrics: EngineMetrics) -> CpuEngine:
        engine = cls(settings, metrics)
        initial = await asyncio.to_thread(engine._load)
        for ref in initial:
            engine.lora.register(ref)
        metrics.lora_adapters.set(len(engine.lora))
        assert engine.scheduler is not None
        engine.scheduler.start()
        return engine

    def _load(self) -> list[LoraRef]:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        serving = self.settings.engine
        self.runner = ModelRunner(
            self.model_dir,
            serving.dtype,
            self.context_length,
            self.settings.model.rope_scaling,
            lora_merge_after=serving.lora_merge_after,
            lora_merge_failed=self.metrics.lora_merge_failures.inc,
        )
        if self.runner.long_context:
            log.warning("LONG CONTEXT: %s", self.runner.long_context)
        if serving.solo_prefill_size is None:  # bfloat16 only: float32 gained nothing from it
            solo = SOLO_PREFILL_BF16 if self.runner.dtype == torch.bfloat16 else 0
            serving = serving.model_copy(update={"solo_prefill_size": solo})
        self.scheduler = Scheduler(
            self.runner, serving, self.metrics, self.decode, serving.weight_version
        )
        log.info(
            "loaded %s (vocab %d, context %d, %s)",
            self.model_dir,
            self.runner.vocab_size,
            self.context_length,
            str(self.runner.dtype).removeprefix("torch."),
        )
        return self._load_initial_adapters() if serving.lora_enabled else []

    def _load_initial_adapters(self) -> list[LoraRef]:
        """--lora-paths, injected before serving starts; the rank and target-module limits for
        later loads default to what these adapters need (SGLang infers them the same way)."""
        assert self.runner is not None and self.scheduler is not None
        serving = self.settings.engine
        explicit_modules = serving.lora_target_modules
        self.max_lora_rank = serving.max_lora_rank or 0
        self.lora_modules = normalized_modules(explicit_modules or [])
        refs = []
        for spec in serving.lora_paths:
            name, path, pinned = parse_lora_path(spec)
            if any(ref.name == name for ref in refs):
                raise LoraError(f"--lora-paths names adapter {name} twice")
            adapter = self._prepare(
                name,
                path,
                serving.max_lora_rank or 1 << 30,
                self.lora_modules if explicit_modules else normalized_modules(["all"]),
            )
            ref = LoraRef(name, path, pinned)
            # Injected while slots are free; the rest wait in host memory for a request.
            self.scheduler.add_adapter(ref.key, adapter, pinned, name)
            self.max_lora_rank = max(self.max_lora_rank, adapter.rank)
            if not explicit_modules:
                self.lora_modules |= normalized_modules(adapter.modules)
            refs.append(ref)
            log.info("LoRA adapter %s loaded from %s (rank %d)", name, path, adapter.rank)
        return refs

    def _prepare(self, name: str, path: str, max_rank: int, modules: set[str]) -> PreparedAdapter:
        assert self.runner is not None
        return prepare_adapter(
            name,
            path,
            self.runner.decoder,
            self.runner.decoder_prefix,
            max_rank=max_rank,
            allowed_modules=modules,
            dtype=self.runner.dtype,
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
        request, release = self._take_adapter(request)

        def emit(update: GenerationUpdate) -> None:
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
                if update.finish is not None:
                    # Here too, not only when the iterator closes: a stream whose response
                    # never started would otherwise hold its adapter forever.
                    loop.call_soon_threadsafe(release)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        try:
            seq = self.scheduler.submit(request, emit)
        except BaseException:
            release()
            raise
        return self._follow(seq, updates, GenerationState(request), release)

    async def resolve_adapter(self, request: GenerationRequest) -> GenerationRequest:
        """Load the adapter a request names again when it was unloaded (SGLang reloads an
        adapter it has loaded before from its path; a request arriving during the unload waits
        for it, then reloads); a name never loaded is refused. Call before `generate`."""
        name = request.lora_path
        if name is None or name in self.lora or not self.settings.engine.lora_enabled:
            return request
        ref = self.lora.history.get(name)
        if ref is None:
            raise never_loaded(name, list(self.lora.history))
        log.info("reloading unloaded LoRA adapter %s from %s", name, ref.path)
        result = await self.load_lora_adapter(name, ref.path, ref.pinned)
        if not result.success and "already loaded" not in result.error_message:
            raise LoraError(f"Failed to implicitly load LoRA adapter {name}: "
                            f"{result.error_message}")  # fmt: skip
        return request

    def _take_adapter(
        self, request: GenerationRequest
    ) -> tuple[GenerationRequest, Callable[[], None]]:
        """The request bound to its loaded adapter (counted as using it until `release`,
        which may be called more than once); raises LoraError when the name is not loaded."""
        name = request.lora_path
        if name is None:
            return request, lambda: None
        if not self.settings.engine.lora_enabled:
            raise not_enabled(name)
        ref = self.lora.acquire(name)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.lora.release(ref)

        return dataclasses.replace(request, lora_id=ref.key), release

    @staticmethod
    async def _follow(
        seq: Sequence,
        updates: asyncio.Queue[GenerationUpdate],
        state: GenerationState,
        release: Callable[[], None],
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
            release()

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
            return self._update_failed(f"Failed to initialize custom process group: {exc}.")
        log.info("joined weight update group %s as rank %d of %d", group_name, rank_offset,
                 world_size)  # fmt: skip
        return UpdateResult(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None = None,
    ) -> UpdateResult:  # fmt: skip
        """Receive the next tensors rank 0 broadcasts, check them against the model, and swap
        them in like a disk load (each bucket as it arrives, as SGLang does; `weight_version`
        is taken with the bucket that carries it)."""
        assert self.runner is not None and self.scheduler is not None
        if not self._weight_session:
            return self._update_failed(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        group = self._groups.get(group_name)
        if group is None:
            return self._update_failed(
                f"Failed to receive weights: Group {group_name} not in {list(self._groups)}. "
                "Please call `init_weights_update_group` first."
            )
        unsupported = sorted(set(dtypes) - set(BROADCAST_DTYPES))
        if unsupported:  # SGLang receives any torch dtype; the CPU engine serves these
            return self._update_failed(
                f"Failed to receive weights: dtype {unsupported[0]} is not one of "
                f"{', '.join(BROADCAST_DTYPES)}"
            )
        async with self._update_lock:
            try:
                # Received before anything is checked: the sender broadcasts regardless.
                received = await asyncio.to_thread(receive_broadcast, group, dtypes, shapes)
            except Exception as exc:
                return self._update_failed(f"Failed to receive weights: {exc}")
            tensors = dict(zip(names, received, strict=True))
            try:
                self.runner.check_checkpoint(tensors, partial=True)
            except CheckpointError as exc:
                return self._update_failed(f"Failed to update parameter online: {exc}")
            num_paused = await self._swap_in(tensors, weight_version)
        if weight_version is not None:
            log.info("weights updated by broadcast (weight_version=%s)", weight_version)
        return UpdateResult(
            True, "Succeeded to update parameter online.", num_paused_requests=num_paused
        )

    def begin_weight_update(self) -> UpdateResult:
        """Open the session a broadcast is received in (SGLang's; nothing to restore here)."""
        if self._weight_session:
            return self._update_failed(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self._weight_session = True
        return UpdateResult(True, "Success")

    def end_weight_update(self) -> UpdateResult:
        if not self._weight_session:
            return self._update_failed(
                "no weight-update session is open; call begin_weight_update() first"
            )
        self._weight_session = False
        return UpdateResult(True, "Success")

    async def destroy_weights_update_group(self, group_name: str) -> UpdateResult:
        """Leave the group. Its sockets close once the group is freed, which ends a broadcast
        rank 0 still runs on it (instead of it waiting out the group's timeout)."""
        group = self._groups.pop(group_name, None)
        if group is None:
            return self._update_failed("The group to be destroyed does not exist.")
        try:
            # Waits for a receive still running on the group (it holds the update lock).
            async with self._update_lock:
                await asyncio.to_thread(destroy_group, group)
        except Exception as exc:  # a broken group: it is dropped all the same
            return self._update_failed(f"Failed to destroy custom process group: {exc}.")
        finally:
            del group
        log.info("left weight update group %s", group_name)
        return UpdateResult(True, "Succeeded to destroy custom process group.")

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

    # ----- LoRA adapters -------------------------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> LoraUpdate:
        """Read and check the adapter in a worker thread while serving goes on, hand it to the
        model thread between two steps (injected there if a slot is free, else when a request
        needs it), then let requests name it. Beyond max_loaded_loras, the least recently used
        unpinned adapter is unloaded (SGLang's order: after the new one is registered)."""
        assert self.scheduler is not None
        if not self.settings.engine.lora_enabled:
            return self._lora_failed("load", "LoRA is not enabled. Please set `--enable-lora` "
                                     "to enable LoRA.")  # fmt: skip
        async with self._lora_lock:
            start = time.perf_counter()
            if name in self.lora:
                return self._lora_failed(
                    "load", f"Failed to load LoRA adapter {name} because it is already loaded"
                )
            if pinned and self._pinned() >= self.settings.engine.max_loras_per_batch - 1:
                return self._lora_failed(
                    "load",
                    f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed "
                    "to pin all slots in the LoRA memory pool to avoid starvation for unpinned "
                    "adapters and base models. Please increase your `--max-loras-per-batch` or "
                    "load it as unpinned LoRA adapters.",
                )
            try:
                adapter = await asyncio.to_thread(
                    self._prepare, name, path, self.max_lora_rank, self.lora_modules
                )
            except LoraError as exc:
                return self._lora_failed("load", str(exc))
            ref = LoraRef(name, path, pinned)
            scheduler = self.scheduler
            try:
                await asyncio.wrap_future(
                    scheduler.call(lambda: scheduler.add_adapter(ref.key, adapter, pinned, name))
                )
            except Exception as exc:  # peft refused what the checks let through
                log.exception("injecting LoRA adapter %s failed", name)
                return self._lora_failed("load", f"Failed to load LoRA adapter {name}: {exc}")
            self.lora.register(ref)
            elapsed = time.perf_counter() - start
            self.metrics.lora_load_seconds.observe(elapsed)
            log.info("LoRA adapter %s loaded from %s in %.2f s", name, path, elapsed)
            await self._keep_max_loaded()
        return self._lora_done("load")

    async def _keep_max_loaded(self) -> None:
        """Unload least recently used adapters while more than max_loaded_loras are loaded
        (each once its running requests end); a later request naming one loads it again."""
        limit = self.settings.engine.max_loaded_loras
        while limit is not None and len(self.lora) > limit:
            name = self.lora.least_recently_used()
            if name is None:  # all pinned: cannot happen while pinned < max_loras_per_batch
                log.warning("%d adapters loaded (max_loaded_loras=%d), all pinned",
                            len(self.lora), limit)  # fmt: skip
                return
            log.info("unloading least recently used LoRA adapter %s (%d loaded, "
                     "max_loaded_loras=%d)", name, len(self.lora), limit)  # fmt: skip
            await self._unload(name)
            self.metrics.lora_evictions.labels(level="loaded").inc()
            self.metrics.lora_adapters.set(len(self.lora))

    async def unload_lora_adapter(self, name: str) -> LoraUpdate:
        """Refuse new requests for `name` at once, wait until the requests using it (running or
        queued) have ended, then delete it and its cached KV (SGLang's order)."""
        assert self.scheduler is not None
        if not self.settings.engine.lora_enabled:
            return self._lora_failed("unload", "LoRA is not enabled. Please set `--enable-lora` "
                                     "to enable LoRA.")  # fmt: skip
        async with self._lora_lock:
            try:
                await self._unload(name)
            except LoraError as exc:
                return self._lora_failed("unload", str(exc))
        return self._lora_done("unload")

    async def _unload(self, name: str) -> None:
        """Unregister `name`, wait for its requests, delete it (holding the LoRA lock)."""
        assert self.scheduler is not None
        ref = self.lora.unregister(name)
        users = self.lora.users(ref)
        if users:
            log.info("unloading LoRA adapter %s once its %d requests end", name, users)
        await self.lora.wait_unused(ref)
        scheduler = self.scheduler
        await asyncio.wrap_future(scheduler.call(lambda: scheduler.remove_adapter(ref.key)))
        log.info("LoRA adapter %s unloaded", name)

    def _pinned(self) -> int:
        return sum(ref.pinned for ref in self.lora.refs())

    def _lora_done(self, op: str) -> LoraUpdate:
        self.metrics.lora_updates.labels(op=op, result="success").inc()
        self.metrics.lora_adapters.set(len(self.lora))
        return LoraUpdate(True, "", self.lora.loaded())

    def _lora_failed(self, op: str, message: str) -> LoraUpdate:
        self.metrics.lora_updates.labels(op=op, result="failure").inc()
        log.warning("LoRA %s failed: %s", op, message)
        return LoraUpdate(False, message, self.lora.loaded())

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
