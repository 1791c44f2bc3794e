"""Per-tenant adapters in the PyTorch backend (issue 20), tiny model: a tenant's adapter starts
from the shared policy, a step of one tenant moves only its adapter, its export is a PEFT
adapter that reloads with its log-probs, and resume restores every adapter and optimizer."""

from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clawrl.common.tenants import SHARED
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend
from tests.unit.trainer.test_torch_backend import samples
from tests.unit.trainer.test_torch_backend_lora import backend, model_dir, one_thread, step

__all__ = ["model_dir", "one_thread"]  # fixtures


def logprobs_of(b: TorchBackend, tenant: str) -> torch.Tensor:
    b.use_adapter(tenant)
    return b.compute_logprobs(collate(samples()))


def test_a_tenants_step_moves_only_its_adapter(model_dir: Path) -> None:
    b = backend(model_dir)
    step(b)
    step(b)  # the shared policy is no longer the base
    shared = logprobs_of(b, SHARED)
    assert torch.equal(logprobs_of(b, "alice"), shared)  # a new tenant: the shared policy
    step(b)
    step(b)
    alice = logprobs_of(b, "alice")
    assert not torch.allclose(alice, shared, atol=1e-3)
    assert torch.equal(logprobs_of(b, SHARED), shared)
    assert torch.equal(logprobs_of(b, "bob"), shared)  # bob starts from the shared policy
    step(b)  # bob's step
    assert torch.equal(logprobs_of(b, "alice"), alice)
    assert torch.equal(logprobs_of(b, SHARED), shared)
    assert set(b.optimizers) == {SHARED, "alice", "bob"}


def test_a_tenants_export_reloads_with_its_logprobs(model_dir: Path, tmp_path: Path) -> None:
    b = backend(model_dir)
    b.use_adapter("team-1.eu")  # a dot: not a module name, so peft knows it by a hash
    step(b)
    step(b)
    b.export_hf(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    assert all(p.is_file() for p in tmp_path.iterdir())
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path)
    view = TorchBackend(TrainSettings(), PPOSettings())
    view.model = reloaded
    tenant = b.compute_logprobs(collate(samples()))
    assert torch.allclose(view.compute_logprobs(collate(samples())), tenant, atol=1e-5)
    assert not torch.allclose(logprobs_of(b, SHARED), tenant, atol=1e-3)


def test_resume_restores_every_tenant(model_dir: Path, tmp_path: Path) -> None:
    first = backend(model_dir)
    for tenant in (SHARED, "alice", "bob", "alice"):
        first.use_adapter(tenant)
        step(first)
    first.save_state(tmp_path)
    resumed = backend(model_dir)
    resumed.load_state(tmp_path)
    for tenant in (SHARED, "alice", "bob"):
        assert torch.equal(logprobs_of(resumed, tenant), logprobs_of(first, tenant))
    for b in (first, resumed):  # the optimizers' moments came back too: the next steps agree
        b.use_adapter("alice")
        step(b)
    assert torch.equal(logprobs_of(resumed, "alice"), logprobs_of(first, "alice"))
