"""/generate on real SGLang as the project's own parsers read it: the gateway's Generation
(whole and streamed), the judge's teacher pass (SGLang's leading None, top-K), weight_version,
and the log-prob semantics the launcher asks for with SGLANG_RETURN_ORIGINAL_LOGPROB."""

from __future__ import annotations

import pytest

from clawrl.common.sglang_client import SGLangClient, sampling_params
from clawrl.gateway.generation import Generation
from clawrl.judge.teacher import teacher_from_meta, teacher_request
from tests.sglang.conftest import relative_gap

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

PROMPT = [1, 9690, 314, 260, 3458, 563, 28, 42, 216, 314]  # ids of a short prompt
TOP_K = 5


def request(max_new_tokens: int = 12, temperature: float = 0.0, **extra) -> dict:
    return {
        "input_ids": PROMPT,
        "sampling_params": sampling_params(max_new_tokens=max_new_tokens, temperature=temperature),
        "return_logprob": True,
        **extra,
    }


async def test_whole_reply_as_the_gateway_records_it(sglang_url):
    client = SGLangClient(sglang_url)
    try:
        reply = await client.generate(request())
    finally:
        await client.aclose()
    generation = Generation()
    generation.update(reply)
    assert generation.ids == reply["output_ids"]
    assert len(generation.ids) == 12
    assert len(generation.logprobs) == 12
    assert all(lp <= 0.0 for lp in generation.logprobs)
    assert generation.finish == "length"
    assert generation.prompt_tokens == len(PROMPT)
    assert generation.weight_version == "default"  # the launcher's --weight-version


async def test_streamed_reply_equals_the_whole_one(sglang_url):
    client = SGLangClient(sglang_url)
    try:
        whole = Generation()
        whole.update(await client.generate(request()))
        streamed = Generation(streamed=True)
        events = 0
        async for event in client.generate_stream(request()):
            streamed.update(event)
            events += 1
    finally:
        await client.aclose()
    assert events > 1
    assert streamed.ids == whole.ids
    assert streamed.text == whole.text
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=0.05)
    assert streamed.first_weight_version == streamed.weight_version == "default"


async def test_teacher_pass_alignment_and_top_k(sglang_url):
    """The judge's teacher request on real SGLang: entry 0 of input_token_logprobs is SGLang's
    None pad, the rest are exactly the response ids, each with a top-K row."""
    client = SGLangClient(sglang_url)
    try:
        sampled = await client.generate(request())
        response = sampled["output_ids"]
        scored = await client.generate(teacher_request(PROMPT, response, TOP_K))
    finally:
        await client.aclose()
    meta = scored["meta_info"]
    assert scored["output_ids"] == []
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["input_token_logprobs"]) == 1 + len(response)
    signal = teacher_from_meta(meta, response, TOP_K)
    assert len(signal.logprobs) == len(response)
    assert len(signal.topk_ids) == len(response) * TOP_K
    rows = [range(t * TOP_K, (t + 1) * TOP_K) for t in range(len(response))]
    for t, row in enumerate(rows):
        ids = [signal.topk_ids[i] for i in row]
        lps = [signal.topk_logprobs[i] for i in row]
        assert lps == sorted(lps, reverse=True)  # most likely first
        # The greedy token is in its row and ties the row's best: decode and prefill round
        # differently in bf16, so a near-tie (CI saw one) may swap top-1, never by more.
        assert response[t] in ids
        assert signal.logprobs[t] == pytest.approx(lps[0], abs=0.1)
    # The same tokens scored twice (decode, then prefill) agree within bf16's rounding: up to
    # 0.10 on a log-prob of -1.53 was seen here (7 %); a misaligned pass is off by whole units.
    sampled_lps = [e[0] for e in sampled["meta_info"]["output_token_logprobs"]]
    assert signal.logprobs == pytest.approx(sampled_lps, rel=0.15, abs=0.1)


async def test_sampled_logprobs_are_of_the_raw_distribution(sglang_url):
    """With SGLANG_RETURN_ORIGINAL_LOGPROB (the launcher sets it) a token sampled at
    temperature 2 reports its log-prob under the untempered model, as the teacher pass scores
    it, within bf16's decode/prefill noise; SGLang's default would report
    log softmax(logits / 2), 17-26 % off over a 16-token reply (about half of it for unlikely
    tokens)."""
    client = SGLangClient(sglang_url)
    try:
        sampled = await client.generate(request(max_new_tokens=16, temperature=2.0))
        response = sampled["output_ids"]
        scored = await client.generate(teacher_request(PROMPT, response, 0))
    finally:
        await client.aclose()
    sampled_lps = [e[0] for e in sampled["meta_info"]["output_token_logprobs"]]
    teacher = teacher_from_meta(scored["meta_info"], response, 0).logprobs
    # bf16 decode and prefill round differently: single tokens at log-probs of -5 to -11 were
    # 3.5-5 % apart in one run (1.7 % at most in two others); over the whole reply the gap is
    # ~0.5 % of the log-probs' size (0.44 % and 0.53 %), where tempered ones are 17-26 % off.
    assert sampled_lps == pytest.approx(teacher, rel=0.08, abs=0.25)
    assert relative_gap(sampled_lps, teacher) < 0.04
