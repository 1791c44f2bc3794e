"""While no sequence decodes, a prompt is prefilled in passes of solo_prefill_size tokens (fewer
reads of the weights); as soon as one decodes, in chunks of chunked_prefill_size again, so the
running stream keeps its pace. The answers are those of plain chunked prefill. The scheduler is
stepped by hand on the tiny model, so every pass's size is exact. Unset, the size is on in
bfloat16 only."""

import random

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.engine import CpuEngine
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.settings import SOLO_PREFILL_BF16, EngineServerSettings, EngineSettings
from tests.unit.engine.test_engine_abandoned_prefill import CHUNK, run_to_end, scheduler, submit


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")))


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


@torch.inference_mode()  # as on the model thread
def test_prompts_prefill_in_solo_passes_only_while_nothing_decodes(runner):
    s = scheduler(runner, solo_prefill_size=4 * CHUNK)
    first, first_updates = submit(s, ids(1, 10 * CHUNK))  # 4 new tokens each (submit's)
    fed = []
    for _ in range(3):
        s._step()
        fed.append(first.fed)
    assert fed == [4 * CHUNK, 8 * CHUNK, 10 * CHUNK]  # alone: solo passes
    assert s._running == [first]  # prefilled, its first token out: it decodes now
    second, second_updates = submit(s, ids(2, 8 * CHUNK))
    fed = []
    while second.fed < 8 * CHUNK:
        s._step()
        fed.append(second.fed)
    # first decodes its last 2 tokens (of 4: the prefill's and that step's came first) in 2
    # steps: chunks meanwhile, then solo passes
    assert fed == [CHUNK, 2 * CHUNK, 6 * CHUNK, 8 * CHUNK]
    got = [run_to_end(s, first_updates), run_to_end(s, second_updates)]

    reference = scheduler(runner, disable_radix_cache=True)  # chunks throughout
    for prompt, (want_ids, want_logprobs) in zip(
        (ids(1, 10 * CHUNK), ids(2, 8 * CHUNK)), got, strict=True
    ):
        ref_ids, ref_logprobs = run_to_end(reference, submit(reference, prompt)[1])
        assert want_ids == ref_ids
        assert want_logprobs == pytest.approx(ref_logprobs, abs=1e-4)


@pytest.mark.parametrize("dtype, solo", [("float32", 0), ("bfloat16", SOLO_PREFILL_BF16)])
def test_solo_passes_are_on_by_default_in_bfloat16_only(dtype, solo):
    """Unset, solo_prefill_size is SOLO_PREFILL_BF16 for a bf16 engine and off in float32 (where
    larger passes gained nothing); the engine's settings stay as given."""
    settings = EngineSettings(
        model=ModelSettings(path="smollm2-tiny"), engine=EngineServerSettings(dtype=dtype)
    )
    engine = CpuEngine(settings, EngineMetrics("tiny"))
    engine._load()
    assert engine.scheduler.settings.solo_prefill_size == solo
    assert settings.engine.solo_prefill_size is None
