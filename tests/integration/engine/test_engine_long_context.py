"""A context beyond the model's, consistent between engine and trainer: the trainer's log-probs
of what the engine sampled after a prompt longer than the model's trained context are the
engine's (PPO's ratios start at 1), and a checkpoint the trainer exports serves the same
stretched context.

The model: smollm2-tiny's shape with larger random weights (smollm2-tiny's are so small that its
outputs hardly depend on positions, so a wrong RoPE would go unseen) and a trained context of
512 tokens, served and trained at 2048 with YaRN (factor 4): the same code path as SmolLM2 at
8192 -> 16384, with a 700-token prompt instead of a 9000-token one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clawrl.common.models import SMOLLM2_TINY, context_length, resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend

from .test_engine_prefix_cache import generate, logprobs, prompt

pytestmark = pytest.mark.integration

TRAINED = 512
CONTEXT = 2048
CHUNK = 64
# float32 sums in another order (chunked prefill vs one pass).
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """smollm2-tiny's shape and tokenizer, weights 5x larger, trained context 512."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tiny = resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))
    config = AutoConfig.from_pretrained(tiny)
    config.initializer_range = 0.1
    config.max_position_embeddings = TRAINED
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("sharp-tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def url(engine_factory, model_dir) -> str:
    return engine_factory(
        str(model_dir), "--context-length", str(CONTEXT), "--chunked-prefill-size", str(CHUNK),
        "--solo-prefill-size", "0",  # chunks even with nothing decoding
    )  # fmt: skip


def trainer(model_dir: Path, context: int | None) -> TorchBackend:
    model = ModelSettings(path=str(model_dir), context_length=context)
    backend = TorchBackend(TrainSettings(), PPOSettings(), model)
    backend.load(model_dir, load_reference=False)
    return backend


@pytest.fixture(scope="module")
def sampled(url) -> Sample:
    """What the engine answers (greedy) after a prompt longer than the trained context."""
    ids = prompt(80, TRAINED + 188)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = generate(url, input_ids=ids, sampling_params=params, return_logprob=True)
    assert reply["meta_info"]["prompt_tokens"] == len(ids) > TRAINED
    return Sample(sample_id="long:0", session_id="long", prompt_ids=ids,
                  response_ids=reply["output_ids"], old_logprobs=logprobs(reply),
                  loss_mask=[1.0] * len(reply["output_ids"]), reward=1.0)  # fmt: skip


def test_the_trainer_computes_the_engines_logprobs_past_the_trained_context(
    model_dir, sampled, tmp_path
):
    engine_logp = torch.tensor(list(sampled.old_logprobs))
    n = len(engine_logp)
    batch = collate([sampled])
    stretched = trainer(model_dir, CONTEXT)
    logp = stretched.compute_logprobs(batch)[0, :n]
    assert torch.allclose(logp, engine_logp, atol=LOGPROB_TOL), (logp - engine_logp).abs().max()
    # Without the stretch the trainer would compute other log-probs (wrong PPO ratios).
    unstretched = trainer(model_dir, None).compute_logprobs(batch)[0, :n]
    assert (unstretched - engine_logp).abs().max() > 0.1

    # The export carries the stretch: an engine loading it serves the long context alike.
    stretched.export_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == CONTEXT
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["rope_parameters"]["original_max_position_embeddings"] == TRAINED
    exported = ModelSettings(path=str(tmp_path))
    assert context_length(exported, Path(tmp_path)) == CONTEXT
    runner = ModelRunner(tmp_path, context_length=context_length(exported, tmp_path))
    ids = [*sampled.prompt_ids, *sampled.response_ids]
    with torch.inference_mode():
        hidden = runner.extend(None, 0, ids[:-1]).hidden
        served, _ = runner.logprobs_of(
            hidden[len(sampled.prompt_ids) - 1 :], list(sampled.response_ids), 0
        )
    assert torch.allclose(torch.tensor(served), engine_logp, atol=LOGPROB_TOL)
