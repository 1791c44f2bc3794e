"""megatron-core 0.16.1's CUDA assumptions, worked around for CPU runs (tests, benchmarks).

Applied once per process by `apply_cpu_workarounds()`, and only when the backend's device is CPU;
on GPUs megatron-core runs unchanged. What each patch replaces (everything else -- GPTModel, the
tensor-parallel layers, vocab-parallel cross entropy -- runs as shipped, on gloo):

1. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on first use; the
   replacement computes the same embedding on the device `inv_freq` already lives on.
2. `GlobalMemoryBuffer.get_tensor` allocates its scratch buffer on CUDA; the replacement
   allocates on CPU.
3. `CudaRNGStatesTracker` forks CUDA generator states (weight init and dropout inside
   model-parallel regions); a tracker with the same interface over the CPU generator is installed.
4. `Router.gating` (MoE) moves the router's weight to `torch.cuda.current_device()` when it finds
   it on CPU; the replacement computes the same gating linear where the weight lives.

One fix applies on every device without Transformer Engine (this backend's local spec needs
none), by `define_missing_te_names()`: megatron-core 0.16.1's MoE router gating reads
`moe_utils.te_general_gemm`, a name bound only when TE imports (NameError otherwise); binding it
to None sends the router down Megatron's own torch path.

MoE also needs, as configuration rather than patches (`bridge.runtime_overrides`): the allgather
token dispatcher (alltoall opens a `torch.cuda.Stream()` when built) and no grouped GEMM.

Still unsupported on CPU (megatron-core assumes CUDA too widely there): its DDP wrapper,
`get_megatron_optimizer`/DistributedOptimizer and `dist_checkpointing` -- the CPU backend uses a
torch optimizer and its own sharded save -- plus TE/Apex kernels, RoPE / gradient-accumulation
fusion, persistent layer norm and sequence parallelism (the model config switches them off).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from functools import reduce

import torch

_APPLIED: list[bool] = []  # a flag, not state: patches are per process and idempotent


def _rope_emb_in_place(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb without the move to CUDA: emb [s, 1, 1, dim]."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _cpu_buffer_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    """GlobalMemoryBuffer.get_tensor allocating on CPU."""
    required_len = reduce(operator.mul, tensor_shape, 1)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required_len:
        buffer = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buffer
    return buffer[0:required_len].view(*tensor_shape)


def _router_gating_in_place(self, input: torch.Tensor) -> torch.Tensor:
    """Router.gating without the move to CUDA: logits in the router dtype."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        self.config.moe_router_dtype, input.dtype
    )
    return router_gating_linear(input, self.weight, self.bias, router_dtype)


def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Named RNG streams over the CPU generator (same contract as the CUDA tracker)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def define_missing_te_names() -> None:
    """Bind `moe_utils.te_general_gemm` to None when Transformer Engine is absent (any device)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_workarounds() -> None:
    """Patch megatron-core for CPU in this process (idempotent; never call it on a GPU run)."""
    if _APPLIED:
        return
    from megatron.core import utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.router import Router

    RotaryEmbedding.get_emb = _rope_emb_in_place
    Router.gating = _router_gating_in_place
    define_missing_te_names()
    utils.GlobalMemoryBuffer.get_tensor = _cpu_buffer_tensor
    tp_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _APPLIED.append(True)


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """CPU counterpart of `model_parallel_cuda_manual_seed`: the same named streams and offsets."""
    from megatron.core.tensor_parallel import random as tp_random

    torch.manual_seed(seed)
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * tp_rank)
