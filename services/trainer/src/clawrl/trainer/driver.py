"""The Ray side of the trainer: where the backend runs and how the driver calls it.

The driver (the trainer process; on Kubernetes the KubeRay RayJob entrypoint) owns the stream,
the checkpoints' bookkeeping and the step order; the model lives in Ray actors, one per rank.
Every backend method is called on all ranks at once (model-parallel ranks must take part in
every collective) and rank 0's result is returned.

Backends: `torch` is one actor holding a `TorchBackend`. `megatron` provides
`clawrl.trainer.megatron.actors.start_actors(settings) -> list[ActorHandle]` (its placement
group, one actor per rank), each actor exposing the `backend.TrainerBackend` methods.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
from typing import Any, Protocol

import ray

from clawrl.common.models import resolve_model_dir, rope_stretch, trained_context
from clawrl.trainer.ray_reaper import start_reaper
from clawrl.trainer.settings import RaySettings, TrainerSettings
from clawrl.trainer.torch_backend import TorchBackend

log = logging.getLogger(__name__)


class BackendLost(RuntimeError):
    """The backend's process is gone (an actor died): the trainer must restart from its last
    state, not go on without a model."""


class BackendHandle(Protocol):
    """How the driver calls a backend: `await handle.call("train_step", batch, cfg)`."""

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...


class ActorGroup:
    """A backend spread over Ray actors (one per rank)."""

    def __init__(self, actors: list) -> None:
        if not actors:
            raise ValueError("a backend needs at least one actor")
        self.actors = actors

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result_refs = [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
        try:
            results = await asyncio.gather(*result_refs)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
            # Ray's memory monitor kills the actor's process (OutOfMemoryError, not an actor
            # error): the actor is as dead, and every later call fails the same way.
            raise BackendLost(f"backend actor died during {method}: {exc}") from exc
        return results[0]


class InProcess:
    """A backend in this process, called from a worker thread (tests and tools; the service
    always runs under Ray)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(getattr(self.backend, method), *args, **kwargs)


# Ray's GCS marks a node dead after this many failed health checks (Ray's default 5: ~65 s at
# a 3 s period and a 10 s timeout each), and a raylet told it is dead exits. A raylet starved of
# CPU (make run beside busy engines, at load average 44-60 on 2 cores) missed them and died with
# the training actor; a local runtime has no other node to move work to, so it waits ~11 min.
LOCAL_HEALTH_CHECK_FAILURES = 50


def connect(settings: RaySettings) -> None:
    """Join the Ray cluster (`address` set, e.g. 'auto' in a RayJob) or start a local runtime."""
    if ray.is_initialized():
        return
    if settings.address:
        ray.init(address=settings.address, log_to_driver=True)
        log.info("joined the Ray cluster at %s", settings.address)
    else:
        # Ray nices its workers to 15 by default: beside busy engines on one machine (make run)
        # the training actor then gets ~10 % of a core and a step takes minutes, not seconds.
        ray.init(
            num_cpus=settings.num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            _system_config={
                "worker_niceness": 0,
                "health_check_failure_threshold": LOCAL_HEALTH_CHECK_FAILURES,
            },
        )
        start_reaper()  # a trainer killed outright takes its Ray workers along
        log.info("started a local Ray runtime")


def refuse_stretched_rope(settings: TrainerSettings) -> None:
    """The megatron backend builds RoPE from the model's own config: with a context stretched
    beyond it (as the engines serve it) its log-probs would not be the engines', and every PPO
    ratio would be off. Refuse at start instead."""
    model_dir = resolve_model_dir(settings.model)
    trained = trained_context(json.loads((model_dir / "config.json").read_text()))
    if rope_stretch(trained, settings.model.context_length or 0, settings.model.rope_scaling):
        raise ValueError(
            f"train.backend=megatron does not stretch RoPE: model.context_length "
            f"{settings.model.context_length} is beyond the {trained} tokens {model_dir} was "
            f"trained on; use train.backend=torch or a context of at most {trained}"
        )


def start_backend(settings: TrainerSettings) -> BackendHandle:
    """The configured backend on its Ray actors (not loaded yet)."""
    if settings.train.backend == "megatron":
        refuse_stretched_rope(settings)
        actors = importlib.import_module("clawrl.trainer.megatron.actors")
        return ActorGroup(actors.start_actors(settings))
    # Ray sets OMP_NUM_THREADS to the actor's CPU count (1 by default): say it explicitly.
    threads = settings.train.num_threads or max(1, int(settings.ray.actor_num_cpus))
    remote = ray.remote(TorchBackend).options(
        num_cpus=settings.ray.actor_num_cpus,
        num_gpus=settings.ray.actor_num_gpus,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
    )
    return ActorGroup([remote.remote(settings.train, settings.ppo, settings.model, settings.lora)])
