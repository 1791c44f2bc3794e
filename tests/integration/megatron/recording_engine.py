"""A recording stand-in for a GPU policy engine's weight paths, on gloo:
`python -m tests.integration.megatron.recording_engine PORT [DEVICE]`. It records every
/init_weights_update_group, /update_weights_from_distributed and /update_weights_from_disk call,
really joins the group and really receives each announced tensor from rank 0's broadcast, and
serves what it recorded (with a checksum of every received tensor) at GET /recorded. Like an
engine it reports its weight_version (set by the last bucket or a disk load) at
/get_model_info. Like SGLang 0.5.23 it refuses a distributed update outside a weight-update
session (/begin_weight_update .. /end_weight_update), at once and without receiving, and leaves
a group on /destroy_weights_update_group; GET /sessions lists those calls in order.
POST /refuse makes it answer `success: false` to every distributed update
(after receiving the tensors, so the collectives stay in step) and/or to disk loads of a
directory of a given name. It receives into DEVICE (cpu; cuda for NCCL in tests/gpu/checks.py,
which is why it needs no pytest)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from aiohttp import web

from clawrl.common.process_groups import destroy_group, join_group, receive_broadcast


@contextmanager
def recording_engines(count: int, log_dir: Path) -> Iterator[list[str]]:
    """`count` recording engines in child processes; yields their URLs."""
    from tests.conftest import ChildProcess, free_port, wait_until

    children = []
    try:
        for i in range(count):
            port = free_port()
            argv = [sys.executable, "-m", "tests.integration.megatron.recording_engine", str(port)]
            children.append((ChildProcess(f"recording-engine-{i}", argv, log_dir),
                             f"http://127.0.0.1:{port}"))  # fmt: skip
        for child, url in children:
            wait_until(lambda url=url: httpx.get(url + "/health").status_code == 200, 60,
                       child.name, child.proc)  # fmt: skip
        yield [url for _, url in children]
    finally:
        for child, _ in children:
            child.stop()


def make_app(device: str = "cpu") -> web.Application:
    calls: list[dict] = []
    state: dict = {"weight_version": "0", "model_path": "initial", "refuse": {}}
    sessions: list[str] = []  # "begin", "end", "destroy NAME", in order
    groups: dict = {}

    async def init_group(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append({"path": "/init_weights_update_group", "body": body})
        groups[body["group_name"]] = await asyncio.to_thread(
            join_group, body["backend"], body["master_address"], body["master_port"],
            body["rank_offset"], body["world_size"], body["group_name"],
        )  # fmt: skip
        return web.json_response({"success": True, "message": "joined"})

    def receive(body: dict) -> list[float]:
        group = groups[body["group_name"]]
        tensors = receive_broadcast(group, body["dtypes"], body["shapes"], device)
        return [float(tensor.double().sum()) for tensor in tensors]

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        if not state.get("session"):
            message = "must run between begin_weight_update() and end_weight_update()"
            return web.json_response({"success": False, "message": message}, status=400)
        sums = await asyncio.to_thread(receive, body)
        calls.append({"path": "/update_weights_from_distributed", "body": body, "sums": sums})
        if state["refuse"].get("distributed"):
            return web.json_response({"success": False, "message": "refused (test)"})
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return web.json_response({"success": True, "message": "loaded"})

    async def from_disk(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append({"path": "/update_weights_from_disk", "body": body})
        if Path(body["model_path"]).name == state["refuse"].get("disk"):
            return web.json_response({"success": False, "message": "refused (test)"})
        state["model_path"] = body["model_path"]
        state["weight_version"] = body.get("weight_version") or state["weight_version"]
        return web.json_response({"success": True, "message": "loaded"})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": state["model_path"], "weight_version": state["weight_version"]}
        )

    async def session(request: web.Request) -> web.Response:
        begin = request.path == "/begin_weight_update"
        sessions.append("begin" if begin else "end")
        if bool(state.get("session")) == begin:
            return web.json_response({"success": False, "message": "session"}, status=400)
        state["session"] = begin
        return web.json_response({"success": True, "message": "Success"})

    async def destroy(request: web.Request) -> web.Response:
        name = (await request.json())["group_name"]
        sessions.append(f"destroy {name}")
        group = groups.pop(name, None)
        if group is None:
            return web.json_response({"success": False, "message": "no such group"}, status=400)
        destroy_group(group)
        del group  # closes its connections
        return web.json_response({"success": True, "message": "destroyed"})

    async def list_sessions(request: web.Request) -> web.Response:
        return web.json_response(sessions)

    async def refuse(request: web.Request) -> web.Response:
        state["refuse"] = await request.json()
        return web.json_response({})

    async def recorded(request: web.Request) -> web.Response:
        return web.json_response(calls)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update)
    app.router.add_post("/update_weights_from_disk", from_disk)
    app.router.add_post("/begin_weight_update", session)
    app.router.add_post("/end_weight_update", session)
    app.router.add_post("/destroy_weights_update_group", destroy)
    app.router.add_get("/sessions", list_sessions)
    app.router.add_post("/refuse", refuse)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/recorded", recorded)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    web.run_app(make_app(device), host="127.0.0.1", port=int(sys.argv[1]), print=None)
