"""The PyTorch backend: an HF transformers causal LM in one process, on CPU (float32) or one GPU
(bfloat16), AdamW, micro-batches by token budget with gradient accumulation.

In bfloat16 the weights and Adam's moments stay float32 and only the forward runs in bfloat16
(autocast): a 1e-5 step is below bfloat16's resolution for most weights and would be lost.
Exports are written in the compute dtype, which is what the engines serve.

Only the response rows of the last hidden state go through the output layer: a [b, R, V] logits
tensor instead of [b, L, V], which is most of the memory of a step at a 49k vocabulary.

With `[lora] enabled` the model is wrapped by peft: the base weights are frozen, only the
adapter is in the optimizer and in the saved states, and an export is a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors) that engines load beside the base. The KL
reference is then the same model with its adapter disabled: no second copy of the base.

Per-tenant adapters (`[tenants] mode = "per_tenant"`) live in the same peft model beside the
shared one, each with its own optimizer: `use_adapter(tenant)` picks the one that the next
log-probs, step and export are of; a tenant's first adapter is a copy of the shared one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from clawrl.common.models import stretch_config
from clawrl.common.settings import ModelSettings
from clawrl.common.tenants import SHARED
from clawrl.trainer.backend import (
    TrainBatch,
    Which,
    accumulate_gradients,
    micro_batches,
    response_rows,
)
from clawrl.trainer.backend import response_targets as targets_of
from clawrl.trainer.losses import (
    LossConfig,
    TokenTerms,
    entropy_from_logits,
    token_logprobs,
)
from clawrl.trainer.settings import LoraSettings, PPOSettings, TrainSettings

log = logging.getLogger(__name__)

SHARED_ADAPTER = "default"  # peft's name of the first adapter: the shared policy's

# Files of an HF model directory that are not weights: copied next to every export so an engine
# can load it on its own.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible")
    return torch.device(setting)


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


class TorchBackend:
    """`backend.TrainerBackend` on HF transformers (see the module docstring)."""

    def __init__(
        self,
        train: TrainSettings,
        ppo: PPOSettings,
        model: ModelSettings | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.train = train
        self.ppo = ppo
        self.lora = lora or LoraSettings()
        # Only its context length and RoPE scaling: a context beyond the model's is served with
        # stretched RoPE, and log-probs for PPO's ratios must be computed with the same stretch.
        self.model_settings = model or ModelSettings()
        self.device = pick_device(train.device)
        self.dtype = pick_dtype(train.dtype, self.device)
        self._autocast = self.dtype != torch.float32
        self.model_dir: Path | None = None
        self.model = None
        self.reference = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}  # per tenant, with LoRA
        self.tenant = SHARED  # whose adapter the next step trains
        torch.manual_seed(train.seed)
        if train.num_threads:
            torch.set_num_threads(train.num_threads)
        hf_logging.disable_progress_bar()  # per-load/save bars flood a service's log

    # --- loading ---------------------------------------------------------------------------------

    def _load_model(self, model_dir: Path):
        config = AutoConfig.from_pretrained(model_dir)
        # The exported config keeps the stretch, so an engine loading an export serves it too.
        stretched = stretch_config(
            config, self.model_settings.context_length, self.model_settings.rope_scaling
        )
        if stretched:
            log.warning("LONG CONTEXT: %s", stretched)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
        return model.to(self.device)

    def load(self, model_dir: Path, *, load_reference: bool) -> None:
        self.model_dir = Path(model_dir)
        self.model = self._load_model(self.model_dir)
        if self.lora.enabled:
            # Freezes the base; the reference (kl_coef > 0) is this model with the adapter off.
            self.model = get_peft_model(self.model, self._lora_config())
        elif load_reference:
            self.reference = self._load_model(self.model_dir).eval().requires_grad_(False)
        self.model.train()
        self.optimizer = self._adamw(self._trainable().values())
        self.optimizers = {SHARED: self.optimizer}

    def _adamw(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params,
            lr=self.ppo.lr,
            betas=(self.ppo.beta1, self.ppo.beta2),
            weight_decay=self.ppo.weight_decay,
        )

    # --- tenants ---------------------------------------------------------------------------------

    def use_adapter(self, tenant: str) -> None:
        """Score, train and export `tenant`'s adapter from now on (SHARED: the shared policy's).
        A tenant seen for the first time starts from the shared policy: a copy of its adapter's
        weights (not of its optimizer's moments)."""
        if not self.lora.enabled:
            raise RuntimeError("per-tenant adapters need [lora] enabled")
        name = peft_name(tenant)
        if tenant not in self.optimizers:
            self.model.add_adapter(name, self._lora_config())
            self._from_shared(tenant)
            log.info("tenant %s: a new adapter, from the shared policy", tenant)
        self.model.set_adapter(name)  # the active adapter alone requires grad
        self.optimizer = self.optimizers[tenant]
        self.tenant = tenant

    def reset_adapter(self, tenant: str) -> None:
        """`tenant`'s adapter back to the shared policy: its weights a copy of the shared
        adapter's, its optimizer new; it is the one in use afterwards (to export it)."""
        if tenant == SHARED or tenant not in self.optimizers:
            raise ValueError(f"tenant {tenant!r} has no adapter of its own to reset")
        self._from_shared(tenant)
        self.use_adapter(tenant)

    def remove_adapter(self, tenant: str) -> None:
        """Drop `tenant`'s adapter and optimizer (a reset or remove frees its slot); the shared
        policy's is in use afterwards. A tenant without one is left as it is."""
        if tenant == SHARED:
            raise ValueError("the shared policy's adapter cannot be removed")
        if self.tenant == tenant:
            self.use_adapter(SHARED)
        if self.optimizers.pop(tenant, None) is not None:
            self.model.delete_adapter(peft_name(tenant))
            log.info("tenant %s: adapter removed", tenant)

    def _from_shared(self, tenant: str) -> None:
        """Copy the shared adapter's weights into `tenant`'s, and give it a fresh optimizer."""
        name = peft_name(tenant)
        shared = self._adapter_params(SHARED_ADAPTER)
        with torch.no_grad():
            for key, param in self._adapter_params(name).items():
                param.copy_(shared[key.replace(f".{name}.", f".{SHARED_ADAPTER}.")])
        self.optimizers[tenant] = self._adamw(self._adapter_params(name).values())

    def _adapter_params(self, name: str) -> dict[str, torch.nn.Parameter]:
        return {
            key: p
            for key, p in self.model.named_parameters()
            if "lora_" in key and f".{name}." in key
        }

    def _lora_config(self) -> LoraConfig:
        return LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            task_type="CAUSAL_LM",
            # Written into every export's adapter_config.json: the base it was trained on.
            base_model_name_or_path=str(self.model_dir),
        )

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer steps (all of them, or only the adapter's), by name."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # --- forward ---------------------------------------------------------------------------------

    def _response_logits(self, model, batch: TrainBatch) -> Tensor:
        """-> [b, R, V] logits at the rows that predict each response token."""
        input_ids = batch.input_ids.to(self.device)
        positions = torch.arange(input_ids.shape[1], device=self.device)[None, :]
        attention_mask = (positions < batch.lengths.to(self.device)[:, None]).long()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self._autocast):
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)[0]
            rows = response_rows(hidden, batch.prompt_lengths, batch.response_width)
            return model.get_output_embeddings()(rows)

    @staticmethod
    def _valid(batch: TrainBatch) -> Tensor:
        """[b, R] 1.0 inside each response."""
        steps = torch.arange(batch.response_width)[None, :]
        return (steps < batch.response_lengths[:, None]).float()

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, which: Which = "policy") -> Tensor:
        if which == "reference" and self.lora.enabled:
            with self.model.disable_adapter():  # the base model is the reference
                return self._logprobs(self.model, batch)
        model = self.model if which == "policy" else self.reference
        if model is None:
            raise RuntimeError("the reference model is not loaded (ppo.kl_coef is 0)")
        return self._logprobs(model, batch)

    def _logprobs(self, model, batch: TrainBatch) -> Tensor:
        was_training = model.training
        model.eval()  # no dropout: old log-probs must be those of the deterministic policy
        out = torch.zeros(batch.size, batch.response_width)
        for group in micro_batches(batch.lengths.tolist(), self.train.micro_batch_tokens):
            micro = batch.select(group)
            logits = self._response_logits(model, micro)
            logp = token_logprobs(logits, targets_of(micro).to(self.device)).cpu()
            out[group, : micro.response_width] = logp * self._valid(micro)
        model.train(was_training)
        return out

    # --- the step --------------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, float]:
        if batch.old_logp is None or batch.advantages is None:
            raise ValueError("train_step needs old_logp and advantages (TrainBatch.with_targets)")
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        totals = accumulate_gradients(
            batch, loss_cfg, self.train.micro_batch_tokens, lambda m: self._terms(m, loss_cfg)
        )
        forward_backward_s = time.perf_counter() - started
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.ppo.grad_clip)
        if not torch.isfinite(grad_norm):
            # A nan/inf gradient would poison the weights and Adam's moments for good.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({float(grad_norm)}); step skipped")
        optimizer_started = time.perf_counter()
        self.optimizer.step()
        totals["grad_norm"] = float(grad_norm)
        totals["forward_backward_s"] = forward_backward_s
        totals["optimizer_s"] = time.perf_counter() - optimizer_started
        return totals

    def _terms(self, micro: TrainBatch, cfg: LossConfig) -> TokenTerms:
        logits = self._response_logits(self.model, micro)
        to = self.device

        def dev(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(to)

        targets = targets_of(micro).to(to)
        entropy = entropy_from_logits(logits if cfg.entropy_coef else logits.detach())
        student_topk = teacher_topk = None
        if cfg.distill_coef and micro.teacher_topk_ids is not None:
            ids = micro.teacher_topk_ids.to(to)
            student_topk = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)
            teacher_topk = micro.teacher_topk_logp.to(to)
        return TokenTerms(
            logp=token_logprobs(logits, targets),
            old_logp=dev(micro.old_logp),
            advantages=dev(micro.advantages),
            mask=micro.loss_mask.to(to),
            entropy=entropy,
            ref_logp=dev(micro.ref_logp),
            rollout_logp=dev(micro.rollout_logp),
            student_topk_logp=student_topk,
            teacher_topk_logp=teacher_topk,
            has_teacher=dev(micro.has_topk),
        )

    # --- files -----------------------------------------------------------------------------------

    def export_hf(self, path: Path) -> None:
        if self.lora.enabled:
            self._export_adapter(path)
            return
        weights = {k: v.to(self.dtype) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(path, state_dict=weights, safe_serialization=True)
        if self.dtype != torch.float32:
            config = json.loads((Path(path) / "config.json").read_text())
            config["dtype"] = str(self.dtype).removeprefix("torch.")
            (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            source = self.model_dir / name
            if source.is_file():
                shutil.copy2(source, Path(path) / name)

    def _export_adapter(self, path: Path) -> None:
        """The adapter alone (the tenant's in use), in the compute dtype, as peft writes it
        (SGLang's /load_lora_adapter reads adapter_config.json + adapter_model.safetensors)."""
        name = peft_name(self.tenant)
        weights = {key: p.detach().to(self.dtype) for key, p in self._adapter_params(name).items()}
        self.model.save_pretrained(
            path,
            state_dict=weights,
            safe_serialization=True,
            save_embedding_layers=False,
            selected_adapters=[name],
        )
        if name != SHARED_ADAPTER:  # peft writes any other adapter into a subdirectory
            for written in (Path(path) / name).iterdir():
                written.rename(Path(path) / written.name)
            (Path(path) / name).rmdir()

    def save_state(self, path: Path) -> None:
        # One torch file: exact (tied weights, optimizer moments, RNG), read back only by us.
        # With LoRA only the adapter: the frozen base is the model directory itself.
        weights = (
            {key: p.detach() for key, p in self._adapter_params(SHARED_ADAPTER).items()}
            if self.lora.enabled
            else self.model.state_dict()
        )
        state = {
            "model": weights,
            "lora": self.lora.enabled,
            "optimizer": self.optimizers[SHARED].state_dict(),
            "rng": torch.get_rng_state(),
        }
        tenants = {
            tenant: {
                "model": {
                    k: p.detach() for k, p in self._adapter_params(peft_name(tenant)).items()
                },
                "optimizer": optimizer.state_dict(),
            }
            for tenant, optimizer in self.optimizers.items()
            if tenant != SHARED
        }
        if tenants:  # per-tenant adapters; a shared-mode state stays as it was
            state["tenants"] = tenants
        if self.device.type == "cuda":  # LoRA dropout on a GPU draws from CUDA's generator
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        torch.save(state, Path(path) / "backend.pt")

    def load_state(self, path: Path) -> None:
        state = torch.load(Path(path) / "backend.pt", map_location=self.device)
        saved_lora = state.get("lora", False)
        if saved_lora != self.lora.enabled:
            kind = "a LoRA adapter" if saved_lora else "full weights"
            raise ValueError(
                f"the state in {path} holds {kind}, but lora.enabled is {self.lora.enabled}: "
                "resume with the settings it was trained with, or start a new checkpoint.dir"
            )
        if self.lora.enabled:
            self.use_adapter(SHARED)
            self._load_adapter(path, SHARED, state["model"])
            for tenant, saved in state.get("tenants", {}).items():
                self.use_adapter(tenant)  # made from the shared one, then overwritten
                self._load_adapter(path, tenant, saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
            self.use_adapter(SHARED)
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self.device)

    def _load_adapter(self, path: Path, tenant: str, weights: dict[str, Tensor]) -> None:
        loaded = self.model.load_state_dict(weights, strict=False)
        if loaded.unexpected_keys or set(weights) != set(self._adapter_params(peft_name(tenant))):
            raise ValueError(
                f"the adapter in {path} does not match [lora] target_modules "
                f"{self.lora.target_modules}: resume with the settings it was trained with"
            )


def peft_name(tenant: str) -> str:
    """The adapter's name inside the peft model: a tenant id may hold dots, which module names
    cannot."""
    if tenant == SHARED:
        return SHARED_ADAPTER
    return "t_" + hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()
