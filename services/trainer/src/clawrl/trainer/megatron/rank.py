"""One tensor-parallel rank of the Megatron backend: its process group, its slice of the policy
(and of the frozen reference), its optimizer, and the step. The backend runs one per Ray actor;
every method is called on all ranks at once (they meet in the TP collectives).

Device split (DESIGN.md §4): the model, the parallel layout, the log-probs and the losses are
Megatron's everywhere, and Hugging Face weights go in and out through mbridge (`bridge.py`); on
CPU the optimizer is torch's AdamW with a TP-aware gradient clip and the checkpoint is one torch
file per rank; on GPUs it is Megatron's DDP + optimizer (fp32 master weights under bf16).
"""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from clawrl.trainer.backend import (
    TrainBatch,
    Which,
    accumulate_gradients,
    micro_batches,
    response_rows,
)
from clawrl.trainer.backend import response_targets as targets_of
from clawrl.trainer.losses import LossConfig, TokenTerms
from clawrl.trainer.megatron import bridge as mb
from clawrl.trainer.megatron import logprobs as vp
from clawrl.trainer.megatron.layout import ModelShape, check_tensor_parallel


@dataclass(frozen=True)
class RankConfig:
    """What every rank needs (picklable: it travels to the Ray actors)."""

    tp: int
    device: str  # "cpu" | "cuda"
    dtype: str  # "float32" | "bfloat16"
    seed: int
    micro_batch_tokens: int
    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    grad_clip: float
    sequence_parallel: bool = True  # applies at tp > 1


def node_address() -> str:
    """This node's IP as other machines reach it (Ray's view when present)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # no Ray here (the GPU checks): the host's own name
        return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def pad_to_multiple(input_ids: Tensor, multiple: int) -> Tensor:
    """Right-pad token ids [b, L] with 0 to a length divisible by `multiple`."""
    pad = -input_ids.shape[1] % multiple
    return torch.nn.functional.pad(input_ids, (0, pad)) if pad else input_ids


def causal_mask(length: int, device: torch.device) -> Tensor:
    """Megatron's boolean attention mask [1, 1, L, L]: True where attention is NOT allowed.
    Right padding needs nothing more: a pad position is never attended by a real one."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


def tp_clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip gradients by the norm of the full (unsharded) model: sharded grads count on every
    rank, replicated ones (norms) on rank 0 only; the squares are summed over the TP group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    counted = [
        p.grad.float()
        for p in params
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)
    ]
    device = grads[0].device if grads else torch.device("cpu")
    square = sum((g.square().sum() for g in counted), torch.zeros((), device=device))
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
    norm = float(square.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        for grad in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def allreduce_partial_grads(model: torch.nn.Module) -> None:
    """Replicated weights whose gradients are partial sums on each rank, added up over the TP
    group (Megatron's finalize_model_grads does the same on GPU): QK-norm weights (each rank
    applies them to its own heads), and under sequence parallelism every weight marked
    `sequence_parallel` (norms, the MoE router: each rank sees its part of the sequence)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        partial = getattr(param, "sequence_parallel", False) or (
            "q_layernorm" in name or "k_layernorm" in name
        )
        if param.grad is not None and partial:
            torch.distributed.all_reduce(param.grad, group=group)


class MegatronRank:
    """See the module docstring. `rank` is this process's rank in a world of `cfg.tp` ranks."""

    def __init__(self, rank: int, master_addr: str, master_port: int, cfg: RankConfig) -> None:
        self.rank = rank
        self.cfg = cfg
        self.device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
        self.dtype = getattr(torch, cfg.dtype)
        if self.device.type == "cpu":
            from clawrl.trainer.megatron.cpu_compat import apply_cpu_workarounds

            apply_cpu_workarounds()
        else:
            torch.cuda.set_device(self.device)  # Ray shows each actor only its own GPU
        torch.distributed.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=cfg.tp,
        )
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._seed(cfg.seed)
        self.model_dir: Path | None = None
        self.shape: ModelShape | None = None
        self.model = None
        self.reference = None
        self.optimizer = None

    def _seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
        else:
            from clawrl.trainer.megatron.cpu_compat import seed_model_parallel_rng

            seed_model_parallel_rng(seed, self.tp_rank)

    # --- loading ---------------------------------------------------------------------------------

    def _build(self, hf_config):
        model = mb.build_model(self.bridge, hf_config, self.device)
        mb.load_hf_dir(self.bridge, model, self.model_dir)
        # Only the response rows go through the output layer (see `_response_logits`), which
        # gets them from the whole (gathered) sequence.
        model.post_process = False
        model.output_layer.sequence_parallel = False
        return model

    def load(self, model_dir: Path, *, load_reference: bool) -> None:
        """Build and load the policy (and reference) slices and the optimizer."""
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.shape = ModelShape.from_hf_config(hf_config)
        check_tensor_parallel(self.shape, self.cfg.tp, self.cfg.sequence_parallel)
        on_gpu = self.device.type == "cuda"
        self.bridge = mb.make_bridge(
            hf_config, self.shape, self.cfg.tp, self.dtype, on_gpu, self.cfg.sequence_parallel
        )
        self.model = self._build(hf_config)
        self.model.train()
        if load_reference:
            self.reference = self._build(hf_config).eval().requires_grad_(False)
        self.optimizer = self._make_optimizer()

    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def _make_optimizer(self):
        if self.device.type == "cuda":
            return self._megatron_optimizer()
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.cfg.lr,
            betas=(self.cfg.beta1, self.cfg.beta2),
            weight_decay=self.cfg.weight_decay,
        )

    def _megatron_optimizer(self):
        """GPU: Megatron's DDP buffers + optimizer (fp32 master weights, grad clip built in)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = DistributedDataParallel(
            config=self.model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=False
            ),
            module=self.model,
        )
        config = OptimizerConfig(
            optimizer="adam",
            lr=self.cfg.lr,
            adam_beta1=self.cfg.beta1,
            adam_beta2=self.cfg.beta2,
            weight_decay=self.cfg.weight_decay,
            clip_grad=self.cfg.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=False,
        )
        return get_megatron_optimizer(config, [self.model])

    # --- forward ---------------------------------------------------------------------------------

    def _gpt(self, model):
        return model.module if hasattr(model, "module") else model

    def _response_logits(self, model, micro: TrainBatch) -> Tensor:
        """-> [b, R, v/tp]: this rank's vocab slice of the logits predicting each response token.

        Under sequence parallelism the decoder returns this rank's 1/TP of the sequence: the
        sequence is padded on the right to a multiple of TP (causal attention: the padding
        changes no real position) and gathered before the response rows are taken. The gather's
        backward only splits, as the output layer's input region all-reduces the rows' grads."""
        gpt = self._gpt(model)
        input_ids = micro.input_ids.to(self.device)
        sequence_parallel = gpt.config.sequence_parallel
        if sequence_parallel:
            input_ids = pad_to_multiple(input_ids, self.cfg.tp)
        length = input_ids.shape[1]
        positions = torch.arange(length, device=self.device)[None, :].expand_as(input_ids)
        hidden = model(input_ids, positions, causal_mask(length, self.device))  # [L(/tp), b, h]
        if sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        rows = response_rows(hidden.transpose(0, 1), micro.prompt_lengths, micro.response_width)
        weight = (
            gpt.shared_embedding_or_output_weight()
            if gpt.share_embeddings_and_output_weights
            else None
        )
        logits, _ = gpt.output_layer(rows.transpose(0, 1).contiguous(), weight=weight)
        return logits.transpose(0, 1)

    @staticmethod
    def _valid(micro: TrainBatch) -> Tensor:
        return (
            torch.arange(micro.response_width)[None, :] < micro.response_lengths[:, None]
        ).float()

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, which: Which = "policy") -> Tensor:
        model = self.model if which == "policy" else self.reference
        if model is None:
            raise RuntimeError("the reference model is not loaded (ppo.kl_coef is 0)")
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.size, batch.response_width)
        for group in micro_batches(batch.lengths.tolist(), self.cfg.micro_batch_tokens):
            micro = batch.select(group)
            logits = self._response_logits(model, micro)
            targets = targets_of(micro).to(self.device)
            logp = vp.token_logprobs(logits, targets, self.shape.vocab_size, self.tp_rank).cpu()
            out[group, : micro.response_width] = logp * self._valid(micro)
        model.train(was_training)
        return out

    # --- the step --------------------------------------------------------------------------------

    def _terms(self, micro: TrainBatch, cfg: LossConfig) -> TokenTerms:
        logits = self._response_logits(self.model, micro)
        vocab, rank = self.shape.vocab_size, self.tp_rank

        def dev(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(self.device)

        student_topk = teacher_topk = None
        if cfg.distill_coef and micro.teacher_topk_ids is not None:
            student_topk = vp.logprobs_at(logits, dev(micro.teacher_topk_ids), vocab, rank)
            teacher_topk = dev(micro.teacher_topk_logp)
        return TokenTerms(
            logp=vp.token_logprobs(logits, dev(targets_of(micro)), vocab, rank),
            old_logp=dev(micro.old_logp),
            advantages=dev(micro.advantages),
            mask=dev(micro.loss_mask),
            entropy=vp.token_entropy(logits if cfg.entropy_coef else logits.detach(), vocab, rank),
            ref_logp=dev(micro.ref_logp),
            rollout_logp=dev(micro.rollout_logp),
            student_topk_logp=student_topk,
            teacher_topk_logp=teacher_topk,
            has_teacher=dev(getattr(micro, "has_topk", None)),
        )

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, float]:
        if batch.old_logp is None or batch.advantages is None:
            raise ValueError("train_step needs old_logp and advantages (TrainBatch.with_targets)")
        started = time.perf_counter()
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=not on_gpu)
        totals = accumulate_gradients(
            batch, loss_cfg, self.cfg.micro_batch_tokens, lambda micro: self._terms(micro, loss_cfg)
        )
        forward_backward_s = time.perf_counter() - started
        optimizer_started = time.perf_counter()
        if on_gpu:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.model])  # DP sync + TP sums (QK-norm grads)
            _, grad_norm, _ = self.optimizer.step()
        else:
            allreduce_partial_grads(self.model)
            params = list(self.model.parameters())
            grad_norm = tp_clip_grad_norm(params, self.cfg.grad_clip)
            self.optimizer.step()
        totals["grad_norm"] = float(grad_norm)
        totals["forward_backward_s"] = forward_backward_s
        totals["optimizer_s"] = time.perf_counter() - optimizer_started
        return totals

    # --- weights out -----------------------------------------------------------------------------

    def local_parameters(self) -> dict[str, Tensor]:
        """This rank's slices by Megatron name (the DDP wrapper's prefix removed)."""
        return {name: param.detach() for name, param in self._gpt(self.model).named_parameters()}

    def gather_hf(self, device: str = "cpu") -> dict[str, Tensor] | None:
        """The full HF state dict on rank 0 (None elsewhere): mbridge's export, tensor by tensor
        (each one all-gathered over the TP group, so every rank iterates)."""
        hf = {}
        for name, tensor in mb.export_hf(self.bridge, self._gpt(self.model)):
            if self.rank == 0:
                hf[name] = tensor.to(device)
        return hf if self.rank == 0 else None

    def export_hf(self, path: Path) -> None:
        """Rank 0 writes config, safetensors and tokenizer files into `path`."""
        hf = self.gather_hf()
        if self.rank != 0:
            return
        from clawrl.trainer.megatron.export import write_hf_dir

        write_hf_dir(hf, self.model_dir, Path(path), self.dtype)

    # --- weight sync by broadcast (weight_sync.transport = nccl; see nccl_sync) -----------------

    def connect_engines(
        self, engines: list, master_address: str | None, master_port: int, group_name: str,
        bucket_bytes: int, timeout_s: float = 300.0, backend: str | None = None,
    ) -> None:  # fmt: skip
        """Rank 0 forms the broadcast group with the engines, at `master_address` (None: this
        node's IP) and `master_port` (0: a free one), on `backend` (None: NCCL on GPUs, gloo on
        CPU); other ranks do nothing."""
        if self.rank != 0:
            return
        import asyncio

        from clawrl.trainer.megatron.nccl_sync import BroadcastSender

        self.disconnect_engines()
        address = master_address or node_address()
        port = master_port or free_port()
        # The sender's HTTP clients live on one event loop, kept for every later sync.
        self._sync_loop = asyncio.new_event_loop()

        async def connect() -> BroadcastSender:
            sender = BroadcastSender(
                engines, address, port, group_name=group_name,
                backend=backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                bucket_bytes=bucket_bytes, timeout_s=timeout_s, device=str(self.device),
            )  # fmt: skip
            try:
                await sender.connect()
            except BaseException:
                await sender.aclose()
                raise
            return sender

        self._sender = self._sync_loop.run_until_complete(connect())

    def disconnect_engines(self) -> None:
        """Leave the broadcast group (after a failure, or before forming a new one)."""
        sender, self._sender = getattr(self, "_sender", None), None
        loop, self._sync_loop = getattr(self, "_sync_loop", None), None
        if loop is None:
            return
        if sender is not None:
            loop.run_until_complete(sender.aclose())
        loop.close()

    def broadcast_weights(self, version: int) -> int:
        """Gather the HF tensors from the TP shards (all ranks, through mbridge; kept on the
        device NCCL sends from) and broadcast them from rank 0 to the connected engines;
        -> buckets sent (0 on other ranks)."""
        hf = self.gather_hf(device=str(self.device))
        if self.rank != 0:
            return 0
        if getattr(self, "_sender", None) is None:
            raise RuntimeError("connect_engines() first")
        return self._sync_loop.run_until_complete(self._sender.send(sorted(hf.items()), version))

    # --- resumable state: one torch file per rank ------------------------------------------------

    def save_state(self, path: Path) -> None:
        directory = Path(path)
        if self.rank == 0:
            layout = {"tp": self.cfg.tp, "shape": asdict(self.shape)}
            (directory / "megatron_layout.json").write_text(json.dumps(layout, indent=1))
        state = {
            "model": self.local_parameters(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, directory / f"megatron_rank{self.rank:03d}.pt")
        torch.distributed.barrier()

    def load_state(self, path: Path) -> None:
        directory = Path(path)
        layout = json.loads((directory / "megatron_layout.json").read_text())
        if layout["tp"] != self.cfg.tp:
            raise ValueError(
                f"state in {directory} was saved at TP={layout['tp']}, this backend runs "
                f"TP={self.cfg.tp}; resume with the same layout or start from an HF export"
            )
        state = torch.load(directory / f"megatron_rank{self.rank:03d}.pt", map_location=self.device)
        params = dict(self._gpt(self.model).named_parameters())
        with torch.no_grad():
            for name, tensor in state["model"].items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.device.type == "cuda":
            self.optimizer.reload_model_params()  # fp32 master weights from the loaded ones
        torch.set_rng_state(state["rng"])

    def placement_group(self):
        import ray

        return ray.util.get_current_placement_group()

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
