"""The Megatron backend as the trainer runs it (Ray actors in a placement group, gloo on CPU) on
the tiny SmolLM2-shaped model at TP=1 and TP=2: log-probs equal transformers', PPO steps at TP=2
equal TP=1's, the export loads in transformers and in the CPU engine with matching logits, and a
saved state resumes exactly."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from clawrl.common.models import SMOLLM2_TINY, resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import ModelRunner, read_checkpoint
from clawrl.trainer.driver import ActorGroup
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.megatron.actors import start_actors
from clawrl.trainer.megatron.nccl_sync import Engine
from clawrl.trainer.megatron.settings import MegatronSettings
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, RaySettings, TrainerSettings, TrainSettings
from tests.conftest import free_port
from tests.integration.megatron.recording_engine import recording_engines
from tests.unit.trainer.test_torch_backend import samples  # odd samples: positive reward

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))


def settings(tp: int) -> TrainerSettings:
    return TrainerSettings(
        model=ModelSettings(path=SMOLLM2_TINY),
        train=TrainSettings(backend="megatron", device="cpu", micro_batch_tokens=12),
        ppo=PPOSettings(lr=1e-3),
        ray=RaySettings(actor_num_cpus=1),
        megatron=MegatronSettings(tensor_parallel_size=tp),
    )


@pytest.fixture(scope="module")
def ray_runtime():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
async def backends(ray_runtime, model_dir) -> dict[int, ActorGroup]:
    groups = {tp: ActorGroup(start_actors(settings(tp))) for tp in (1, 2)}
    for group in groups.values():
        await group.call("load", model_dir, load_reference=False)
    return groups


def hf_logprobs(model, batch_samples: list[Sample]) -> torch.Tensor:
    """[B, R] response log-probs from a plain transformers forward of each sample alone."""
    width = max(len(s.response_ids) for s in batch_samples)
    out = torch.zeros(len(batch_samples), width)
    for i, s in enumerate(batch_samples):
        ids = torch.tensor([[*s.prompt_ids, *s.response_ids]])
        with torch.no_grad():
            full = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        p, r = len(s.prompt_ids), len(s.response_ids)
        out[i, :r] = full[torch.arange(p - 1, p + r - 1), torch.tensor(s.response_ids)]
    return out


@pytest.mark.parametrize("tp", [1, 2])
async def test_logprobs_equal_transformers(backends, model_dir, tp):
    batch = collate(samples())
    logp = await backends[tp].call("compute_logprobs", batch)
    expected = hf_logprobs(AutoModelForCausalLM.from_pretrained(model_dir), samples())
    diff = (logp - expected).abs().max().item()
    print(f"TP={tp}: max |megatron - transformers| log-prob = {diff:.2e}")
    assert diff < 2e-5
    assert await backends[tp].call("vocab_size") == 49152


async def run_steps(group: ActorGroup) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    batch = collate(samples())
    before = await group.call("compute_logprobs", batch)
    advantages = batch.reward[:, None] * batch.loss_mask
    losses = []
    for _ in range(STEPS):  # old_logp stays that of the first policy: PPO's inner epochs
        metrics = await group.call(
            "train_step", batch.with_targets(before, advantages), LossConfig()
        )
        losses.append(metrics["loss"])
    return losses, before, await group.call("compute_logprobs", batch)


async def test_ppo_steps_at_tp2_equal_tp1(backends):
    losses1, before1, after1 = await run_steps(backends[1])
    losses2, before2, after2 = await run_steps(backends[2])
    print(f"losses TP=1 {losses1}\nlosses TP=2 {losses2}")
    print(f"max |TP2 - TP1| log-prob after {STEPS} steps: {(after2 - after1).abs().max():.2e}")
    assert losses2[-1] < losses2[0]
    mask = collate(samples()).loss_mask
    delta = ((after2 - before2) * mask).sum(dim=1) / mask.sum(dim=1)
    assert (delta[[1, 3]] > 0).all(), delta  # positive advantage: its tokens became likelier
    assert (delta[[0, 2]] < 0).all(), delta
    assert torch.allclose(before2, before1, atol=2e-5)
    assert max(abs(a - b) for a, b in zip(losses1, losses2, strict=True)) < 1e-5
    assert torch.allclose(after2, after1, atol=1e-4)


async def test_export_loads_in_transformers_and_the_cpu_engine(backends, model_dir, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    await backends[2].call("export_hf", export)
    batch = collate(samples())
    trained = await backends[2].call("compute_logprobs", batch)
    exported = AutoModelForCausalLM.from_pretrained(export)
    diff = (hf_logprobs(exported, samples()) - trained).abs().max().item()
    print(f"export: max |transformers(export) - megatron| log-prob = {diff:.2e}")
    assert diff < 2e-5
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.allclose(hf_logprobs(original, samples()), trained, atol=1e-3)

    # The CPU engine: started on the export, and as a weight update of a running engine.
    prompts = [[*s.prompt_ids, *s.response_ids] for s in samples()]
    with torch.no_grad():
        expected = torch.stack([exported(torch.tensor([p])).logits[0, -1] for p in prompts])

    def engine_logits(runner: ModelRunner) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([runner.extend(None, 0, p).last_logits for p in prompts])

    assert torch.allclose(engine_logits(ModelRunner(export)), expected, atol=1e-4)
    running = ModelRunner(model_dir)
    tensors = read_checkpoint(export)
    running.check_checkpoint(tensors)
    running.load_weights(tensors)
    assert torch.allclose(engine_logits(running), expected, atol=1e-4)


async def test_state_resumes_exactly_and_only_at_the_same_tp(backends, tmp_path):
    group = backends[2]
    batch = collate(samples())
    state = tmp_path / "state"
    state.mkdir()
    await group.call("save_state", state)

    async def one_step() -> torch.Tensor:
        old = await group.call("compute_logprobs", batch)
        targets = batch.with_targets(old, batch.reward[:, None] * batch.loss_mask)
        await group.call("train_step", targets, LossConfig())
        return await group.call("compute_logprobs", batch)

    first = await one_step()
    await group.call("load_state", state)
    again = await one_step()
    assert torch.equal(first, again)
    with pytest.raises(ray.exceptions.RayTaskError, match="saved at TP=2"):
        await backends[1].call("load_state", state)


async def test_weights_broadcast_from_the_tp_shards_reach_an_engine(backends, log_dir, tmp_path):
    group = backends[2]
    with recording_engines(1, log_dir) as (url,):
        await group.call("connect_engines", [Engine(url)], "127.0.0.1", free_port(),
                         "clawrl-weights", 4 << 20)  # fmt: skip
        buckets = await group.call("broadcast_weights", 3)
        async with httpx.AsyncClient() as client:
            init, *updates = (await client.get(url + "/recorded")).json()
    assert init["body"]["world_size"] == 2 and init["body"]["backend"] == "gloo"
    assert buckets == len(updates) > 1
    assert updates[-1]["body"]["weight_version"] == "3"
    received = {n: s for c in updates for n, s in zip(c["body"]["names"], c["sums"], strict=True)}
    export = tmp_path / "export"
    export.mkdir()
    await group.call("export_hf", export)
    expected = {n: float(t.double().sum()) for n, t in read_checkpoint(export).items()}
    assert sorted(received) == sorted(expected)
    assert [received[n] for n in sorted(expected)] == pytest.approx(
        [expected[n] for n in sorted(expected)], rel=1e-9)  # fmt: skip
