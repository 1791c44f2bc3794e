"""Start the Megatron backend: check the layout against the model, reserve one placement-group
bundle per TP rank, and start a `MegatronRank` actor on each (the driver's `ActorGroup` then
calls every method on all of them at once)."""

from __future__ import annotations

import logging
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from clawrl.common.models import resolve_model_dir
from clawrl.trainer.megatron.layout import LayoutError, ModelShape, check_tensor_parallel
from clawrl.trainer.megatron.placement import trainer_bundles
from clawrl.trainer.megatron.rank import MegatronRank, RankConfig, free_port, node_address
from clawrl.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


def rank_config(settings: TrainerSettings) -> RankConfig:
    """The ranks' config. The device follows the actors' GPUs (the driver of a RayJob may have
    none): `auto` is cuda exactly when `ray.actor_num_gpus` > 0."""
    train, ppo, gpus = settings.train, settings.ppo, settings.ray.actor_num_gpus
    device = train.device if train.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    if device == "cuda" and gpus < 1:
        raise LayoutError("train.device=cuda needs ray.actor_num_gpus >= 1 (one GPU per rank)")
    if device == "cpu" and gpus > 0:
        raise LayoutError("train.device=cpu with ray.actor_num_gpus > 0 would idle the GPUs")
    dtype = (
        train.dtype if train.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    )
    return RankConfig(
        tp=settings.megatron.tensor_parallel_size,
        sequence_parallel=settings.megatron.sequence_parallel,
        device=device,
        dtype=dtype,
        seed=train.seed,
        micro_batch_tokens=train.micro_batch_tokens,
        lr=ppo.lr,
        beta1=ppo.beta1,
        beta2=ppo.beta2,
        weight_decay=ppo.weight_decay,
        grad_clip=ppo.grad_clip,
    )


def check_layout(settings: TrainerSettings, model_dir: Path) -> ModelShape:
    """Refuse, before any actor starts, a model or TP size the backend cannot run."""
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    megatron = settings.megatron
    check_tensor_parallel(shape, megatron.tensor_parallel_size, megatron.sequence_parallel)
    return shape


@ray.remote
def _rendezvous() -> tuple[str, int]:
    """Address and a free port on the node of bundle 0, for torch.distributed's TCP store."""
    return node_address(), free_port()


def refuse_lora(settings: TrainerSettings) -> None:
    """Megatron-core has no LoRA of its own: refuse at start rather than train every weight."""
    if settings.lora.enabled:
        raise ValueError(
            "lora.enabled needs train.backend=torch: Megatron-core has no LoRA of its own, so "
            "the megatron backend can only train (and export) full weights; set "
            "lora.enabled=false or train.backend=torch"
        )


def start_actors(settings: TrainerSettings) -> list:
    """One `MegatronRank` actor per TP rank, in one placement group; rank 0 first."""
    refuse_lora(settings)
    cfg = rank_config(settings)
    check_layout(settings, resolve_model_dir(settings.model))
    bundles = trainer_bundles(cfg.tp, settings.ray.actor_num_cpus, settings.ray.actor_num_gpus)
    group = placement_group(bundles, strategy=settings.megatron.placement_strategy)
    ray.get(group.ready())

    def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )

    addr, port = ray.get(_rendezvous.options(num_cpus=0, scheduling_strategy=on_bundle(0)).remote())
    threads = str(max(1, int(settings.ray.actor_num_cpus)))
    actor = ray.remote(MegatronRank)
    actors = [
        actor.options(
            num_cpus=settings.ray.actor_num_cpus,
            num_gpus=settings.ray.actor_num_gpus,
            scheduling_strategy=on_bundle(rank),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": threads}},
        ).remote(rank, addr, port, cfg)
        for rank in range(cfg.tp)
    ]
    log.info("megatron backend: TP=%d on %s (%s), rendezvous %s:%d",
             cfg.tp, cfg.device, cfg.dtype, addr, port)  # fmt: skip
    return actors


def stop_actors(actors: list) -> None:
    """Stop the rank actors and free their placement group (for tools that start several
    backends in one Ray runtime; the trainer's actors live as long as its process)."""
    group = ray.get(actors[0].placement_group.remote()) if actors else None
    for actor in actors:
        ray.kill(actor)
    if group is not None:
        remove_placement_group(group)
