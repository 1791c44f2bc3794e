"""Where the pieces of a GPU node go (the `[gpu]` skeleton: actor_gpus / rollout_gpus / prm_gpus
and their TP sizes, 4 / 2 / 2 on the default 8-GPU node): the trainer's Ray placement group (one
GPU bundle per Megatron rank, strictly packed so a TP group shares NVLink) and how many engine
replicas of which TP the policy and judge GPUs make. Pure: the chart and `start_actors` use it."""

from __future__ import annotations

from dataclasses import dataclass

from clawrl.trainer.megatron.layout import LayoutError


@dataclass(frozen=True)
class EnginePlan:
    """`replicas` SGLang servers of `tp` GPUs each."""

    gpus: int
    tp: int

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp


@dataclass(frozen=True)
class PlacementPlan:
    trainer_bundles: tuple[dict[str, float], ...]
    trainer_strategy: str
    trainer_tp: int
    policy: EnginePlan
    judge: EnginePlan

    @property
    def gpus(self) -> int:
        return len(self.trainer_bundles) + self.policy.gpus + self.judge.gpus


def trainer_bundles(ranks: int, cpus_per_rank: float, gpus_per_rank: float) -> list[dict]:
    """One bundle per rank (a GPU each on GPU nodes)."""
    bundle: dict[str, float] = {"CPU": cpus_per_rank}
    if gpus_per_rank:
        bundle["GPU"] = gpus_per_rank
    return [dict(bundle) for _ in range(ranks)]


def _divides(what: str, tp: int, gpus: int) -> None:
    if tp < 1 or gpus < 1 or gpus % tp:
        raise LayoutError(f"{what}: TP {tp} does not divide its {gpus} GPUs")


def plan_node(
    *,
    actor_gpus: int = 4,
    actor_tp: int = 4,
    rollout_gpus: int = 2,
    rollout_tp: int = 2,
    prm_gpus: int = 2,
    prm_tp: int = 2,
    node_gpus: int = 8,
    cpus_per_rank: float = 4.0,
) -> PlacementPlan:
    """The plan for one node; LayoutError when the split cannot work."""
    _divides("trainer", actor_tp, actor_gpus)
    if actor_gpus != actor_tp:
        raise LayoutError(
            f"trainer: {actor_gpus} GPUs at TP {actor_tp} would need data parallelism, which "
            "the Megatron backend does not do yet"
        )
    _divides("policy engines", rollout_tp, rollout_gpus)
    _divides("judge engines", prm_tp, prm_gpus)
    plan = PlacementPlan(
        trainer_bundles=tuple(trainer_bundles(actor_gpus, cpus_per_rank, 1.0)),
        trainer_strategy="STRICT_PACK",
        trainer_tp=actor_tp,
        policy=EnginePlan(rollout_gpus, rollout_tp),
        judge=EnginePlan(prm_gpus, prm_tp),
    )
    if plan.gpus > node_gpus:
        raise LayoutError(
            f"trainer {actor_gpus} + policy {rollout_gpus} + judge {prm_gpus} GPUs exceed the "
            f"node's {node_gpus}"
        )
    return plan
