"""The Megatron backend as the trainer runs it (Ray actors, gloo on CPU) on the families beyond
Llama, loaded and exported through mbridge: a tiny random Qwen3 (QK-norm, tied embeddings) at
TP=2 and a tiny random Qwen3-MoE (4 experts, top 2) at TP=1 and at TP=2 (sequence parallel) --
log-probs equal transformers', PPO steps move the rewarded tokens' log-probs the right way and
equal the torch backend's (transformers + AdamW, in this process; so TP=2's equal TP=1's), the
export reloads in transformers and in the CPU engine with the trained log-probs, a saved state
resumes exactly; the MoE model at TP=2 without sequence parallelism is refused with the reason.
(TP=1 vs TP=2 per family: tests/integration/megatron/test_tp_equivalence.py; the backend's TP=2
steps equal TP=1's: test_megatron_backend.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.trainer.driver import ActorGroup
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.megatron.actors import check_layout, start_actors
from clawrl.trainer.megatron.layout import LayoutError
from clawrl.trainer.megatron.settings import MegatronSettings
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, RaySettings, TrainerSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend
from tests.integration.megatron.test_megatron_backend import hf_logprobs
from tests.unit.megatron.tiny import random_hf_model, tiny_configs
from tests.unit.trainer.test_torch_backend import samples as torch_backend_samples

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYOUTS = [("qwen3", 2), ("qwen3_moe", 1), ("qwen3_moe", 2)]
STEPS = 3


def samples() -> list[Sample]:
    """Four samples within the tiny vocabulary (100); odd ones rewarded, even ones punished."""
    return torch_backend_samples(vocab=100)


TRAIN = TrainSettings(backend="megatron", device="cpu", micro_batch_tokens=12)
PPO = PPOSettings(lr=1e-2)


def settings(model_dir: Path, tp: int, sequence_parallel: bool = True) -> TrainerSettings:
    return TrainerSettings(
        model=ModelSettings(path=str(model_dir)),
        train=TRAIN,
        ppo=PPO,
        ray=RaySettings(actor_num_cpus=1),
        megatron=MegatronSettings(tensor_parallel_size=tp, sequence_parallel=sequence_parallel),
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for family in ("qwen3", "qwen3_moe"):
        dirs[family] = tmp_path_factory.mktemp(family)
        random_hf_model(tiny_configs()[family]).save_pretrained(dirs[family])
    return dirs


@pytest.fixture(scope="module")
async def backends(model_dirs) -> dict[tuple[str, int], ActorGroup]:
    ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False)
    groups = {}
    for family, tp in LAYOUTS:
        groups[family, tp] = ActorGroup(start_actors(settings(model_dirs[family], tp)))
        await groups[family, tp].call("load", model_dirs[family], load_reference=False)
    yield groups
    ray.shutdown()


async def run_steps(group) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """STEPS PPO steps on the fixed batch (old log-probs those of the first policy)."""
    batch = collate(samples())
    before = await group.call("compute_logprobs", batch)
    advantages = batch.reward[:, None] * batch.loss_mask
    losses = []
    for _ in range(STEPS):
        metrics = await group.call(
            "train_step", batch.with_targets(before, advantages), LossConfig()
        )
        losses.append(metrics["loss"])
    return losses, before, await group.call("compute_logprobs", batch)


class Local:
    """The torch backend behind the same `call` as an actor group."""

    def __init__(self, model_dir: Path) -> None:
        self.backend = TorchBackend(TRAIN.model_copy(update={"backend": "torch"}), PPO)
        self.backend.load(model_dir, load_reference=False)

    async def call(self, method: str, *args, **kwargs):
        return getattr(self.backend, method)(*args, **kwargs)


async def targets_and_loss(group: ActorGroup):
    batch = collate(samples())
    old = await group.call("compute_logprobs", batch)
    return batch.with_targets(old, batch.reward[:, None] * batch.loss_mask), LossConfig()


def moved_the_right_way(before: torch.Tensor, after: torch.Tensor) -> bool:
    mask = collate(samples()).loss_mask
    delta = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
    return bool((delta[[1, 3]] > 0).all() and (delta[[0, 2]] < 0).all())


@pytest.mark.parametrize(("family", "tp"), LAYOUTS)
async def test_logprobs_equal_transformers(backends, model_dirs, family, tp):
    logp = await backends[family, tp].call("compute_logprobs", collate(samples()))
    expected = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dirs[family]), samples())
    diff = (logp - expected).abs().max().item()
    print(f"{family} TP={tp}: max |megatron - transformers| log-prob = {diff:.2e}")
    assert diff < 2e-5


@pytest.mark.parametrize(("family", "tp"), LAYOUTS)
async def test_ppo_steps_learn_and_equal_the_torch_backend(backends, model_dirs, family, tp):
    losses, before, after = await run_steps(backends[family, tp])
    ref_losses, ref_before, ref_after = await run_steps(Local(model_dirs[family]))
    print(f"{family} TP={tp} losses {losses}\ntorch backend losses {ref_losses}")
    gap = (after - ref_after).abs().max().item()
    print(f"max |megatron - torch| log-prob after {STEPS} steps: {gap:.2e}")
    assert losses[-1] < losses[0] and moved_the_right_way(before, after)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5
    assert torch.allclose(before, ref_before, atol=2e-5)
    assert torch.allclose(after, ref_after, atol=1e-4)


@pytest.mark.parametrize(("family", "tp"), LAYOUTS)
async def test_export_reloads_in_transformers_and_the_cpu_engine(
    backends, model_dirs, tmp_path, family, tp
):
    group = backends[family, tp]
    await group.call("train_step", *(await targets_and_loss(group)))
    export = tmp_path / "export"
    export.mkdir()
    await group.call("export_hf", export)
    trained = await group.call("compute_logprobs", collate(samples()))
    exported = AutoModelForCausalLM.from_pretrained(export)
    diff = (hf_logprobs(exported, samples()) - trained).abs().max().item()
    print(f"{family} export: max |transformers(export) - megatron| log-prob = {diff:.2e}")
    assert diff < 2e-5
    original = AutoModelForCausalLM.from_pretrained(model_dirs[family])
    assert not torch.allclose(hf_logprobs(original, samples()), trained, atol=1e-3)
    prompts = [[*s.prompt_ids, *s.response_ids] for s in samples()]
    runner = ModelRunner(export)
    with torch.no_grad():
        expected = torch.stack([exported(torch.tensor([p])).logits[0, -1] for p in prompts])
        served = torch.stack([runner.extend(None, 0, p).last_logits for p in prompts])
    assert torch.allclose(served, expected, atol=1e-4)


async def test_moe_state_resumes_exactly(backends, tmp_path):
    group = backends["qwen3_moe", 1]
    await group.call("save_state", tmp_path)

    async def one_step() -> torch.Tensor:
        await group.call("train_step", *(await targets_and_loss(group)))
        return await group.call("compute_logprobs", collate(samples()))

    first = await one_step()
    await group.call("load_state", tmp_path)
    assert torch.equal(first, await one_step())


def test_moe_at_tp2_without_sequence_parallel_is_refused_with_the_reason(model_dirs):
    with pytest.raises(LayoutError, match="at TP > 1 needs sequence parallelism"):
        check_layout(settings(model_dirs["qwen3_moe"], 2, False), model_dirs["qwen3_moe"])
