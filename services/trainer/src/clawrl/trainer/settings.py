"""The trainer's one settings object (env `CLAWRL_<SECTION>__<FIELD>`, or `clawrl.toml`).

Section and key names follow the OpenClaw-RL config skeleton users know (`[rollout]`,
`[advantage]`, `[combine]`, `[ppo]`); the rest are the trainer's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from clawrl.common.settings import ClawrlSettings, ModelSettings, RedisSettings, Section
from clawrl.common.tenants import TenantSettings
from clawrl.trainer.losses import AdvantageConfig, LossConfig
from clawrl.trainer.megatron.settings import MegatronSettings
from clawrl.trainer.weight_sync.settings import (
    EngineTargets,
    GatewayTargets,
    SyncSettings,
    WeightSyncSettings,
)


class RolloutSettings(Section):
    """How samples become steps."""

    rollout_batch_size: int = Field(
        16, gt=0, description="Trainable samples per optimizer step (masked ones do not count)."
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="A sample whose policy_version is more than this many versions behind the "
        "trainer's is dropped (counted), never trained.",
    )


class AdvantageSettings(Section):
    """Which advantage estimator turns samples into per-token advantages."""

    estimator: Literal["grpo", "on_policy_distillation", "combine", "step_wise"] = Field(
        "grpo", description="grpo: the reward on every token; on_policy_distillation: "
        "teacher_logp - old_logp; combine: w_rl * reward + w_opd * (teacher_logp - old_logp); "
        "step_wise (OpenClaw-RL's, for episodes): each turn's own step score, normalised within "
        "its (task, turn index) bucket (step_normalize), on every token; trains rl samples."
    )  # fmt: skip
    normalize_groups: bool = Field(
        False,
        description="GRPO group normalisation: each reward minus its group's mean, over the "
        "group's std (off: the reward itself).",
    )
    group_by: Literal["session", "batch"] = Field(
        "session",
        description="A group for normalize_groups: the samples of one session, or the whole "
        "batch (the batch mean as baseline: live traffic samples each prompt once).",
    )
    step_normalize: bool = Field(
        True,
        description="step_wise: normalise each turn's score among the batch's turns of the same "
        "task (the episode's task_id, else its session) and turn index: (s - mean) / (std + "
        "1e-6); a bucket of one keeps its score, a constant bucket is not trained (OpenClaw-RL's "
        "default, rewards normalisation on). Off: each turn's score as it is.",
    )
    opd_clip: float | None = Field(
        None,
        gt=0,
        description="Bound on each token's distillation advantage teacher_logp - old_logp "
        "(on_policy_distillation, combine); unset = unclipped. OpenClaw-RL's top-K OPD uses 2.",
    )


class CombineSettings(Section):
    """Weights of the combine estimator's two terms."""

    w_rl: float = Field(1.0, description="Weight of the scalar reward.")
    w_opd: float = Field(1.0, description="Weight of teacher_logp - old_logp.")


class PPOSettings(Section):
    """The optimizer and the PPO objective."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.98, ge=0, lt=1, description="AdamW beta2.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    policy_loss: Literal["ppo", "reinforce"] = Field("ppo", description="Policy loss.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range below 1.")
    clip_eps_high: float = Field(0.28, gt=0, description="PPO clip range above 1 (clip-higher).")
    dual_clip_c: float | None = Field(
        None, gt=1, description="Dual-clip bound for negative advantages; unset = off."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="KL-to-reference weight; 0 = the reference model is not loaded."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    distill_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the top-K reverse-KL distillation term (needs samples with "
        "teacher top-K).",
    )
    off_policy_correction: Literal["tis", "none"] = Field(
        "tis",
        description="Correction for samples the engines drew with older (or numerically "
        "different) weights: tis weighs each token by min(pi_old / pi_rollout, tis_cap) "
        "(truncated importance sampling against the rollout log-probs); none trains every "
        "sample as if the current weights had drawn it.",
    )
    tis_cap: float = Field(
        2.0, ge=1, description="The cap C on the TIS weight pi_old / pi_rollout."
    )
    aggregation: Literal["token-mean", "seq-mean"] = Field(
        "token-mean", description="How per-token losses are averaged."
    )

    def loss_config(self) -> LossConfig:
        return LossConfig(
            policy_loss=self.policy_loss,
            eps_clip=self.clip_eps,
            eps_clip_high=self.clip_eps_high,
            dual_clip_c=self.dual_clip_c,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            distill_coef=self.distill_coef,
            off_policy_correction=self.off_policy_correction,
            tis_cap=self.tis_cap,
            aggregation=self.aggregation,
        )


class TrainSettings(Section):
    """Where and how the backend runs."""

    backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch: HF transformers in one actor; megatron: Megatron-core."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: one GPU when present, else CPU."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on GPU, float32 on CPU."
    )
    micro_batch_tokens: int = Field(
        2048, gt=0, description="Token budget (count x longest, padded) of one micro-batch."
    )
    seed: int = Field(0, description="Seed of torch's generators.")
    num_threads: int | None = Field(
        None,
        gt=0,
        description="CPU threads of the backend's torch (unset: the CPUs its Ray actor "
        "reserves, ray.actor_num_cpus).",
    )


# The seven projections of a Llama/Qwen decoder layer: attention and MLP.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Section):
    """LoRA training (peft): only the adapter is trained and exported, the base stays frozen."""

    enabled: bool = Field(
        False,
        description="Train a LoRA adapter instead of every weight; each version is exported as "
        "a PEFT adapter directory (the engines load it with /load_lora_adapter). torch backend "
        "only.",
    )
    rank: int = Field(16, gt=0, description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        min_length=1,
        description="Names of the linear layers that get an adapter (the engines' "
        "--lora-target-modules must include them).",
    )


class ConsumerSettings(Section):
    """How the trainer reads clawrl:samples (consumer group `trainers`)."""

    group: str = Field("trainers", description="Consumer group on the samples stream.")
    name: str = Field(
        "trainer-0",
        description="Consumer name; keep it stable across restarts so the trainer takes back "
        "its own pending entries at once.",
    )
    block_ms: int = Field(1000, gt=0, description="XREADGROUP block time.")
    claim_idle_ms: int = Field(
        600_000,
        gt=0,
        description="Entries pending on another consumer this long are taken over; longer "
        "than a step, since the trainer holds a step's entries until its checkpoint.",
    )
    max_deliveries: int = Field(
        5, gt=0, description="Deliveries after which an entry is dead-lettered."
    )
    backend_loss_retries: int = Field(
        1,
        ge=0,
        description="Restarts that retry a whole batch the backend was lost on (a host OOM); "
        "after that each loss halves the steps its samples may be in, until the sample that "
        "kills the backend is alone and is dead-lettered.",
    )
    dedupe_window: int = Field(
        100_000, gt=0, description="Ids of the last trained samples kept to refuse a redelivery."
    )


class CheckpointSettings(Section):
    """Resumable state and the HF exports the engines load."""

    dir: Path = Field(Path("checkpoints"), description="Checkpoint root (a shared volume).")
    sync_interval: int = Field(
        1, gt=0, description="Export policy/v{N} and announce it every this many steps."
    )
    state_interval: int = Field(
        1,
        gt=0,
        description="Save a resumable state every this many steps (and at every export); a "
        "step's samples are acknowledged on the stream only once a state includes it.",
    )
    keep_versions: int = Field(
        5,
        gt=0,
        description="Exported policy versions kept: at least rollout.max_staleness + 1, so "
        "every version whose samples may still be trained stays loadable (a rollback, a late "
        "load); the announced version and the one before it are never pruned.",
    )
    keep_states: int = Field(2, gt=0, description="Resumable states kept.")
    hold_before_ack_step: int | None = Field(
        None,
        gt=0,
        description="Fault injection for tests: once the state of this step is durable, block "
        "before acknowledging its entries (so a test can kill the process right there).",
    )
    export_path_prefix: str | None = Field(
        None,
        description="How the engines see `dir` when it is mounted elsewhere (announced paths "
        "use it); unset = the same path.",
    )


class RaySettings(Section):
    """Where the backend actors run."""

    address: str | None = Field(
        None,
        description="None: start a local Ray runtime; 'auto': join the cluster (KubeRay RayJob "
        "entrypoint); or a ray:// / host:port address.",
    )
    num_cpus: int | None = Field(
        None, gt=0, description="CPUs of the local runtime (None: Ray's default)."
    )
    actor_num_cpus: float = Field(1.0, gt=0, description="CPUs reserved by a backend actor.")
    actor_num_gpus: float = Field(0.0, ge=0, description="GPUs reserved by a backend actor.")


class TransportSettings(Section):
    """How a new policy version reaches the policy engines."""

    transport: Literal["disk", "nccl"] = Field(
        "disk",
        description="disk: each export is announced and the weight-sync launcher runs a job "
        "that loads it from disk (/update_weights_from_disk). nccl: the trainer runs the sync "
        "itself right after the export, broadcasting from its rank 0 (/init_weights_update_group "
        "+ /update_weights_from_distributed; gloo on CPU), with the export on disk as the "
        "fallback; needs train.backend=megatron and the [gateways] / [engines] of the sync.",
    )
    engine_tp: int = Field(
        1, ge=1, description="TP ranks of each policy engine (`[gpu] rollout_tp`): each joins "
        "the broadcast group.",
    )  # fmt: skip
    master_address: str | None = Field(
        None,
        description="Address the engines reach the trainer's rank 0 at for the group's "
        "rendezvous; unset = the IP of rank 0's node.",
    )
    master_port: int = Field(
        0, ge=0, lt=65536, description="Rendezvous port on rank 0; 0 = a free port each time "
        "the group forms.",
    )  # fmt: skip
    group_name: str = Field(
        "clawrl-weights",
        description="Name of the broadcast group, before a random suffix each time it forms.",
    )
    bucket_mb: int = Field(
        512, gt=0, description="Tensors announced and broadcast together, at most this many MiB."
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the group to form or for one bucket; a broadcast that "
        "takes longer fails and the engines load the version from disk.",
    )


class ServerSettings(Section):
    """The HTTP endpoint Prometheus scrapes (/metrics)."""

    host: str = Field("127.0.0.1", description="Address the metrics endpoint listens on.")
    metrics_port: int = Field(30030, ge=0, lt=65536, description="/metrics port (0 = free).")


class TrainerSettings(ClawrlSettings):
    """Everything the trainer needs, built once at start and passed down."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    advantage: AdvantageSettings = Field(default_factory=AdvantageSettings)
    combine: CombineSettings = Field(default_factory=CombineSettings)
    ppo: PPOSettings = Field(default_factory=PPOSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    tenants: TenantSettings = Field(
        default_factory=TenantSettings,
        description="Per-tenant adapters (shared with the gateway): which tenants train one.",
    )
    consumer: ConsumerSettings = Field(default_factory=ConsumerSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    megatron: MegatronSettings = Field(default_factory=MegatronSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    weight_sync: TransportSettings = Field(default_factory=TransportSettings)
    # The weight-sync job's own sections (same names, same file), read with transport = nccl.
    gateways: GatewayTargets = Field(default_factory=GatewayTargets)
    engines: EngineTargets = Field(default_factory=EngineTargets)
    sync: SyncSettings = Field(default_factory=SyncSettings)

    @model_validator(mode="after")
    def _check_versions_kept(self) -> TrainerSettings:
        floor = self.rollout.max_staleness + 1
        if self.checkpoint.keep_versions < floor:
            raise ValueError(
                f"checkpoint.keep_versions ({self.checkpoint.keep_versions}) must be at least "
                f"rollout.max_staleness + 1 ({floor}): an engine may still serve, or a rollback "
                "may need, any version whose samples are still trained"
            )
        return self

    @model_validator(mode="after")
    def _check_tenants(self) -> TrainerSettings:
        if self.tenants.per_tenant and not (self.lora.enabled and self.train.backend == "torch"):
            raise ValueError(
                "tenants.mode=per_tenant trains one LoRA adapter per tenant: set lora.enabled "
                "= true with train.backend = torch (Megatron has no LoRA)"
            )
        return self

    @model_validator(mode="after")
    def _check_transport(self) -> TrainerSettings:
        if self.weight_sync.transport == "nccl":
            if self.train.backend != "megatron":
                raise ValueError(
                    "weight_sync.transport=nccl broadcasts from the Megatron backend's rank 0: "
                    "set train.backend=megatron (the torch backend syncs from disk only)"
                )
            self.sync_job_settings()  # no gateways or engines, or a lease the lock outlives
        return self

    def sync_job_settings(self) -> WeightSyncSettings:
        """The weight-sync job's settings, for the syncs the trainer runs itself."""
        return WeightSyncSettings(
            logging=self.logging, model=self.model, redis=self.redis,
            gateways=self.gateways, engines=self.engines, sync=self.sync,
        )  # fmt: skip

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(
            estimator=self.advantage.estimator,
            w_rl=self.combine.w_rl,
            w_opd=self.combine.w_opd,
            normalize_groups=self.advantage.normalize_groups,
            group_by=self.advantage.group_by,
            opd_clip=self.advantage.opd_clip,
            step_normalize=self.advantage.step_normalize,
        )
