"""/update_weights_from_disk: new weights change the answers and the reported version; a bad
checkpoint is refused and the old weights keep serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings

from .helpers import TIMEOUT, generate, greedy, metric

pytestmark = pytest.mark.integration

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def url(engine_factory) -> str:
    # Its own engine (weights change here), started at weight_version "0".
    return engine_factory("smollm2-tiny", "--weight-version", "0")


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(
        str(resolve_model_dir(ModelSettings(path="smollm2-tiny")) / "model.safetensors")
    )


def save(tmp_path, name: str, tensors: dict[str, torch.Tensor]) -> str:
    folder = tmp_path / name
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def update(url: str, model_path: str, version: str | None = None) -> httpx.Response:
    body = {"model_path": model_path, "flush_cache": True}
    if version is not None:
        body["weight_version"] = version
    return httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=TIMEOUT)


def answer(url: str) -> dict:
    return greedy(url, max_new_tokens=8, input_ids=PROMPT_IDS)


def test_update_bad_checkpoints_and_restore(url, original, tmp_path):
    before = answer(url)
    assert before["meta_info"]["weight_version"] == "0"

    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in original.items()
    }
    response = update(url, save(tmp_path, "v1", perturbed), "1")
    assert response.status_code == 200
    body = response.json()
    assert body["success"] is True and body["message"]
    assert body["num_paused_requests"] == 0

    after = answer(url)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "1"
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "1"

    # A path with no checkpoint: refused, v1 keeps serving.
    failures = metric(url, "clawrl_engine_weight_updates_total", result="failure")
    response = update(url, str(tmp_path / "nowhere"), "2")
    assert response.status_code == 400
    assert response.json()["success"] is False
    assert "nowhere" in response.json()["message"]

    # Right names, one wrong shape: refused before anything is copied.
    name = next(iter(original))
    mismatched = {**perturbed, name: torch.zeros(3, 3)}
    response = update(url, save(tmp_path, "bad-shape", mismatched), "2")
    assert response.status_code == 400
    assert response.json()["success"] is False
    assert "shape" in response.json()["message"]
    assert metric(url, "clawrl_engine_weight_updates_total", result="failure") == failures + 2

    still = answer(url)
    assert still["output_ids"] == after["output_ids"]
    assert still["meta_info"]["weight_version"] == "1"
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "1"

    # The original weights back: the original answer back, exactly.
    response = update(url, save(tmp_path, "v0", original), "2")
    assert response.json()["success"] is True
    restored = answer(url)
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["weight_version"] == "2"


def current_version(url: str) -> str:
    return httpx.get(f"{url}/get_model_info", timeout=TIMEOUT).json()["weight_version"]


def perturbed(original: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in original.items()
    }


LONG = 300  # tokens: long enough that the update surely arrives mid-generation


def long_body(input_ids: list[int], max_new_tokens: int = LONG) -> dict:
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }


def test_an_update_waits_for_the_running_generation(url, original, tmp_path):
    """Different weights arrive mid-generation: the generation finishes on the weights it
    started with and reports their version; the update is applied after it, and then serves."""
    # Long: on a loaded host a 300-token generation could end between the test seeing it run
    # and its update being sent.
    length = 4 * LONG
    old_version = current_version(url)
    alone = generate(url, **long_body(PROMPT_IDS, length))  # the old weights' answer, alone
    new_weights = save(tmp_path, "w", perturbed(original, 1))
    result: dict = {}

    def run() -> None:
        result["reply"] = generate(url, **long_body(PROMPT_IDS, length))
        result["done_at"] = time.monotonic()

    worker = threading.Thread(target=run)
    worker.start()
    while metric(url, "sglang:num_running_reqs") < 1 and worker.is_alive():
        time.sleep(0.01)
    posted_at = time.monotonic()
    response = update(url, new_weights, "new")
    # Applied after it: nothing ran on the engine when it answered. (Asked of the engine: the
    # two replies' arrival times here can swap by a few ms on a loaded host.)
    [state] = httpx.get(f"{url}/get_server_info", timeout=TIMEOUT).json()["internal_states"]
    worker.join(timeout=120)
    assert response.json() == {
        "success": True,
        "message": response.json()["message"],
        "num_paused_requests": 0,
    }
    assert posted_at < result["done_at"]  # asked during it
    assert state["num_running_reqs"] == 0
    reply = result["reply"]
    assert reply["meta_info"]["weight_version"] == old_version
    assert reply["output_ids"] == alone["output_ids"]
    after = answer(url)
    assert after["meta_info"]["weight_version"] == "new"
    assert after["output_ids"] != answer_of(alone)


def answer_of(reply: dict) -> list[int]:
    return reply["output_ids"][:8]


def test_an_update_while_paused_retracts_and_reprefills(url, original, tmp_path):
    """Paused (retract) mid-stream, updated, continued: the tokens before the pause are the
    old weights', every token after is what the new weights produce from there, and the reply
    reports the new version.

    Compared by log-probs, not only tokens: greedy decoding of this tiny random model falls into
    a one-token loop that other weights continue too, so tokens alone cannot tell who made them.
    """
    # Long, and paused at the first streamed token: on a fast idle host a 300-token generation
    # had run to its end before the pause reached the engine.
    length = 4 * LONG
    alone = generate(url, **logprob_body(PROMPT_IDS, length))
    new_weights = save(tmp_path, "r", perturbed(original, 2))
    body = {**logprob_body(PROMPT_IDS, length), "stream": True}
    last = None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                last = json.loads(line[len("data: ") :])
                if last["output_ids"]:
                    break
        seen = len(last["output_ids"])
        httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=TIMEOUT)
        response = update(url, new_weights, "retracted")
        httpx.post(f"{url}/continue_generation", timeout=TIMEOUT)
        for line in lines:
            if line.startswith("data: {"):
                last = json.loads(line[len("data: ") :])
    assert response.json()["success"] is True
    assert response.json()["num_paused_requests"] == 1
    out, made = last["output_ids"], logprobs_of(last)
    assert len(out) == len(made) == length
    assert last["meta_info"]["weight_version"] == "retracted"
    # m: tokens made by the old weights before the retraction (at least those seen).
    old = logprobs_of(alone)
    m = next((i for i in range(length) if abs(made[i] - old[i]) > 1e-4), length)
    assert out[:m] == alone["output_ids"][:m]
    assert seen <= m < length, f"no token after the pause came from the new weights (m={m})"
    continued = generate(url, **logprob_body(PROMPT_IDS + out[:m], length - m))
    assert continued["output_ids"] == out[m:]
    assert logprobs_of(continued) == pytest.approx(made[m:], abs=1e-4)


def logprob_body(input_ids: list[int], max_new_tokens: int) -> dict:
    return {**long_body(input_ids, max_new_tokens), "return_logprob": True}


def logprobs_of(reply: dict) -> list[float]:
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
