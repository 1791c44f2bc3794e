"""Validation of /generate and chat bodies into GenerationRequests."""

import pytest

from clawrl.engine.protocol import (
    ChatCompletionRequest,
    GenerateRequest,
    Limits,
    RequestError,
    chat_generation_request,
    generation_request,
    parse,
)

LIMITS = Limits(
    vocab_size=100, context_length=32, default_max_new_tokens=8, eos_token_ids=frozenset({2})
)


def tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def build(body: dict):
    return generation_request(parse(GenerateRequest, body), tokenize, LIMITS)


def test_input_ids_and_sglang_sampling_fields():
    req = build(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 5,
                "stop": "x",
                "stop_token_ids": [9],
                "sampling_seed": 11,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "stream": True,
        }
    )
    assert req.input_ids == [1, 2, 3]
    assert req.max_new_tokens == 4
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (0.5, 0.9, 5)
    assert req.stop.stop_strings == ("x",)
    assert req.stop.stop_token_ids == {9}
    assert req.stop.eos_token_ids == {2}
    assert req.seed == 11
    assert (req.logprob_start_len, req.top_logprobs_num, req.stream) == (0, 3, True)


def test_seed_is_an_alias_of_sampling_seed():
    assert build({"input_ids": [1], "sampling_params": {"seed": 5}}).seed == 5


def test_text_is_tokenized_and_max_new_tokens_defaults():
    req = build({"text": "ab"})
    assert req.input_ids == tokenize("ab")
    assert req.max_new_tokens == 8


def test_default_max_new_tokens_is_clamped_to_the_context():
    req = build({"input_ids": list(range(28))})
    assert req.max_new_tokens == 4


def test_logprob_fields_are_ignored_without_return_logprob():
    req = build({"input_ids": [1], "logprob_start_len": 0, "top_logprobs_num": 2})
    assert (req.logprob_start_len, req.top_logprobs_num) == (-1, 0)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "exactly one"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"text": ""}, "empty"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, 100]}, "vocabulary"),
        ({"input_ids": [-1]}, "vocabulary"),
        ({"input_ids": ["a"]}, "input_ids.0"),
        ({"input_ids": [1.5]}, "input_ids.0"),
        ({"text": ["a", "b"]}, "text"),
        ({"input_ids": [1] * 30, "sampling_params": {"max_new_tokens": 3}}, "context length"),
        ({"input_ids": [1] * 32}, "context length"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"max_new_token": 3}}, "max_new_token"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "n is not supported"),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop strings"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [500]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "beyond"),
        ({"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len"),
        ({"input_ids": [1], "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(body, message):
    with pytest.raises(RequestError, match=message):
        build(body)


def test_a_non_object_body_is_refused():
    with pytest.raises(RequestError, match="JSON object"):
        parse(GenerateRequest, [1, 2])


def test_chat_request_maps_openai_fields():
    body = parse(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "seed": 3,
            "stop": ["\n"],
        },
    )
    req = chat_generation_request(body, [1, 2, 3], LIMITS)
    assert req.max_new_tokens == 5
    assert req.sampling.greedy
    assert (req.return_logprob, req.top_logprobs_num, req.seed) == (True, 2, 3)
    assert req.stop.stop_strings == ("\n",)


def test_chat_without_max_tokens_may_use_the_rest_of_the_context():
    body = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert chat_generation_request(body, [1] * 10, LIMITS).max_new_tokens == 22


def test_chat_refuses_n_and_empty_messages():
    with pytest.raises(RequestError, match="n must be 1"):
        chat_generation_request(
            parse(ChatCompletionRequest, {"messages": [{"role": "user"}], "n": 2}), [1], LIMITS
        )
    with pytest.raises(RequestError, match="messages"):
        parse(ChatCompletionRequest, {"messages": []})


def test_weight_broadcast_bodies_use_sglang_names_and_are_checked():
    from clawrl.engine.protocol import (
        InitWeightsUpdateGroupRequest,
        UpdateWeightsFromDistributedRequest,
    )

    init = parse(InitWeightsUpdateGroupRequest, {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "g", "backend": "gloo"})  # fmt: skip
    assert (init.rank_offset, init.world_size, init.backend) == (1, 3, "gloo")
    update = parse(UpdateWeightsFromDistributedRequest, {
        "names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2], [3, 4]],
        "group_name": "g", "weight_version": "7", "flush_cache": True})  # fmt: skip
    assert (update.names, update.weight_version) == (["a", "b"], "7")
    with pytest.raises(RequestError, match="same length"):
        parse(UpdateWeightsFromDistributedRequest, {"names": ["a"], "dtypes": [], "shapes": []})
    # A dtype the engine cannot receive is the engine's to refuse, with SGLang's reply shape
    # (success false), not a parse error: the body itself is valid.
    odd = parse(UpdateWeightsFromDistributedRequest,
                {"names": ["a"], "dtypes": ["int8"], "shapes": [[1]]})  # fmt: skip
    assert odd.dtypes == ["int8"]
    with pytest.raises(RequestError, match="rank_offset"):
        parse(InitWeightsUpdateGroupRequest, {"master_address": "h", "master_port": 1,
                                              "rank_offset": 0, "world_size": 2})  # fmt: skip
