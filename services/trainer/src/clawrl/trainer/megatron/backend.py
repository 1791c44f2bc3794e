"""The Megatron backend: `backend.TrainerBackend` over one Ray actor per tensor-parallel rank, in
one placement group. Every call runs on all ranks at once (they meet in the TP collectives);
rank 0's answer is returned -- all ranks compute the same log-probs and losses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor

from clawrl.trainer.backend import TrainBatch, Which
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.megatron.rank import MegatronRank, RankConfig


@dataclass(frozen=True)
class ActorResources:
    """Ray resources of one rank's actor, and how the group's bundles are placed."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    strategy: str = "PACK"  # STRICT_PACK on GPU nodes: NCCL TP wants one node


@ray.remote
def _rendezvous() -> tuple[str, int]:
    """Address and a free port on the node of bundle 0, for torch.distributed's TCP store."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class MegatronBackend:
    """See the module docstring. Assumes Ray is initialised (the trainer's main does it)."""

    name = "megatron"

    def __init__(self, cfg: RankConfig, resources: ActorResources) -> None:
        self.cfg = cfg
        bundle = {"CPU": resources.num_cpus}
        if resources.num_gpus:
            bundle["GPU"] = resources.num_gpus
        self._group = placement_group([dict(bundle) for _ in range(cfg.tp)], resources.strategy)
        ray.get(self._group.ready())

        def on_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=index
            )

        addr, port = ray.get(
            _rendezvous.options(num_cpus=0, scheduling_strategy=on_bundle(0)).remote()
        )
        actor_class = ray.remote(MegatronRank)
        threads = max(1, int(resources.num_cpus))
        self._ranks = [
            actor_class.options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                scheduling_strategy=on_bundle(rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}},
            ).remote(rank, addr, port, cfg)
            for rank in range(cfg.tp)
        ]
        self._vocab_size: int | None = None

    def _all(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank at once; -> rank 0's result."""
        refs = [getattr(rank, method).remote(*args) for rank in self._ranks]
        return ray.get(refs)[0]

    def load(self, model_dir: Path, *, load_reference: bool) -> None:
        self._vocab_size = self._all("load", str(model_dir), load_reference)

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            raise RuntimeError("load() first")
        return self._vocab_size

    def compute_logprobs(self, batch: TrainBatch, which: Which = "policy") -> Tensor:
        return self._all("compute_logprobs", ray.put(batch), which)

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, float]:
        return self._all("train_step", ray.put(batch), loss_cfg)

    def gather_hf(self) -> dict[str, Tensor]:
        """The full HF state dict (gathered from the TP shards on rank 0)."""
        return self._all("gather_hf")

    def export_hf(self, path: Path) -> None:
        self._all("export_hf", str(path))

    def save_state(self, path: Path) -> None:
        self._all("save_state", str(path))

    def load_state(self, path: Path) -> None:
        self._all("load_state", str(path))

    def close(self) -> None:
        """Stop the rank actors and free their placement group."""
        for rank in self._ranks:
            ray.kill(rank)
        self._ranks = []
        remove_placement_group(self._group)
