"""Weight sync by broadcast (the trainer's side of SGLang's NCCL path).

The trainer's rank 0 and every rank of every policy engine form one process group: rank 0 is
the trainer, engine i's TP ranks follow at its `rank_offset` (`/init_weights_update_group`).
Then, bucket by bucket, each engine is told the HF names, dtypes and shapes of the next tensors
(`/update_weights_from_distributed`) while rank 0 broadcasts them in that order: the HTTP call
returns once the engine has received and loaded the bucket, so the call and the broadcast must
run at the same time. Only the last bucket carries `weight_version` and flushes the cache, so
an engine reports the new version once it has all of it. The gateways are paused around the
whole update (the weight-sync protocol); disk sync stays the default and the fallback.

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

from clawrl.common.process_groups import join_group
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
        """Close the HTTP clients and leave the group (the engines keep theirs until the next
        /init_weights_update_group of the same name replaces it)."""
        for client in self.clients:
            await client.aclose()
        if self.group is not None:
            group, self.group = self.group, None
            try:
                torch.distributed.destroy_process_group(group)
            except Exception as exc:  # a broken group: dropping it is all that is left
                log.warning("could not destroy the broadcast group: %s", exc)

    @staticmethod
    def _check(replies: list[dict], what: str) -> None:
        failed = [r.get("message", "") for r in replies if not r.get("success")]
        if failed:
            raise RuntimeError(f"{what} failed on {len(failed)} engine(s): {failed[0]}")

    async def connect(self) -> None:
        """Every engine joins the group while rank 0 does (the rendezvous waits for all)."""
        offsets, world = rank_offsets([e.tp for e in self.engines])
        joined = asyncio.to_thread(
            join_group, self.backend, self.address, self.port, 0, world, self.group_name,
            self.timeout_s,
        )  # fmt: skip
        calls = [
            client.init_weights_update_group(
                self.address, self.port, offset, world, self.group_name, self.backend
            )
            for client, offset in zip(self.clients, offsets, strict=True)
        ]
        self.group, *replies = await asyncio.gather(joined, *calls)
        self._check(replies, "/init_weights_update_group")
        log.info("weight broadcast group %s: %d engines, world %d", self.group_name,
                 len(self.engines), world)  # fmt: skip

    def _broadcast(self, bucket: Bucket) -> None:
        for tensor in bucket.tensors:
            torch.distributed.broadcast(
                tensor.to(self.device).contiguous(), src=0, group=self.group
            )

    async def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Broadcast every tensor (HF names) to every engine; -> buckets sent."""
        if self.group is None:
            raise RuntimeError("connect() first")
        buckets = make_buckets(named, self.bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            calls = [
                client.update_weights_from_distributed(
                    **bucket.announcement(),
                    group_name=self.group_name,
                    weight_version=str(version) if last else None,
                    flush_cache=last,
                )
                for client in self.clients
            ]
            # The engines block in their receive until rank 0 broadcasts: both at once.
            *replies, _ = await asyncio.gather(*calls, asyncio.to_thread(self._broadcast, bucket))
            self._check(replies, "/update_weights_from_distributed")
        return len(buckets)
