"""Weight sync by broadcast (the trainer's side of SGLang's NCCL path).

The trainer's rank 0 and every rank of every policy engine form one process group: rank 0 is
the trainer, engine i's TP ranks follow at its `rank_offset` (`/init_weights_update_group`).
Then, bucket by bucket, each engine is told the HF names, dtypes and shapes of the next tensors
(`/update_weights_from_distributed`) while rank 0 broadcasts them in that order: the HTTP call
returns once the engine has received and loaded the bucket, so the call and the broadcast must
run at the same time. Only the last bucket carries `weight_version` and flushes the cache, so
an engine reports the new version once it has all of it. The gateways are paused around the
whole update (the weight-sync protocol); disk sync stays the default and the fallback.

SGLang receives only inside a weight-update session (`/begin_weight_update` ..
`/end_weight_update`, 0.5.23 and later), so `send` opens one on every engine and always closes
it. A failed bucket leaves the group unusable: it is destroyed on every engine
(`/destroy_weights_update_group`) and on rank 0, and `connect()` forms a new one. An engine that
refuses a bucket without receiving it (no session, unknown group) would leave rank 0's
broadcast waiting out the group's timeout: destroying its side of the group closes its
connections, which ends the broadcast at once.

The group is created like SGLang creates its side (`clawrl.common.process_groups`), so both
ends meet in the same store. On CPU the same code runs with gloo, which is how it is tested
(and how the CPU engine receives).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from clawrl.common.process_groups import destroy_group, join_group
from clawrl.common.sglang_client import SGLangClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    """Tensors announced and broadcast together."""

    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def announcement(self) -> dict:
        """The names / dtypes / shapes fields of /update_weights_from_distributed."""
        return {
            "names": list(self.names),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
        }


def make_buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped in order, each group at most `max_bytes` (a larger tensor
    travels alone)."""
    buckets: list[Bucket] = []
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if tensors and size + nbytes > max_bytes:
            buckets.append(Bucket(names, tensors))
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(tensor)
        size += nbytes
    if tensors:
        buckets.append(Bucket(names, tensors))
    return buckets


def rank_offsets(engine_tp: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the group (the trainer is rank 0) and the world size."""
    offsets, next_rank = [], 1
    for tp in engine_tp:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


def as_reply(reply: dict | BaseException) -> dict:
    """A weight call's reply; a transport failure as a failed one."""
    if isinstance(reply, BaseException):
        return {"success": False, "message": f"{type(reply).__name__}: {reply}"}
    return reply


def failed(call: asyncio.Future) -> bool:
    """A finished weight call that did not succeed."""
    return call.exception() is not None or not call.result().get("success")


def drop_late_group(joined: asyncio.Future) -> None:
    """Rank 0's join, given up after an engine refused: it times out, or, should it form after
    all, the group is left at once."""
    if joined.cancelled() or joined.exception() is not None:
        return
    try:
        destroy_group(joined.result())
    except Exception as exc:  # nothing else holds it: it goes with its last reference
        log.warning("could not destroy a broadcast group formed too late: %s", exc)


@dataclass(frozen=True)
class Engine:
    """A policy engine taking part in the broadcast: its URL and its TP size."""

    url: str
    tp: int = 1


class BroadcastSender:
    """Rank 0's side (see the module docstring). Create it inside a running event loop."""

    def __init__(
        self,
        engines: list[Engine],
        master_address: str,
        master_port: int,
        *,
        group_name: str = "clawrl-weights",
        backend: str = "nccl",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
        device: str = "cpu",
    ) -> None:
        self.engines = engines
        self.address, self.port = master_address, master_port
        self.group_name, self.backend, self.bucket_bytes = group_name, backend, bucket_bytes
        self.device = torch.device(device)  # NCCL broadcasts from the GPU
        self.timeout_s = timeout_s
        self.clients = [SGLangClient(e.url, timeout_s=timeout_s) for e in engines]
        self.group = None

    async def aclose(self) -> None:
        """Leave the group, on the engines too, and close the HTTP clients."""
        if self.group is not None:
            await self._destroy_group()
        for client in self.clients:
            await client.aclose()

    @staticmethod
    def _check(replies: list[dict], what: str) -> None:
        failed = [r.get("message", "") for r in replies if not r.get("success")]
        if failed:
            raise RuntimeError(f"{what} failed on {len(failed)} engine(s): {failed[0]}")

    async def _on_every_engine(self, call: str, *args) -> list[dict]:
        """The same weight call to every engine at once -> their replies."""
        replies = await asyncio.gather(
            *(getattr(client, call)(*args) for client in self.clients), return_exceptions=True
        )
        return [as_reply(r) for r in replies]

    async def connect(self) -> None:
        """Every engine joins the group while rank 0 does (the rendezvous waits for all). An
        engine refusing to join fails this at once: the rendezvous cannot complete without it,
        and rank 0 does not wait out the timeout for it (its join ends by itself then)."""
        offsets, world = rank_offsets([e.tp for e in self.engines])
        joined = asyncio.ensure_future(asyncio.to_thread(
            join_group, self.backend, self.address, self.port, 0, world, self.group_name,
            self.timeout_s,
        ))  # fmt: skip
        calls = [
            asyncio.ensure_future(
                client.init_weights_update_group(
                    self.address, self.port, offset, world, self.group_name, self.backend
                )
            )
            for client, offset in zip(self.clients, offsets, strict=True)
        ]
        pending: set[asyncio.Future] = {joined, *calls}
        try:
            while not joined.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                refused = [as_reply(c.exception() or c.result()) for c in done - {joined}
                           if failed(c)]  # fmt: skip
                if refused:
                    joined.add_done_callback(drop_late_group)
                    self._check(refused, "/init_weights_update_group")
            self.group = joined.result()
        except BaseException:
            for call in calls:
                call.cancel()  # the engines' own joins time out by themselves
            raise
        replies = [as_reply(r) for r in await asyncio.gather(*calls, return_exceptions=True)]
        try:
            self._check(replies, "/init_weights_update_group")
        except RuntimeError:
            await self._destroy_group()  # the engines that did join leave again
            raise
        log.info("weight broadcast group %s: %d engines, world %d", self.group_name,
                 len(self.engines), world)  # fmt: skip

    def _broadcast(self, bucket: Bucket) -> None:
        error = None
        try:
            for tensor in bucket.tensors:
                torch.distributed.broadcast(
                    tensor.to(self.device).contiguous(), src=0, group=self.group
                )
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            # Raised afresh: torch's traceback would keep the group, and its connections to
            # the engines still receiving, alive.
            raise RuntimeError(f"rank 0's broadcast failed: {error}")

    async def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Broadcast every tensor (HF names) to every engine, inside one weight-update session;
        -> buckets sent. On failure the group is gone: `connect()` again."""
        if self.group is None:
            raise RuntimeError("connect() first")
        buckets = make_buckets(named, self.bucket_bytes)
        await self._begin_sessions()
        try:
            for i, bucket in enumerate(buckets):
                await self._send_bucket(bucket, last=i == len(buckets) - 1, version=version)
        except BaseException:
            if self.group is not None:
                await self._destroy_group()
            await self._on_every_engine("end_weight_update")  # best effort: it failed already
            raise
        self._check(await self._on_every_engine("end_weight_update"), "/end_weight_update")
        return len(buckets)

    async def _begin_sessions(self) -> None:
        """/begin_weight_update on every engine. A session still open (a sender that died
        inside one) is closed first: the weight-sync lock makes this sender the only one."""
        replies = await self._on_every_engine("begin_weight_update")
        for client, reply in zip(self.clients, replies, strict=True):
            if not reply.get("success") and "already open" in reply.get("message", ""):
                log.warning("%s had a weight-update session open: closing it", client.base_url)
                await client.end_weight_update()
                reply.update(await client.begin_weight_update())
        try:
            self._check(replies, "/begin_weight_update")
        except RuntimeError:
            await self._on_every_engine("end_weight_update")  # those that did open one
            raise

    async def _send_bucket(self, bucket: Bucket, *, last: bool, version: int) -> None:
        """Announce the bucket to every engine while rank 0 broadcasts it. An engine that
        fails before the broadcast has ended may never receive it: then the group is
        destroyed at once, which ends the broadcast instead of it waiting out the timeout."""
        calls = [
            asyncio.ensure_future(
                client.update_weights_from_distributed(
                    **bucket.announcement(),
                    group_name=self.group_name,
                    weight_version=str(version) if last else None,
                    flush_cache=last,
                )
            )
            for client in self.clients
        ]
        broadcast = asyncio.ensure_future(asyncio.to_thread(self._broadcast, bucket))
        try:
            pending: set[asyncio.Future] = {*calls, broadcast}
            while not broadcast.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(failed(call) for call in done - {broadcast}):
                    log.warning("an engine failed during the broadcast: destroying group %s",
                                self.group_name)  # fmt: skip
                    await self._destroy_group(broadcast)
            if broadcast.exception() is not None and self.group is not None:
                await self._destroy_group()  # rank 0 failed: the engines stop waiting for it
            replies = await asyncio.gather(*calls, return_exceptions=True)
        except BaseException:
            if self.group is not None:
                await self._destroy_group(broadcast)
            for call in calls:
                call.cancel()
            raise
        self._check([as_reply(r) for r in replies], "/update_weights_from_distributed")
        broadcast.result()  # rank 0's own error, when every engine reported success

    async def _destroy_group(self, broadcast: asyncio.Future | None = None) -> None:
        """/destroy_weights_update_group on every engine and rank 0's side, once `broadcast`
        (rank 0's collective on the group, if one runs) has ended: an engine still receiving
        answers only when its receive ends, which rank 0 leaving the group brings about."""
        name = self.group_name
        destroyed = asyncio.ensure_future(
            self._on_every_engine("destroy_weights_update_group", name)
        )
        if broadcast is not None:
            await asyncio.wait([broadcast])
        group, self.group = self.group, None
        if group is not None:
            try:
                destroy_group(group)
            except Exception as exc:  # a broken group: dropping it is all that is left
                log.warning("could not destroy the broadcast group: %s", exc)
            del group  # its connections close with the last reference
        for client, reply in zip(self.clients, await destroyed, strict=True):
            if not reply.get("success"):
                log.warning("%s did not leave group %s: %s", client.base_url, name,
                            reply.get("message"))  # fmt: skip
