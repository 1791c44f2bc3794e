"""SGLang's native API and the OpenAI routes of the CPU engine, field by field, served by the real
SmolLM2-135M-Instruct (the assertions are about shapes and semantics, not answer quality)."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from tests.conftest import wait_until

from .helpers import TIMEOUT, generate, greedy, metric, stream_events

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version"}


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    return engine_factory(MODEL)


def test_health(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=TIMEOUT).status_code == 200


def test_generate_text_reply_shape(url):
    reply = greedy(url, max_new_tokens=5, text=PROMPT)
    assert isinstance(reply["text"], str)
    assert len(reply["output_ids"]) == 5
    meta = reply["meta_info"]
    assert META_KEYS <= set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in meta


def test_input_ids_and_text_give_the_same_greedy_answer(url):
    by_text = greedy(url, text=PROMPT)
    ids = httpx.post(
        f"{url}/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}},
        timeout=TIMEOUT,
    ).json()
    prompt_tokens = ids["meta_info"]["prompt_tokens"]
    assert prompt_tokens == by_text["meta_info"]["prompt_tokens"]
    full = greedy(url, text=PROMPT, return_logprob=True, logprob_start_len=0)
    input_ids = [entry[1] for entry in full["meta_info"]["input_token_logprobs"]]
    assert len(input_ids) == prompt_tokens
    assert greedy(url, input_ids=input_ids)["output_ids"] == by_text["output_ids"]


def test_logprob_fields(url):
    reply = greedy(
        url,
        max_new_tokens=4,
        input_ids=[1, 504, 3458, 282, 4649, 314],
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = reply["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inputs] == [1, 504, 3458, 282, 4649, 314]
    assert inputs[0] == [None, 1, None]  # no log-prob for the first token, as in SGLang
    assert all(isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in inputs[1:])
    assert [e[1] for e in outputs] == reply["output_ids"]
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 3 for top in meta["input_top_logprobs"][1:])
    assert len(meta["output_top_logprobs"]) == 4
    for entry, top in zip(outputs, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3
        assert top[0][0] >= top[1][0] >= top[2][0]
        assert entry[1] == top[0][1]  # greedy picks the most likely token
        assert entry[0] == pytest.approx(top[0][0])


def test_logprob_start_len_and_defaults(url):
    ids = [1, 504, 3458, 282, 4649, 314]
    reply = greedy(url, input_ids=ids, return_logprob=True, logprob_start_len=4)
    assert [e[1] for e in reply["meta_info"]["input_token_logprobs"]] == ids[4:]
    default = greedy(url, input_ids=ids, return_logprob=True)
    assert default["meta_info"]["input_token_logprobs"] == []  # SGLang: output log-probs only
    assert "input_top_logprobs" not in default["meta_info"]
    texts = greedy(url, input_ids=ids, return_logprob=True, return_text_in_logprobs=True)
    assert all(isinstance(e[2], str) for e in texts["meta_info"]["output_token_logprobs"])


def test_max_new_tokens_zero_returns_prompt_logprobs_only(url):
    ids = [1, 504, 3458, 282]
    reply = generate(
        url,
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert reply["output_ids"] == [] and reply["text"] == ""
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert meta["output_token_logprobs"] == []


def test_stream_events_are_cumulative_and_end_with_done(url):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    events = stream_events(url, **body, return_logprob=True)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(last["meta_info"]["output_token_logprobs"]) == 6
    whole = greedy(url, max_new_tokens=6, text=PROMPT)
    assert last["output_ids"] == whole["output_ids"]
    assert last["text"] == whole["text"]


def test_stop_token_ids_and_stop_strings(url):
    base = greedy(url, max_new_tokens=8, text=PROMPT)
    ids = base["output_ids"]
    stop_id = ids[2]
    first = ids.index(stop_id)
    stopped = greedy(
        url, max_new_tokens=8, text=PROMPT, sampling_params={"stop_token_ids": [stop_id]}
    )
    assert stopped["output_ids"] == ids[: first + 1]  # the matched token is kept in the ids
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # A stop string from the first few tokens' text, so it is met well before the length limit
    # (which SGLang checks first).
    stop = greedy(url, max_new_tokens=3, text=PROMPT)["text"][-3:]
    by_string = greedy(url, max_new_tokens=8, text=PROMPT, sampling_params={"stop": [stop]})
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_string["text"] == base["text"][: base["text"].find(stop)]


def test_seeded_sampling_is_reproducible(url):
    def sample(seed: int, key: str = "sampling_seed") -> list[int]:
        params = {"max_new_tokens": 8, "temperature": 1.0, key: seed}
        return generate(url, text=PROMPT, sampling_params=params)["output_ids"]

    assert sample(1) == sample(1) == sample(1, key="seed")
    assert sample(1) != sample(2)


@pytest.mark.parametrize(
    "body",
    [
        {"sampling_params": {"max_new_tokens": 1}},
        {"text": "", "sampling_params": {"max_new_tokens": 1}},
        {"input_ids": []},
        {"text": "a", "input_ids": [1]},
        {"input_ids": [1, 49152]},
        {"input_ids": ["x"]},
        {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 8190}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [1], "sampling_params": {"top_k": -5}},
    ],
)
def test_bad_input_is_a_400_with_a_message(url, body):
    before = metric(url, "clawrl_engine_rejected_requests_total", reason="invalid")
    response = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert metric(url, "clawrl_engine_rejected_requests_total", reason="invalid") == before + 1


def test_malformed_json_is_a_400(url):
    response = httpx.post(f"{url}/generate", content=b"{not json", timeout=TIMEOUT)
    assert response.status_code == 400


def test_model_and_server_info(url):
    info = httpx.get(f"{url}/get_model_info").json()
    assert info["is_generation"] is True
    assert info["model_path"].endswith(MODEL)
    assert info["tokenizer_path"]
    assert info["weight_version"] == "default"
    server = httpx.get(f"{url}/get_server_info").json()
    assert server["weight_version"] == "default" and server["context_length"] == 8192


def test_flush_cache(url):
    assert httpx.get(f"{url}/flush_cache").status_code == 200
    assert httpx.post(f"{url}/flush_cache").status_code == 200


def test_pause_in_place_holds_requests_until_continue(url):
    assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    result: dict = {}
    try:
        worker = threading.Thread(
            target=lambda: result.update(greedy(url, max_new_tokens=3, text=PROMPT))
        )
        worker.start()
        # Queued (waited for: a loaded host may be slow to send it), then held there.
        wait_until(lambda: metric(url, "sglang:num_queue_reqs") >= 1, 30, "the request queued")
        time.sleep(0.5)  # 3 tokens take far less when not paused
        assert not result
        assert metric(url, "sglang:num_queue_reqs") == 1
        assert httpx.get(f"{url}/health_generate").status_code == 200  # no probe while paused
    finally:
        assert httpx.post(f"{url}/continue_generation", json={}).status_code == 200
    worker.join(timeout=30)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_pause_abort_ends_running_requests(url):
    result: dict = {}
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: result.update(generate(url, **body)))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while metric(url, "sglang:num_running_reqs") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).status_code == 200
        worker.join(timeout=30)
    finally:
        httpx.post(f"{url}/continue_generation")
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < result["meta_info"]["completion_tokens"] < 4000


def test_metrics_use_sglang_names_and_labels(url):
    greedy(url, max_new_tokens=2, text=PROMPT)
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:gen_throughput",
        "sglang:token_usage",
    ):
        assert f"{name}{{" in text and f'model_name="{MODEL}"' in text, name
    assert metric(url, "sglang:generation_tokens_total", model_name=MODEL) > 0
    for name in ("rejected_requests", "weight_updates", "max_decode_batch_size"):
        assert f"# TYPE clawrl_engine_{name}" in text
    # The model and torch were frozen out of garbage collection once loaded.
    assert metric(url, "clawrl_engine_gc_frozen_objects") > 100_000
    assert "clawrl_engine_gc_pause_seconds_total{" in text


def test_openai_models_and_chat(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    messages = [{"role": "user", "content": "Say hi"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5
    assert len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_rejects_bad_messages(url):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=TIMEOUT)
    assert response.status_code == 400
    assert response.json()["error"]["message"]


def test_full_queue_is_a_503(engine_factory):
    url = engine_factory("smollm2-tiny", "--max-queued-requests", "1")
    httpx.post(f"{url}/pause_generation", json={"mode": "in_place"})
    try:
        first = threading.Thread(target=lambda: greedy(url, max_new_tokens=1, text=PROMPT))
        first.start()
        deadline = time.monotonic() + 10
        while metric(url, "sglang:num_queue_reqs") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        response = httpx.post(
            f"{url}/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        )
        assert response.status_code == 503
        assert "overloaded" in response.json()["error"]["message"]
        assert metric(url, "clawrl_engine_rejected_requests_total", reason="queue_full") == 1
    finally:
        httpx.post(f"{url}/continue_generation")
    first.join(timeout=30)


def test_a_client_leaving_a_stream_aborts_its_request(url):
    before = metric(url, "clawrl_engine_aborted_requests_total", reason="client_gone")
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first event

    def aborted() -> float:
        return metric(url, "clawrl_engine_aborted_requests_total", reason="client_gone")

    deadline = time.monotonic() + 30
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == before + 1
    assert metric(url, "sglang:num_running_reqs") == 0
