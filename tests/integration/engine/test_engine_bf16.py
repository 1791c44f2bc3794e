"""The CPU engine served in bfloat16 (`--dtype bfloat16`) keeps its contracts over HTTP, to bf16's
precision: a cached prefix and a chunked prefill give what one uncached pass gives, sampled
log-probs are the engine's own teacher-forced prompt log-probs, an abort frees the batch, and
the reply's log-probs are float32 numbers of the raw distribution. Tiny model, real engines."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.conftest import wait_until

from .helpers import TIMEOUT, metric

pytestmark = pytest.mark.integration

CHUNK = 64
# The tiny model's bf16 log-probs move by up to ~2e-3 between a chunked or cached prefill and
# one pass (bf16 sums in another order); float32's tolerance for the same is 1e-3.
LOGPROB_TOL = 0.02


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    return engine_factory(
        "smollm2-tiny", "--dtype", "bfloat16", "--chunked-prefill-size", str(CHUNK),
        "--solo-prefill-size", "0",  # chunks even with nothing decoding
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(engine_factory) -> str:
    return engine_factory(
        "smollm2-tiny",
        "--dtype",
        "bfloat16",
        "--disable-radix-cache",
        "--chunked-prefill-size",
        "100000",
    )


def run(url: str, ids: list[int], max_new_tokens: int = 12, **extra) -> dict:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        **extra,
    }
    response = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(reply: dict, key: str = "output_token_logprobs") -> list[float | None]:
    return [entry[0] for entry in reply["meta_info"][key]]


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_a_cached_prefix_and_a_chunked_prefill_give_the_one_pass_answer(url, reference):
    ids = prompt(1, 3 * CHUNK + 17)
    extra = {"logprob_start_len": 0}
    one_pass = run(reference, ids, **extra)
    chunked = run(url, ids, **extra)
    assert chunked["meta_info"]["cached_tokens"] == 0
    again = run(url, ids)
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    for got in (chunked, again):
        assert got["output_ids"] == one_pass["output_ids"]
        assert logprobs(got) == pytest.approx(logprobs(one_pass), abs=LOGPROB_TOL)
        assert all(isinstance(lp, float) for lp in logprobs(got))
    key = "input_token_logprobs"
    assert logprobs(chunked, key)[1:] == pytest.approx(logprobs(one_pass, key)[1:], abs=LOGPROB_TOL)


def test_sampled_logprobs_are_the_engines_own_teacher_forced_ones(url):
    ids = prompt(2, 40)
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": params}
    sampled = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT).json()
    full = ids + sampled["output_ids"]
    teacher = run(url, full, max_new_tokens=0, logprob_start_len=len(ids))
    assert logprobs(teacher, "input_token_logprobs") == pytest.approx(
        logprobs(sampled), abs=LOGPROB_TOL
    )


def test_an_aborted_stream_leaves_the_batch_and_the_next_request_is_served(url):
    body = {
        "input_ids": prompt(3, 30),
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }

    def gone() -> float:
        return metric(url, "clawrl_engine_aborted_requests_total", reason="client_gone")

    before = gone()
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # hang up after the first event
    wait_until(lambda: gone() > before, 60, "the abort")
    assert metric(url, "sglang:num_running_reqs") == 0
    reply = run(url, prompt(4, 20), max_new_tokens=4)
    assert len(reply["output_ids"]) == 4
