"""The PyTorch backend with `[lora] enabled` on the tiny model: only the adapter trains, the KL
reference is the base with the adapter off, an export is a PEFT adapter that transformers + peft
reload with the trainer's log-probs, resume is exact, and the Megatron backend refuses LoRA."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clawrl.common.models import SMOLLM2_TINY, resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.megatron.actors import start_actors
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import LoraSettings, PPOSettings, TrainerSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend
from tests.unit.trainer.test_torch_backend import samples

LORA = LoraSettings(enabled=True, rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny model's steps are ~0.2 s on one thread; two threads on a busy 2-core host spin
    # against each other (seconds a step). Put torch's setting back for the next tests.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def backend(model_dir: Path, lora: LoraSettings = LORA, **train) -> TorchBackend:
    b = TorchBackend(TrainSettings(num_threads=1, **train), PPOSettings(lr=1e-2), lora=lora)
    b.load(model_dir, load_reference=False)
    return b


def step(b: TorchBackend) -> dict[str, float]:
    batch = collate(samples())
    old = b.compute_logprobs(batch)
    advantages = batch.reward[:, None] * batch.loss_mask
    return b.train_step(batch.with_targets(old, advantages), LossConfig())


def adapter_weights(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.model.named_parameters() if "lora_" in k}


def base_logprobs(model_dir: Path) -> torch.Tensor:
    return backend(model_dir, lora=LoraSettings()).compute_logprobs(collate(samples()))


def test_only_the_adapter_trains(model_dir: Path) -> None:
    b = backend(model_dir)
    adapter = adapter_weights(b)
    # r=4 on the seven projections of 2 layers (hidden 64, kv 32 wide, MLP 256 wide).
    assert len(adapter) == 2 * 7 * 2
    stepped = {id(p) for group in b.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for k, p in b.model.named_parameters() if "lora_" in k}
    base = {k: v.clone() for k, v in b.model.state_dict().items() if "lora_" not in k}
    step(b)
    step(b)  # the first step only moves lora_B (it starts at 0, so lora_A's gradient is 0)
    assert all(not torch.equal(v, adapter[k]) for k, v in adapter_weights(b).items())
    assert all(torch.equal(v, base[k]) for k, v in b.model.state_dict().items() if k in base)


def test_a_lora_step_moves_log_probs_with_the_advantage_sign(model_dir: Path) -> None:
    b = backend(model_dir)
    batch = collate(samples())
    before = b.compute_logprobs(batch)
    assert torch.allclose(before, base_logprobs(model_dir), atol=1e-6)  # B = 0: the base model
    step(b)
    after = b.compute_logprobs(batch)
    delta = ((after - before) * batch.loss_mask).sum(dim=1) / batch.loss_mask.sum(dim=1)
    assert (delta[[1, 3]] > 0).all() and (delta[[0, 2]] < 0).all()


def test_the_reference_is_the_base_model_with_the_adapter_off(model_dir: Path) -> None:
    b = backend(model_dir)
    step(b)
    step(b)
    batch = collate(samples())
    base = base_logprobs(model_dir)
    assert torch.allclose(b.compute_logprobs(batch, "reference"), base, atol=1e-6)
    assert not torch.allclose(b.compute_logprobs(batch), base, atol=1e-3)  # adapter on again
    assert b.reference is None  # no second copy of the base


def test_the_export_is_a_peft_adapter_that_reloads_with_the_same_logprobs(
    model_dir: Path, tmp_path: Path
) -> None:
    b = backend(model_dir)
    step(b)
    step(b)
    b.export_hf(tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert not (tmp_path / "model.safetensors").exists()  # the adapter only, not the base
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    assert config["base_model_name_or_path"] == str(model_dir)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path)
    batch = collate(samples())
    view = TorchBackend(TrainSettings(), PPOSettings())
    view.model = reloaded
    expected = b.compute_logprobs(batch)
    assert torch.allclose(view.compute_logprobs(batch), expected, atol=1e-5)
    assert not torch.allclose(expected, base_logprobs(model_dir), atol=1e-3)


def test_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    lora = LoraSettings(enabled=True, rank=4, alpha=8, dropout=0.2)  # dropout draws the RNG
    first = backend(model_dir, lora, micro_batch_tokens=12)  # accumulation over micro-batches
    for _ in range(2):
        step(first)
    first.save_state(tmp_path)
    assert (tmp_path / "backend.pt").stat().st_size < 1_000_000  # the adapter, not the base
    expected = [step(first) for _ in range(3)]
    resumed = backend(model_dir, lora, micro_batch_tokens=12)
    resumed.load_state(tmp_path)
    figures = [step(resumed) for _ in range(3)]
    drop = {"forward_backward_s", "optimizer_s"}  # wall-clock times
    assert [{k: v for k, v in f.items() if k not in drop} for f in figures] == [
        {k: v for k, v in f.items() if k not in drop} for f in expected
    ]
    want = adapter_weights(first)
    assert all(torch.equal(v, want[k]) for k, v in adapter_weights(resumed).items())


def test_a_state_of_the_other_kind_is_refused(model_dir: Path, tmp_path: Path) -> None:
    backend(model_dir).save_state(tmp_path)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter, but lora\.enabled is False"):
        backend(model_dir, lora=LoraSettings()).load_state(tmp_path)
    other = LoraSettings(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="does not match"):
        backend(model_dir, lora=other).load_state(tmp_path)


def test_megatron_refuses_lora_at_start() -> None:
    settings = TrainerSettings(train={"backend": "megatron"}, lora={"enabled": True})
    with pytest.raises(ValueError, match="Megatron-core has no LoRA of its own"):
        start_actors(settings)  # before any actor or placement group is asked for


def test_lora_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_LORA__ENABLED", "true")
    monkeypatch.setenv("CLAWRL_LORA__TARGET_MODULES", '["q_proj", "v_proj"]')
    lora = TrainerSettings().lora
    assert lora.enabled and (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert lora.target_modules == ["q_proj", "v_proj"]
    monkeypatch.delenv("CLAWRL_LORA__TARGET_MODULES")
    assert TrainerSettings().lora.target_modules == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]  # fmt: skip
