"""`[megatron]`: the Megatron backend's parallel layout (read when `train.backend = megatron`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from clawrl.common.settings import Section


class MegatronSettings(Section):
    """Tensor parallelism over one Ray actor per rank; pipeline / context / data parallelism
    are 1 (one model replica)."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="TP ranks (one Ray actor and, on GPUs, one GPU each); must divide "
        "the model's attention heads and its KV heads (or be a multiple of them).",
    )  # fmt: skip
    sequence_parallel: bool = Field(
        True,
        description="At TP > 1, split each sequence over the TP ranks outside the "
        "tensor-parallel layers (megatron-core's sequence parallelism: norms, residuals and "
        "the MoE router see 1/TP of the tokens; less activation memory). A mixture-of-experts "
        "model needs it at TP > 1. No effect at TP = 1.",
    )
    trainer_gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs the trainer holds (the `[gpu] actor_gpus` of the deployment); when "
        "set, tensor_parallel_size must use all of them (no data parallelism yet).",
    )
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = Field(
        "PACK",
        description="Ray placement-group strategy of the rank actors; STRICT_PACK keeps a TP "
        "group on one node (NCCL over NVLink), which a GPU deployment wants.",
    )

    @model_validator(mode="after")
    def _tp_fits_gpus(self) -> MegatronSettings:
        tp, gpus = self.tensor_parallel_size, self.trainer_gpus
        if gpus is not None and gpus % tp:
            raise ValueError(
                f"megatron.tensor_parallel_size={tp} does not divide trainer_gpus={gpus}"
            )
        if gpus is not None and gpus != tp:
            raise ValueError(
                f"megatron.tensor_parallel_size={tp} on trainer_gpus={gpus} would need "
                f"data parallelism ({gpus // tp} replicas), which the Megatron backend does "
                f"not do yet: set tensor_parallel_size={gpus}"
            )
        return self
