"""A prompt abandoned mid-prefill (a client that timed out) leaves its prefilled chunks in the
prefix cache, so the client's retry resumes the prefill; the answer is the uncached one. The
scheduler is stepped by hand on the tiny model, so where the abort lands is exact."""

import random

import pytest
import torch

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.engine.cpu.runner import ModelRunner
from clawrl.engine.cpu.scheduler import Scheduler
from clawrl.engine.generation import GenerationUpdate
from clawrl.engine.metrics import EngineMetrics
from clawrl.engine.protocol import GenerateRequest, Limits, generation_request, parse
from clawrl.engine.settings import EngineServerSettings

CHUNK = 16
LIMITS = Limits(
    vocab_size=49152, context_length=8192, default_max_new_tokens=8, eos_token_ids=frozenset()
)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model_dir(ModelSettings(path="smollm2-tiny")))


def scheduler(runner: ModelRunner, **settings) -> Scheduler:
    settings = {"solo_prefill_size": 0, **settings}  # chunks even when nothing decodes
    serving = EngineServerSettings(chunked_prefill_size=CHUNK, **settings)
    return Scheduler(runner, serving, EngineMetrics("tiny"), lambda ids, skip: "", "v0")


def submit(s: Scheduler, ids: list[int]) -> tuple[object, list[GenerationUpdate]]:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}  # fmt: skip
    updates: list[GenerationUpdate] = []
    request = generation_request(parse(GenerateRequest, body), None, LIMITS)
    return s.submit(request, updates.append), updates


def run_to_end(s: Scheduler, updates: list[GenerationUpdate]) -> tuple[list[int], list[float]]:
    while not (updates and updates[-1].finish is not None):
        s._step()
    ids = [i for u in updates for i in u.new_ids]
    return ids, [lp for u in updates for lp in u.new_logprobs]


@torch.inference_mode()  # as on the model thread
def test_a_retry_resumes_an_abandoned_prefill(runner):
    ids = [random.Random(5).randrange(1000, 40000) for _ in range(5 * CHUNK + 3)]
    s = scheduler(runner)
    seq, _ = submit(s, ids)
    s._step()  # admitted, first chunk
    s._step()  # second chunk
    seq.abort("client_gone")
    s._step()  # dropped: its two chunks stay in the cache
    assert s.prefix_cache.tokens == 2 * CHUNK
    retry, updates = submit(s, ids)
    got = run_to_end(s, updates)
    assert retry.cached_tokens == 2 * CHUNK
    want = run_to_end(s_ref := scheduler(runner, disable_radix_cache=True), submit(s_ref, ids)[1])
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)
