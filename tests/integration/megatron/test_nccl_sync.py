"""The broadcast weight sync (trainer side) against two recording engines in their own
processes: the HTTP calls SGLang expects, rank offsets, bucketing, the version only on the
last bucket, and every tensor really received (checked by checksum); and against the CPU
engine, which receives over gloo and then serves the broadcast weights."""

from __future__ import annotations

import ast
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from clawrl.common.process_groups import destroy_group, join_group
from clawrl.engine.cpu.runner import read_checkpoint
from clawrl.trainer.megatron.nccl_sync import BroadcastSender, Engine, make_buckets, rank_offsets
from tests.conftest import free_port
from tests.integration.megatron.recording_engine import recording_engines
from tests.integration.weight_sync.conftest import engine, export_checkpoint, tiny_dir  # noqa: F401
from tests.integration.weight_sync.test_weight_sync_job import engine_weights

pytestmark = pytest.mark.integration


def test_buckets_keep_order_and_size():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1, 100])]
    buckets = make_buckets(named, max_bytes=80)  # float32: 40, 40, 120, 20, 4, 400 bytes
    assert [b.names for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [b.nbytes for b in buckets] == [80, 120, 24, 400]
    assert buckets[0].announcement() == {
        "names": ["t0", "t1"], "dtypes": ["float32", "float32"], "shapes": [[10], [10]],
    }  # fmt: skip
    assert make_buckets([], 10) == []


def test_rank_offsets_follow_engine_tp():
    assert rank_offsets([2, 2]) == ([1, 3], 5)
    assert rank_offsets([1]) == ([1], 2)


@pytest.fixture
def engines(log_dir):
    with recording_engines(2, log_dir) as urls:
        yield urls


async def test_broadcast_reaches_every_engine_bucket_by_bucket(engines):
    gen = torch.Generator().manual_seed(0)
    layer = "model.layers.0.mlp."
    named = [("model.embed_tokens.weight", torch.randn(300, 64, generator=gen)),
             ("model.norm.weight", torch.randn(64, generator=gen)),
             (layer + "up_proj.weight", torch.randn(128, 64, generator=gen).bfloat16()),
             (layer + "down_proj.weight", torch.randn(64, 128, generator=gen))]  # fmt: skip
    port = free_port()
    sender = BroadcastSender([Engine(url) for url in engines], "127.0.0.1", port,
                             group_name="test-weights", backend="gloo",
                             bucket_bytes=40_000)  # fmt: skip
    try:
        await sender.connect()
        sent = await sender.send(named, version=7)
    finally:
        await sender.aclose()
    assert sent == 3  # embed (76.8 kB) alone; norm + up_proj (16.6 kB); down_proj (32.8 kB)

    for rank_offset, url in zip([1, 2], engines, strict=True):
        async with httpx.AsyncClient() as client:
            calls = (await client.get(url + "/recorded")).json()
            sessions = (await client.get(url + "/sessions")).json()
        init, *updates = calls
        assert init == {"path": "/init_weights_update_group", "body": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": rank_offset,
            "world_size": 3, "group_name": "test-weights", "backend": "gloo"}}  # fmt: skip
        assert [c["path"] for c in updates] == ["/update_weights_from_distributed"] * 3
        bodies = [c["body"] for c in updates]
        assert [n for b in bodies for n in b["names"]] == [n for n, _ in named]
        assert [d for b in bodies for d in b["dtypes"]] == [
            "float32", "float32", "bfloat16", "float32"]  # fmt: skip
        assert [s for b in bodies for s in b["shapes"]] == [list(t.shape) for _, t in named]
        assert [b.get("weight_version") for b in bodies] == [None, None, "7"]
        assert [b["flush_cache"] for b in bodies] == [False, False, True]
        assert all(b["group_name"] == "test-weights" for b in bodies)
        received = [s for c in updates for s in c["sums"]]
        expected = [float(t.double().sum()) for _, t in named]
        assert received == pytest.approx(expected, rel=1e-12, abs=1e-9)
        # The updates ran inside one session (refused outside it); aclose left the group.
        assert sessions == ["begin", "end", "destroy test-weights"]


def load_from_disk(url: str, path, version: str) -> dict:
    body = {"model_path": str(path), "weight_version": version}
    return httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=120).json()


async def test_the_cpu_engine_receives_the_broadcast_and_serves_it(engine, tmp_path):  # noqa: F811
    """The CPU engine's /init_weights_update_group + /update_weights_from_distributed (gloo):
    the broadcast weights serve exactly what the same checkpoint loaded from disk serves, and
    a bucket that does not fit the model is refused with the old weights left serving."""
    checkpoint = export_checkpoint(tmp_path / "v5", 1.5)
    scaled = sorted(read_checkpoint(checkpoint).items())

    async def broadcast(named, version: int) -> int:
        sender = BroadcastSender([Engine(engine)], "127.0.0.1", free_port(),
                                 group_name=f"test-{uuid.uuid4().hex[:6]}", backend="gloo",
                                 bucket_bytes=1 << 20)  # fmt: skip
        try:
            await sender.connect()
            return await sender.send(named, version)
        finally:
            await sender.aclose()

    try:
        _, before = engine_weights(engine)
        assert await broadcast(scaled, 5) > 1
        version, received = engine_weights(engine)
        assert version == "5" and received != before
        assert load_from_disk(engine, checkpoint, "6")["success"]
        assert engine_weights(engine) == ("6", received)

        name, tensor = scaled[0]
        with pytest.raises(RuntimeError, match="shape mismatch"):
            await broadcast([(name, tensor[:-1])], 7)
        assert engine_weights(engine) == ("6", received)
    finally:  # the other tests of this engine expect its initial weights
        load_from_disk(engine, tiny_dir(), "0")
    assert engine_weights(engine) == ("0", before)


def post(url: str, path: str, body: dict) -> dict:
    return httpx.post(url + path, json=body, timeout=60).json()


UNKNOWN_GROUP = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                 "group_name": "no-such-group"}  # fmt: skip
# SGLang 0.5.23's replies (status, success, message) to its weight-update session calls, in this
# order on an engine that has joined no group; tests/sglang/test_distributed_update.py checks
# the same list against SGLang itself.
SESSION_REPLIES = [
    ("/end_weight_update", {}, 400,
     "no weight-update session is open; call begin_weight_update() first"),
    ("/update_weights_from_distributed", UNKNOWN_GROUP, 400,
     "update_weights_from_distributed must run between begin_weight_update() and "
     "end_weight_update()"),
    ("/begin_weight_update", {}, 200, "Success"),
    ("/begin_weight_update", {}, 400,
     "a weight-update session is already open; call end_weight_update() first"),
    ("/update_weights_from_distributed", UNKNOWN_GROUP, 400,
     "Failed to receive weights: Group no-such-group not in []. Please call "
     "`init_weights_update_group` first."),
    ("/end_weight_update", {}, 200, "Success"),
    ("/destroy_weights_update_group", {"group_name": "no-such-group"}, 400,
     "The group to be destroyed does not exist."),
]  # fmt: skip


def session_replies(url: str) -> list[tuple]:
    """SESSION_REPLIES' calls made on `url`, with what it answered."""
    replies = []
    for path, body, _, _ in SESSION_REPLIES:
        reply = httpx.post(url + path, json=body, timeout=60)
        content = reply.json()
        assert content["success"] == (reply.status_code == 200), content
        replies.append((path, body, reply.status_code, content["message"]))
    return replies


def leave_every_group(url: str) -> None:
    """Make `url` leave the groups it is in. This module's engine is shared with other modules
    whose syncs keep their group between versions, as the trainer does (seen in `make test`:
    `Group no-such-group not in ['clawrl-weights-68219c']`); the engine's refusal of an unknown
    group names the groups it is in."""
    assert post(url, "/begin_weight_update", {})["success"]
    refused = post(url, "/update_weights_from_distributed", UNKNOWN_GROUP)["message"]
    assert post(url, "/end_weight_update", {})["success"]
    listed = re.search(r"not in (\[.*?\])", refused)
    assert listed is not None, refused
    for name in ast.literal_eval(listed.group(1)):
        assert post(url, "/destroy_weights_update_group", {"group_name": name})["success"]


def test_the_cpu_engine_answers_the_session_calls_as_sglang(engine):  # noqa: F811
    leave_every_group(engine)  # SESSION_REPLIES are those of an engine in no group
    assert session_replies(engine) == SESSION_REPLIES


# SGLang 0.5.23's replies (path, status, message) to a whole update of one tensor.
GROUP_REPLIES = [
    ("/init_weights_update_group", 200, "Succeeded to initialize custom process group."),
    ("/begin_weight_update", 200, "Success"),
    ("/update_weights_from_distributed", 200, "Succeeded to update parameter online."),
    ("/end_weight_update", 200, "Success"),
    ("/destroy_weights_update_group", 200, "Succeeded to destroy custom process group."),
]


def group_replies(url: str, name: str, tensor: torch.Tensor) -> list[tuple[str, int, str]]:
    """GROUP_REPLIES' calls made on `url`, rank 0 broadcasting `tensor` (the served weight
    `name`, unchanged), with what it answered."""
    group_name, port = f"replies-{uuid.uuid4().hex[:6]}", free_port()
    replies = []

    def call(path: str, body: dict) -> None:
        reply = httpx.post(url + path, json=body, timeout=120)
        replies.append((path, reply.status_code, reply.json()["message"]))

    with ThreadPoolExecutor(1) as rank0:
        joined = rank0.submit(join_group, "gloo", "127.0.0.1", port, 0, 2, group_name, 60)
        call(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group_name,
                "backend": "gloo",
            },
        )
        group = joined.result()
        call("/begin_weight_update", {})
        sent = rank0.submit(torch.distributed.broadcast, tensor, src=0, group=group)
        call("/update_weights_from_distributed", {"names": [name], "group_name": group_name,
             "dtypes": [str(tensor.dtype).removeprefix("torch.")],
             "shapes": [list(tensor.shape)]})  # fmt: skip
        sent.result()
        call("/end_weight_update", {})
        call("/destroy_weights_update_group", {"group_name": group_name})
        destroy_group(group)
    return replies


def test_the_cpu_engine_answers_a_whole_update_as_sglang(engine):  # noqa: F811
    tensor = read_checkpoint(tiny_dir())["model.norm.weight"]
    assert group_replies(engine, "model.norm.weight", tensor) == GROUP_REPLIES


async def test_an_engine_refusing_a_bucket_unreceived_does_not_hold_rank_0(engine):  # noqa: F811
    """The CPU engine refuses a float64 bucket before receiving it (`success: false`, as SGLang
    refuses one outside a session or for an unknown group): rank 0's broadcast would wait out
    the group's timeout (60 s here); instead the group is destroyed on both sides at once, the
    session closed, and the old weights keep serving."""
    name = f"test-{uuid.uuid4().hex[:6]}"
    sender = BroadcastSender([Engine(engine)], "127.0.0.1", free_port(), group_name=name,
                             backend="gloo", timeout_s=60)  # fmt: skip
    try:
        before = engine_weights(engine)
        await sender.connect()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="dtype float64 is not one of"):
            await sender.send([("model.norm.weight", torch.zeros(64, dtype=torch.float64))], 9)
        assert time.monotonic() - started < 15
        assert sender.group is None
    finally:
        await sender.aclose()
    gone = post(engine, "/destroy_weights_update_group", {"group_name": name})
    assert gone == {"success": False, "message": "The group to be destroyed does not exist.",
                    "num_paused_requests": 0}  # fmt: skip
    assert post(engine, "/begin_weight_update", {})["success"]  # the failed send closed its own
    assert post(engine, "/end_weight_update", {})["success"]
    assert engine_weights(engine) == before


async def test_an_engine_refusing_to_join_does_not_hold_rank_0(engine):  # noqa: F811
    """The CPU engine refuses an NCCL group at once: rank 0's rendezvous cannot complete, and
    connect() fails with the engine's reason instead of after the group's timeout (10 s)."""
    sender = BroadcastSender([Engine(engine)], "127.0.0.1", free_port(), backend="nccl",
                             group_name=f"test-{uuid.uuid4().hex[:6]}", timeout_s=10)  # fmt: skip
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="the CPU engine receives over gloo"):
            await sender.connect()
        assert time.monotonic() - started < 5
        assert sender.group is None
    finally:
        await sender.aclose()
