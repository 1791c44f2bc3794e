"""Concurrent requests share forward passes and get the same answers as alone. Real model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .helpers import TIMEOUT, greedy, metric

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1492, Columbus",
    "My favourite food is",
    "Water boils at",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    return engine_factory(MODEL)


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        "stream": True,
    }
    last = None
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: ") :])
    assert last is not None
    return last


def batched_steps(url: str) -> float:
    """Decode steps that carried more than one sequence so far."""
    total = metric(url, "clawrl_engine_decode_batch_size_count")
    single = metric(url, "clawrl_engine_decode_batch_size_bucket", le="1.0")
    return total - single


def test_eight_concurrent_streams_match_unbatched_greedy(url):
    alone = [greedy(url, max_new_tokens=MAX_NEW, text=p) for p in PROMPTS]
    steps_before = batched_steps(url)

    async def all_streams():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(stream_one(client, url, p) for p in PROMPTS))

    streamed = asyncio.run(all_streams())
    for single, final in zip(alone, streamed, strict=True):
        assert final["meta_info"]["finish_reason"] is not None
        assert final["output_ids"] == single["output_ids"]
        assert final["text"] == single["text"]
    assert metric(url, "clawrl_engine_max_decode_batch_size") >= 4
    assert batched_steps(url) - steps_before >= MAX_NEW - 2
