"""The PyTorch backend on the tiny model: log-probs equal a plain HF forward whatever the
padding and micro-batching, gradient accumulation equals one big batch, state round-trips."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.common.models import SMOLLM2_TINY, resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.trainer.backend import TrainerBackend
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))


def samples(vocab: int = 49152) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(5, 3), (2, 7), (9, 1), (4, 4)]):
        ids = torch.randint(0, vocab, (p + r,), generator=gen).tolist()
        out.append(Sample(sample_id=f"s:{i}", session_id="s", prompt_ids=ids[:p],
                          response_ids=ids[p:], old_logprobs=[-1.0] * r, loss_mask=[1.0] * r,
                          reward=1.0 if i % 2 else -1.0))  # fmt: skip
    return out


def backend(model_dir: Path, micro_batch_tokens: int = 4096) -> TorchBackend:
    b = TorchBackend(TrainSettings(micro_batch_tokens=micro_batch_tokens), PPOSettings(lr=1e-3))
    b.load(model_dir, load_reference=False)
    return b


def test_logprobs_equal_a_plain_forward(model_dir: Path) -> None:
    b = backend(model_dir, micro_batch_tokens=12)  # several micro-batches, padded
    assert isinstance(b, TrainerBackend)
    batch = collate(samples())
    logp = b.compute_logprobs(batch)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    for i, s in enumerate(samples()):
        ids = torch.tensor([[*s.prompt_ids, *s.response_ids]])
        with torch.no_grad():
            full = torch.log_softmax(reference(ids).logits[0], dim=-1)
        p, r = len(s.prompt_ids), len(s.response_ids)
        expected = full[torch.arange(p - 1, p + r - 1), torch.tensor(s.response_ids)]
        assert torch.allclose(logp[i, :r], expected, atol=1e-5)
        assert logp[i, r:].abs().sum() == 0.0


def step(b: TorchBackend) -> torch.Tensor:
    batch = collate(samples())
    old = b.compute_logprobs(batch)
    advantages = batch.reward[:, None] * batch.loss_mask
    b.train_step(batch.with_targets(old, advantages), LossConfig())
    return b.compute_logprobs(batch)


def test_gradient_accumulation_equals_one_batch(model_dir: Path) -> None:
    whole = step(backend(model_dir))
    accumulated = step(backend(model_dir, micro_batch_tokens=10))
    assert torch.allclose(whole, accumulated, atol=1e-4)


def test_a_step_moves_log_probs_with_the_advantage_sign(model_dir: Path) -> None:
    b = backend(model_dir)
    before = b.compute_logprobs(collate(samples()))
    after = step(b)
    mask = collate(samples()).loss_mask
    delta = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
    assert (delta[[1, 3]] > 0).all() and (delta[[0, 2]] < 0).all()


def test_state_round_trip_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    first = backend(model_dir)
    step(first)
    first.save_state(tmp_path)
    expected = step(first)
    resumed = backend(model_dir)
    resumed.load_state(tmp_path)
    assert torch.equal(step(resumed), expected)  # same weights, same Adam moments


def test_export_reloads_with_the_same_logits(model_dir: Path, tmp_path: Path) -> None:
    b = backend(model_dir)
    step(b)
    b.export_hf(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = collate(samples())
    assert torch.allclose(b.compute_logprobs(batch), TorchBackendView(reloaded).logp(batch))


class TorchBackendView(TorchBackend):
    """The backend's log-prob path over an already loaded model."""

    def __init__(self, model) -> None:
        super().__init__(TrainSettings(), PPOSettings())
        self.model = model

    def logp(self, batch):
        return self.compute_logprobs(batch)
