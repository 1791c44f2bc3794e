"""megatron-core 0.16.1's CUDA assumptions, worked around for CPU runs (tests, benchmarks).

Applied once per process by `apply_cpu_workarounds()`, and only when the backend's device is CPU
(a rank process of its own); on GPUs megatron-core runs unchanged. What each patch replaces
(everything else -- GPTModel, the tensor-parallel layers and their sequence-parallel
communication, vocab-parallel cross entropy -- runs as shipped, on gloo):

1. `torch.cuda.current_device()` answers "cpu". megatron-core places what it allocates on the
   forward / backward path there: the RoPE frequencies and the MoE router's weight (moved there on
   first use), its scratch buffer, the sequence-parallel gather / reduce-scatter outputs (in
   `tensor_parallel.mappings` and the linear layers' backward) -- about thirty call sites. Without
   CUDA the call raises, so only calls that would fail change; with CUDA present (a CPU run on a
   GPU machine) they would put tensors on the GPU.
2. `CudaRNGStatesTracker` forks CUDA generator states (weight init and dropout inside
   model-parallel regions); a tracker with the same interface over the CPU generator is installed.

One fix applies on every device without Transformer Engine (this backend's local spec needs
none), by `define_missing_te_names()`: megatron-core 0.16.1's MoE router gating reads
`moe_utils.te_general_gemm`, a name bound only when TE imports (NameError otherwise); binding it
to None sends the router down Megatron's own torch path.

MoE also needs, as configuration rather than patches (`bridge.runtime_overrides`): the allgather
token dispatcher (alltoall opens a `torch.cuda.Stream()` when built) and no grouped GEMM; and
sequence parallelism needs norms that allow it (`bridge.RMSNorm`: megatron-core's torch norm
refuses it, its own needs Apex).

Still unsupported on CPU (megatron-core assumes CUDA too widely there): its DDP wrapper,
`get_megatron_optimizer`/DistributedOptimizer and `dist_checkpointing` -- the CPU backend uses a
torch optimizer and its own sharded save -- plus TE/Apex kernels, RoPE / gradient-accumulation
fusion and persistent layer norm (the model config switches them off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_APPLIED: list[bool] = []  # a flag, not state: patches are per process and idempotent


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


def _cpu_current_device() -> str:
    return "cpu"


def apply_cpu_workarounds() -> None:
    """Patch megatron-core for CPU in this process (idempotent; never call it on a GPU run)."""
    if _APPLIED:
        return
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = _cpu_current_device
    define_missing_te_names()
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
