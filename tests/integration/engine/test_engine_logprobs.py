"""Log-probs reported while sampling equal the prompt log-probs of the same tokens computed
by a teacher-style request (max_new_tokens 0 over prompt + response). Real model."""

from __future__ import annotations

import pytest

from .helpers import generate

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    return engine_factory(MODEL)


def prompt_logprobs(url: str, ids: list[int], start: int) -> list:
    reply = generate(
        url,
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    return reply["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_logprobs_match_teacher_prompt_logprobs(url, temperature):
    prompt = generate(
        url,
        text="<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    prompt_ids = [entry[1] for entry in prompt["meta_info"]["input_token_logprobs"]]
    sampled = generate(
        url,
        input_ids=prompt_ids,
        sampling_params={"max_new_tokens": 16, "temperature": temperature, "sampling_seed": 7},
        return_logprob=True,
    )
    response_ids = sampled["output_ids"]
    assert len(response_ids) > 0
    rollout_logp = [e[0] for e in sampled["meta_info"]["output_token_logprobs"]]

    teacher = prompt_logprobs(url, prompt_ids + response_ids, len(prompt_ids))
    assert [e[1] for e in teacher] == response_ids
    teacher_logp = [e[0] for e in teacher]
    assert teacher_logp == pytest.approx(rollout_logp, abs=2e-3)


def test_prompt_logprobs_do_not_depend_on_logprob_start_len(url):
    ids = generate(
        url,
        text="The quick brown fox jumps over the lazy dog.",
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )["meta_info"]["input_token_logprobs"]
    full = [e[0] for e in ids]
    assert full[0] is None and all(lp is not None and lp < 0 for lp in full[1:])
    tail = prompt_logprobs(url, [e[1] for e in ids], 3)
    assert [e[0] for e in tail] == pytest.approx(full[3:], abs=1e-4)
