"""The trainer's broadcast weight sync (clawrl.trainer.megatron.nccl_sync.BroadcastSender) with a
gloo group against real SGLang 0.5.23 on CPU. SGLang joins the gloo group
(/init_weights_update_group) and receives /update_weights_from_distributed only inside a
weight-update session (/begin_weight_update .. /end_weight_update), which the sender opens: every
tensor arrives and the new version is served. Its session replies are the CPU engine's
(tests/integration/megatron/test_nccl_sync.py); a failed bucket leaves no group behind; and
SGLang leaving a group (/destroy_weights_update_group) ends a broadcast rank 0 runs on it at
once, which is how the sender stops waiting on an engine that refused a bucket unreceived."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from clawrl.common.sglang_client import SGLangClient
from clawrl.trainer.megatron.nccl_sync import BroadcastSender, Engine
from tests.conftest import free_port
from tests.integration.megatron.test_nccl_sync import (
    GROUP_REPLIES,
    SESSION_REPLIES,
    group_replies,
    session_replies,
)
from tests.sglang.test_weight_sync import changed_model, first_logprobs  # noqa: F401

pytestmark = [pytest.mark.sglang, pytest.mark.integration]


def post(url: str, path: str, body: dict) -> dict:
    return httpx.post(url + path, json=body, timeout=60).json()


def gone(url: str, group_name: str) -> bool:
    """The engine holds no group of that name (SGLang's answer to destroying an unknown one)."""
    reply = post(url, "/destroy_weights_update_group", {"group_name": group_name})
    return reply == {"success": False, "message": "The group to be destroyed does not exist."}


def sender_for(url: str, name: str) -> BroadcastSender:
    return BroadcastSender([Engine(url)], "127.0.0.1", free_port(), group_name=name,
                           backend="gloo", timeout_s=120)  # fmt: skip


def test_session_replies_are_the_cpu_engines(sglang_url):
    """First in this module: SESSION_REPLIES assume an engine that has joined no group."""
    assert session_replies(sglang_url) == SESSION_REPLIES


def test_whole_update_replies_are_the_cpu_engines(sglang_url, model_dir):
    tensor = load_file(model_dir / "model.safetensors")["model.norm.weight"]
    assert group_replies(sglang_url, "model.norm.weight", tensor) == GROUP_REPLIES


async def test_broadcast_inside_a_session_is_served(sglang_url, changed_model):  # noqa: F811
    client = SGLangClient(sglang_url)
    sender = sender_for(sglang_url, "clawrl-broadcast")
    try:
        before = await first_logprobs(client)
        await sender.connect()  # SGLang accepts the gloo group on CPU
        tensors = load_file(changed_model / "model.safetensors")
        assert await sender.send(sorted(tensors.items()), version=7) >= 1
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
    assert await asyncio.to_thread(gone, sglang_url, "clawrl-broadcast")  # aclose left it


async def test_a_failed_bucket_leaves_no_group_and_no_session(sglang_url, model_dir):
    """SGLang receives a bucket whose shape does not fit, then fails to load it: the sender
    destroys the group on SGLang, closes the session, and the next connect forms a new one."""
    sender = sender_for(sglang_url, "clawrl-misfit")
    try:
        await sender.connect()
        with pytest.raises(RuntimeError, match="Failed to update parameter online"):
            await sender.send([("model.norm.weight", torch.ones(575))], version=9)
        assert sender.group is None
    finally:
        await sender.aclose()
    try:
        assert await asyncio.to_thread(gone, sglang_url, "clawrl-misfit")
        begun = await asyncio.to_thread(post, sglang_url, "/begin_weight_update", {})
        assert begun["success"], begun  # the failed send closed its session
        assert (await asyncio.to_thread(post, sglang_url, "/end_weight_update", {}))["success"]
    finally:  # SGLang calls the weights partially updated: serve the model again
        body = {"model_path": str(model_dir), "weight_version": "default"}
        assert (await asyncio.to_thread(post, sglang_url, "/update_weights_from_disk", body))[
            "success"
        ]


async def test_leaving_the_group_ends_a_broadcast_nobody_receives(sglang_url):
    """Rank 0 broadcasts while SGLang receives nothing (as after a refusal): the gloo group's
    timeout is 120 s, but SGLang's /destroy_weights_update_group closes its connections and
    the broadcast fails within seconds."""
    sender = sender_for(sglang_url, "clawrl-stuck")
    try:
        await sender.connect()

        def broadcast() -> str:
            try:
                torch.distributed.broadcast(torch.ones(576), src=0, group=sender.group)
            except RuntimeError as exc:
                return str(exc)
            return "completed"

        pending = asyncio.ensure_future(asyncio.to_thread(broadcast))
        await asyncio.sleep(1)
        assert not pending.done()
        started = time.monotonic()
        left = await asyncio.to_thread(
            post, sglang_url, "/destroy_weights_update_group", {"group_name": "clawrl-stuck"}
        )
        assert left == {"success": True, "message": "Succeeded to destroy custom process group."}
        error = await asyncio.wait_for(pending, timeout=30)
        assert "Connection closed by peer" in error
        assert time.monotonic() - started < 10
    finally:
        await sender.aclose()
