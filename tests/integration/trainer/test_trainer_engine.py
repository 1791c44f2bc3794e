"""The trainer against the CPU engine (tiny model): its old log-probs on unchanged weights are
those the engine recorded while sampling at temperature 0.7 / top-p 0.9 (raw distribution);
an export reloads in transformers with the same logits and the engine loads it with
/update_weights_from_disk, after which the engine's log-probs are the trainer's again."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from clawrl.common.models import SMOLLM2_TINY, resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.trainer.checkpoints import CheckpointStore
from clawrl.trainer.losses import LossConfig
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import CheckpointSettings, PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend
from tests.integration.engine.helpers import TIMEOUT, generate

pytestmark = pytest.mark.integration

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 30, 2], [1, 1041, 288, 253, 3237, 28, 2]]


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    # Its own engine: its weights are replaced here.
    return engine_factory(SMOLLM2_TINY, "--weight-version", "trainer-base")


def sampled(url: str, prompt: list[int], index: int) -> Sample:
    """A response sampled by the engine at temperature 0.7 / top-p 0.9, as the judge would
    pass it on (old_logprobs = the engine's raw log-probs)."""
    params = {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9}
    body = generate(url, input_ids=prompt, return_logprob=True, sampling_params=params)
    logprobs = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
    return Sample(sample_id=f"e:{index}", session_id="e", prompt_ids=prompt,
                  response_ids=body["output_ids"], old_logprobs=logprobs,
                  loss_mask=[1.0] * len(logprobs), reward=1.0 if index % 2 else -1.0,
                  temperature=0.7, top_p=0.9)  # fmt: skip


def engine_logprobs(url: str, sample: Sample) -> list[float]:
    """The engine's log-probs of a given response (as prompt log-probs of prompt + response)."""
    body = generate(
        url, input_ids=[*sample.prompt_ids, *sample.response_ids], return_logprob=True,
        logprob_start_len=len(sample.prompt_ids),
        sampling_params={"max_new_tokens": 1, "temperature": 0},
    )  # fmt: skip
    return [entry[0] for entry in body["meta_info"]["input_token_logprobs"]]


def mean_abs_gap(logp: torch.Tensor, samples: list[Sample], reference: list[list[float]]) -> float:
    gaps = [(logp[i, : len(ref)] - torch.tensor(ref)).abs() for i, ref in enumerate(reference)]
    return float(torch.cat(gaps).mean())


def test_old_logprobs_match_the_engine_and_exports_round_trip(url: str, tmp_path: Path) -> None:
    model_dir = resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))
    backend = TorchBackend(TrainSettings(), PPOSettings(lr=1e-3))
    backend.load(model_dir, load_reference=False)
    samples = [sampled(url, prompt, i) for i, prompt in enumerate(PROMPTS)]
    batch = collate(samples)

    old = backend.compute_logprobs(batch)
    gap = mean_abs_gap(old, samples, [list(s.old_logprobs) for s in samples])
    print(f"mean |old - rollout| on unchanged weights (smollm2-tiny, CPU engine): {gap:.2e}")
    assert gap < 1e-4  # the same raw distribution: temperature/top-p do not enter

    backend.train_step(batch.with_targets(old, batch.reward[:, None] * batch.loss_mask),
                       LossConfig())  # fmt: skip
    store = CheckpointStore(CheckpointSettings(dir=tmp_path))
    staged = store.staging("v1")
    backend.export_hf(staged)
    export = store.commit_export(staged, 1, announced=None)

    # transformers reloads it with the trainer's logits
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    ids = torch.tensor([[*samples[0].prompt_ids, *samples[0].response_ids]])
    with torch.no_grad():
        expected = backend.model(ids).logits
        assert torch.allclose(reloaded(ids).logits, expected, atol=1e-5)

    # the engine accepts it and then reports the trained policy's log-probs
    response = httpx.post(f"{url}/update_weights_from_disk", timeout=TIMEOUT,
                          json={"model_path": str(export), "weight_version": "1"})  # fmt: skip
    assert response.status_code == 200 and response.json()["success"] is True
    new = backend.compute_logprobs(batch)
    assert not torch.allclose(new, old, atol=1e-3)  # the step did change the policy
    engine_after = [engine_logprobs(url, s) for s in samples]
    assert mean_abs_gap(new, samples, engine_after) < 1e-4
