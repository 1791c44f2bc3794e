"""Prefix cache, chunked prefill and a context beyond the model's, against real engines with the
tiny model: the reference engine keeps no cache and prefills in one pass."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings

from .helpers import metric

# Generous: on a loaded 2-core host a 9000-token prefill or 4 concurrent requests take minutes.
TIMEOUT = httpx.Timeout(900.0)


def generate(url: str, **body) -> dict:
    response = httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


pytestmark = pytest.mark.integration

CONTEXT = 16384  # twice what smollm2-tiny was trained on: RoPE scaled
BUDGET = 700  # prefix-cache tokens
CHUNK = 64
# float32 sums in another order (chunks, a cached prefix) move a log-prob of ~-11 by ~3e-4.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    return engine_factory(
        "smollm2-tiny",
        "--prefix-cache-tokens", str(BUDGET), "--chunked-prefill-size", str(CHUNK),
        "--solo-prefill-size", "0", "--context-length", str(CONTEXT),  # chunks even when alone
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(engine_factory) -> str:
    # A small KV budget, for the admission test; the other tests send one request at a time.
    return engine_factory(
        "smollm2-tiny", "--disable-radix-cache", "--chunked-prefill-size", "100000",
        "--max-total-tokens", "300",
    )  # fmt: skip


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def run(url: str, ids: list[int], max_new_tokens: int = 12, **extra) -> dict:
    return generate(
        url,
        input_ids=ids,
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0},
        return_logprob=True,
        **extra,
    )


def logprobs(reply: dict, key: str = "output_token_logprobs") -> list[float | None]:
    return [entry[0] for entry in reply["meta_info"][key]]


def assert_same_answer(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    assert logprobs(got) == pytest.approx(logprobs(want), abs=LOGPROB_TOL)


def test_a_shared_prefix_is_reused_with_the_same_output_and_logprobs(url, reference):
    ids = prompt(1)
    uncached = run(reference, ids)
    first = run(url, ids)
    assert first["meta_info"]["cached_tokens"] == 0
    assert_same_answer(first, uncached)
    again = run(url, ids)
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1  # the last one is recomputed
    assert_same_answer(again, uncached)
    # The next turn of a conversation: prompt + answer + more shares all of the first turn.
    longer = ids + first["output_ids"] + prompt(2, 30)
    turn = run(url, longer)
    assert turn["meta_info"]["cached_tokens"] >= len(ids) + len(first["output_ids"]) - 1
    assert_same_answer(turn, run(reference, longer))
    assert metric(url, "clawrl_engine_cached_prompt_tokens_total") > 0


def test_prompt_logprobs_with_a_cached_prefix_equal_uncached_ones(url, reference):
    ids = prompt(3)
    run(url, ids)  # now cached
    extra = {"logprob_start_len": 150, "top_logprobs_num": 2}
    cached = run(url, ids, **extra)
    uncached = run(reference, ids, **extra)
    # Only the prefix before the asked-for prompt positions may come from the cache.
    assert 0 < cached["meta_info"]["cached_tokens"] <= 149
    assert_same_answer(cached, uncached)
    key = "input_token_logprobs"
    assert [e[1] for e in cached["meta_info"][key]] == ids[150:]
    assert logprobs(cached, key) == pytest.approx(logprobs(uncached, key), abs=LOGPROB_TOL)


def test_least_recently_used_prefixes_are_evicted_under_the_budget(url):
    a, b, c = prompt(10, 250), prompt(11, 250), prompt(12, 250)
    run(url, a)
    run(url, b)
    run(url, b)  # b is now more recent than a
    run(url, c)  # 3 x ~260 tokens > 700: the least recently used (a) goes
    assert metric(url, "clawrl_engine_prefix_cache_tokens") <= BUDGET
    assert run(url, c)["meta_info"]["cached_tokens"] == len(c) - 1
    assert run(url, a)["meta_info"]["cached_tokens"] == 0


def test_chunked_prefill_gives_the_one_shot_results(url, reference):
    ids = prompt(20, 5 * CHUNK + 17)
    extra = {"logprob_start_len": 0}
    chunked = run(url, ids, **extra)
    one_shot = run(reference, ids, **extra)
    assert chunked["meta_info"]["cached_tokens"] == 0
    assert_same_answer(chunked, one_shot)
    key = "input_token_logprobs"
    assert logprobs(chunked, key)[0] is None
    assert logprobs(chunked, key)[1:] == pytest.approx(logprobs(one_shot, key)[1:], abs=LOGPROB_TOL)


def test_flush_empties_the_cache_and_is_refused_while_requests_run(url):
    ids = prompt(30)
    run(url, ids)
    body = {
        "input_ids": prompt(31, 20),
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    worker = threading.Thread(target=lambda: generate(url, **body))
    worker.start()
    while metric(url, "sglang:num_running_reqs") < 1 and worker.is_alive():
        time.sleep(0.01)
    busy = httpx.post(f"{url}/flush_cache", timeout=TIMEOUT)
    worker.join(timeout=120)
    assert busy.status_code == 400 and "not flushed" in busy.text
    assert run(url, ids)["meta_info"]["cached_tokens"] == len(ids) - 1  # still there
    idle = httpx.post(f"{url}/flush_cache", timeout=TIMEOUT)
    assert idle.status_code == 200 and idle.text == "Cache flushed."
    assert metric(url, "clawrl_engine_prefix_cache_tokens") == 0
    assert run(url, ids)["meta_info"]["cached_tokens"] == 0


def test_a_weight_update_invalidates_the_cache(url):
    ids = prompt(40)
    run(url, ids)
    assert run(url, ids)["meta_info"]["cached_tokens"] == len(ids) - 1
    tiny = str(resolve_model_dir(ModelSettings(path="smollm2-tiny")))
    response = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": tiny, "weight_version": "v2"},
        timeout=TIMEOUT,
    )
    assert response.json()["success"] is True
    after = run(url, ids)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_version"] == "v2"


def test_a_long_prompt_does_not_stop_a_running_stream(url):
    """A 9000-token prompt (beyond the model's trained 8192, served through RoPE scaling) is
    prefilled in chunks while a short stream keeps receiving tokens."""
    arrivals: list[tuple[float, int]] = []  # (time, tokens so far) per event
    done = threading.Event()
    short = {
        "input_ids": prompt(50, 10),
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream("POST", f"{url}/generate", json=short, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    tokens = json.loads(line[len("data: ") :])["meta_info"]["completion_tokens"]
                    arrivals.append((time.monotonic(), tokens))
                if done.is_set():
                    return  # hang up: the engine aborts the rest

    worker = threading.Thread(target=stream)
    worker.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    sent = time.monotonic()
    long_reply = run(url, prompt(51, 9000), max_new_tokens=1)
    first_token = sent + long_reply["meta_info"]["e2e_latency"]
    done.set()
    worker.join(timeout=60)
    assert long_reply["meta_info"]["prompt_tokens"] == 9000
    at_send = max(n for t, n in arrivals if t <= sent)
    at_first = max(n for t, n in arrivals if t < first_token)
    # 9000 / 64 = 141 chunks, each followed by a decode step of the short stream.
    assert at_first - at_send >= 50, (at_first - at_send, first_token - sent)


def test_requests_beyond_the_context_get_a_clear_400(url):
    info = httpx.get(f"{url}/get_server_info", timeout=TIMEOUT).json()
    assert info["context_length"] == CONTEXT
    too_long = httpx.post(
        f"{url}/generate", json={"input_ids": prompt(60, CONTEXT)}, timeout=TIMEOUT
    )
    assert too_long.status_code == 400
    assert f"the context length is {CONTEXT}" in too_long.json()["error"]["message"]
    too_much = httpx.post(
        f"{url}/generate",
        json={"input_ids": prompt(61, CONTEXT - 10), "sampling_params": {"max_new_tokens": 20}},
        timeout=TIMEOUT,
    )
    assert too_much.status_code == 400
    assert "exceeds the context length" in json.dumps(too_much.json())


def test_admission_by_kv_in_use_runs_more_requests_and_retracts_when_full(reference):
    """4 requests of 10 + 100 tokens under a 300-token KV budget: reserving max_new_tokens up
    front would run 2 at once; admitting by use runs all 4, retracts when the batch outgrows
    the budget, and every answer is still the one it gets alone."""
    bodies = [
        {
            "input_ids": prompt(70 + i, 10),
            "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True},
        }
        for i in range(4)
    ]
    alone = [generate(reference, **body)["output_ids"] for body in bodies]
    retracted = metric(reference, "clawrl_engine_retracted_requests_total", reason="kv_budget")
    replies: list = [None] * 4

    def one(i: int) -> None:
        replies[i] = generate(reference, **bodies[i])

    workers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert [reply["output_ids"] for reply in replies] == alone
    assert metric(reference, "clawrl_engine_max_decode_batch_size") == 4
    after = metric(reference, "clawrl_engine_retracted_requests_total", reason="kv_budget")
    assert after > retracted
