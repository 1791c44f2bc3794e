"""A torch.distributed process group besides a process's default one, for the weight broadcast
between the trainer's rank 0 and the policy engines (NCCL on GPUs, gloo on CPU). The trainer's
side and the CPU engine's side build it the same way, as SGLang builds its own: a TCP
rendezvous at master_address:port and a store prefixed by the group's name. torch is imported
here only when a group is joined (the gateway and judge images have none)."""

from __future__ import annotations

from datetime import timedelta


def join_group(
    backend: str, address: str, port: int, rank: int, world_size: int, group_name: str,
    timeout_s: float = 300.0,
):  # fmt: skip
    """Join (rank 0: host) the group; returns it once every rank has joined. torch has no public
    API for a second 'world', so this uses the c10d helpers every RL framework uses for it."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group) -> None:
    """Leave a group joined by `join_group`. Its connections close once the last reference to
    it is dropped, which is what ends a collective the other ranks still wait in: the caller
    must not keep one."""
    import torch

    torch.distributed.destroy_process_group(group)


def receive_broadcast(group, dtypes: list[str], shapes: list[list[int]], device: str = "cpu"):
    """The tensors rank 0 broadcasts next, in order (torch dtype names such as "bfloat16")."""
    import torch

    tensors = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        torch.distributed.broadcast(tensor, src=0, group=group)
        tensors.append(tensor)
    return tensors
