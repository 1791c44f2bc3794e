"""The trainer's broadcast weight sync (clawrl.trainer.megatron.nccl_sync.BroadcastSender) with a
gloo group against real SGLang 0.5.23 on CPU. SGLang joins the gloo group
(/init_weights_update_group), but refuses /update_weights_from_distributed outside a
weight-update session (/begin_weight_update .. /end_weight_update), which BroadcastSender does not
open: the refusal comes at once, before any receive, so rank 0's broadcast would wait out its
whole timeout. Inside a session every tensor arrives and the new version is served."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import load_file

from clawrl.common.sglang_client import SGLangClient
from clawrl.trainer.megatron.nccl_sync import BroadcastSender, Engine
from tests.conftest import free_port
from tests.sglang.test_weight_sync import changed_model, first_logprobs  # noqa: F401

pytestmark = [pytest.mark.sglang, pytest.mark.integration]


def session_call(url: str, path: str) -> dict:
    response = httpx.post(url + path, json={}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


async def test_sglang_joins_a_gloo_group_and_receives_inside_a_session(
    sglang_url,
    model_dir,
    changed_model,  # noqa: F811
):
    client = SGLangClient(sglang_url)
    sender = BroadcastSender(
        [Engine(sglang_url)], "127.0.0.1", free_port(), backend="gloo", timeout_s=120
    )
    try:
        before = await first_logprobs(client)
        await sender.connect()  # SGLang accepts the gloo group on CPU

        # Outside a session: refused at once, nothing received (no broadcast runs here).
        refused = await client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[576]], sender.group_name
        )
        assert refused["success"] is False
        assert "between begin_weight_update() and end_weight_update()" in refused["message"]

        # Inside a session: every tensor of the checkpoint arrives.
        session_call(sglang_url, "/begin_weight_update")
        tensors = load_file(changed_model / "model.safetensors")
        assert await sender.send(sorted(tensors.items()), version=7) >= 1
        session_call(sglang_url, "/end_weight_update")
        assert (await client.get_model_info())["weight_version"] == "7"
        broadcast = await first_logprobs(client)
        assert broadcast != pytest.approx(before, abs=0.05)

        # The same weights loaded from disk serve the same log-probs.
        reply = await client.update_weights_from_disk(str(changed_model), weight_version="8")
        assert reply["success"], reply
        assert await first_logprobs(client) == pytest.approx(broadcast, abs=0.02)
    finally:
        await sender.aclose()
        await client.aclose()
