"""One rank of the multi-process equivalence check: `python -m tests.integration.megatron.tp_ranks
RANK TP PORT DIR` saves each tiny family under DIR, loads it into Megatron at TP (gloo) through
mbridge, and prints one JSON line with the max abs differences to HF transformers: log-probs,
entropy, top-K log-probs, the weights exported back through mbridge, the gradients (as the
weights exported after one SGD step of lr 1 on both sides) and the TP-aware gradient norm.
At TP > 1 every family runs with sequence parallelism, and the dense ones also without it
("<family>/no_sp", with the max differences between the two runs' log-probs and steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from clawrl.trainer.megatron import bridge as mb
from clawrl.trainer.megatron import logprobs as vp
from clawrl.trainer.megatron.cpu_compat import apply_cpu_workarounds, seed_model_parallel_rng
from clawrl.trainer.megatron.layout import ModelShape
from clawrl.trainer.megatron.rank import (
    allreduce_partial_grads,
    causal_mask,
    tp_clip_grad_norm,
)
from tests.unit.megatron.tiny import random_hf_model, tiny_configs


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if sorted(got) != sorted(want):
        return float("inf")
    return max((got[n] - t).abs().max().item() for n, t in want.items())


def saved(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as its checkpoint holds them (transformers 5 fuses Qwen3-MoE's experts
    in memory and writes them one by one). Every rank holds the same model; under
    torch.distributed transformers writes from rank 0 only."""
    model.save_pretrained(directory)
    dist.barrier()
    return load_file(directory / "model.safetensors")


def check_family(
    config, rank: int, tp: int, directory: Path, sequence_parallel: bool
) -> tuple[dict[str, float], torch.Tensor, dict[str, torch.Tensor]]:
    """-> (the differences to transformers, the log-probs, the weights after the SGD step)."""
    hf = random_hf_model(config)
    ref_params = saved(hf, directory)
    shape = ModelShape.from_hf_config(config)
    bridge = mb.make_bridge(config, shape, tp, torch.float32, False, sequence_parallel)
    assert bridge.config.sequence_parallel == (sequence_parallel and tp > 1)
    model = mb.build_model(bridge, config, torch.device("cpu"))
    mb.load_hf_dir(bridge, model, directory)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)[None].expand(2, -1)
    weights = torch.linspace(-1, 1, 11)  # a loss that pushes some tokens up and others down

    logits = model(ids, positions, causal_mask(12, torch.device("cpu")))[:, :-1]
    logp = vp.token_logprobs(logits, ids[:, 1:], config.vocab_size, rank)
    entropy = vp.token_entropy(logits, config.vocab_size, rank)
    topk = vp.logprobs_at(logits, ids[:, 1:, None].expand(-1, -1, 3) + torch.arange(3),
                          config.vocab_size, rank)  # fmt: skip
    (logp * weights).sum().backward()
    allreduce_partial_grads(model)
    grad_norm = tp_clip_grad_norm(list(model.parameters()), max_norm=1e9)

    ref_all = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1]
    ref_logp = ref_all.gather(-1, ids[:, 1:, None])[..., 0]
    (ref_logp * weights).sum().backward()
    ref_ids = (ids[:, 1:, None] + torch.arange(3)).clamp(max=config.vocab_size - 1)
    ref_topk = ref_all.gather(-1, ref_ids)
    valid_topk = ids[:, 1:, None] + torch.arange(3) < config.vocab_size

    exported = dict(mb.export_hf(bridge, model))
    weights_equal = sorted(exported) == sorted(ref_params) and all(
        torch.equal(exported[n], t) for n, t in ref_params.items()
    )
    ref_norm = torch.sqrt(sum(p.grad.square().sum() for p in hf.parameters()))
    with torch.no_grad():  # one SGD step of lr 1: the weights move by exactly the gradients
        for param in list(model.parameters()) + list(hf.parameters()):
            param.sub_(param.grad)
    stepped = {n: t.clone() for n, t in mb.export_hf(bridge, model)}
    return (
        {
            "logp": (logp - ref_logp).abs().max().item(),
            "entropy": (entropy - (-(ref_all.exp() * ref_all).sum(-1))).abs().max().item(),
            "topk": (topk - ref_topk)[valid_topk].abs().max().item(),
            "weights_equal": weights_equal,
            "grads": max_diff(stepped, saved(hf, directory / "stepped")),
            "grad_norm": abs(grad_norm - ref_norm.item()) / ref_norm.item(),
        },
        logp.detach(),
        stepped,
    )


def main() -> None:
    rank, tp, port = (int(arg) for arg in sys.argv[1:4])
    root = Path(sys.argv[4])
    apply_cpu_workarounds()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_model_parallel_rng(0, rank)
    result = {}
    for family, config in tiny_configs().items():
        result[family], logp, stepped = check_family(config, rank, tp, root / family, True)
        if tp > 1 and not hasattr(config, "num_experts"):  # MoE at TP > 1 needs SP
            diffs, logp_no_sp, stepped_no_sp = check_family(
                config, rank, tp, root / f"{family}_no_sp", False
            )
            diffs["logp_vs_sp"] = (logp - logp_no_sp).abs().max().item()
            diffs["step_vs_sp"] = max_diff(stepped, stepped_no_sp)
            result[f"{family}/no_sp"] = diffs
    print(json.dumps({"rank": rank, "tp": tp, "families": result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
