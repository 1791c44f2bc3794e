"""/update_weights_from_disk: new weights change the answers and the reported version; a bad
checkpoint is refused and the old weights keep serving."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings

from .helpers import TIMEOUT, greedy, metric

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


def test_weight_update_while_generating_swaps_between_steps(url, original, tmp_path):
    """A long generation keeps going across an update; the swap reports it as paused."""
    import threading
    import time

    result: dict = {}
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
    }
    worker = threading.Thread(
        target=lambda: result.update(
            httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT).json()
        )
    )
    worker.start()
    while metric(url, "sglang:num_running_reqs") < 1 and worker.is_alive():
        time.sleep(0.01)
    response = update(url, save(tmp_path, "again", original), "3")
    worker.join(timeout=60)
    assert response.json()["success"] is True
    assert response.json()["num_paused_requests"] in (0, 1)
    assert result["meta_info"]["completion_tokens"] == 300
    assert result["meta_info"]["weight_version"] == "3"
