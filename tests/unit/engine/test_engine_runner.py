"""The left-padded KV batch: merging and selecting rows must not change any row's logits."""

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import CheckpointError, ModelRunner, merge_kv, select_kv


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.manual_seed(0)
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")))


def alone(runner: ModelRunner, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Logits after feeding `steps` one by one to a batch of just this prompt."""
    result = runner.prefill([prompt])
    logits = result.last_logits
    for token in steps:
        logits = runner.decode(result.kv, torch.tensor([token]))
    return logits[0]


@torch.inference_mode()
def test_merged_and_selected_rows_match_unbatched_logits(runner):
    a, b, c = [5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]
    first = runner.prefill([a, b])
    second = runner.prefill([c])
    assert first.kv.width == 7 and second.kv.width == 4
    kv = merge_kv(first.kv, second.kv)
    assert kv.mask.tolist()[2] == [0, 0, 0, 1, 1, 1, 1]
    logits = runner.decode(kv, torch.tensor([40, 41, 42]))
    for row, prompt in enumerate((a, b, c)):
        expected = alone(runner, prompt, [40 + row])
        assert torch.allclose(logits[row], expected, atol=1e-4)
    # dropping row 0 (the longest) frees the columns only it used
    kv = select_kv(kv, [1, 2])
    assert kv.width == 5 and kv.mask.sum(dim=-1).tolist() == [3, 5]
    logits = runner.decode(kv, torch.tensor([50, 51]))
    assert torch.allclose(logits[0], alone(runner, b, [41, 50]), atol=1e-4)
    assert torch.allclose(logits[1], alone(runner, c, [42, 51]), atol=1e-4)


@torch.inference_mode()
def test_prompt_logprobs_match_the_next_token_distribution(runner):
    prompt = [5, 6, 7, 8]
    result = runner.prefill([prompt])
    logps, _ = runner.prompt_logprobs(result.hidden[0], prompt, 0, 0)
    assert logps[0] is None and len(logps) == 4
    prefix = runner.prefill([prompt[:3]]).last_logits[0]
    assert logps[3] == pytest.approx(float(torch.log_softmax(prefix, -1)[8]), abs=1e-4)


def test_checkpoints_must_match_names_and_shapes(runner):
    state = {name: torch.zeros(shape) for name, shape in runner.shapes.items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings: may be left out
    runner.check_checkpoint(state)
    name = next(iter(state))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        runner.check_checkpoint({**state, name: torch.zeros(3)})
    with pytest.raises(CheckpointError, match="unknown"):
        runner.check_checkpoint({**state, "extra.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="missing"):
        runner.check_checkpoint({k: v for k, v in state.items() if k != name})
