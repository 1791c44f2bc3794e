"""One rank of the multi-process equivalence check: `python -m tests.integration.megatron.tp_ranks
RANK TP PORT` loads each tiny family into Megatron at TP (gloo), and prints one JSON line with
the max abs differences to HF transformers: log-probs, entropy, every weight gathered back from
the shards, every gradient, and the TP-aware gradient norm."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from clawrl.trainer.megatron import logprobs as vp
from clawrl.trainer.megatron.cpu_compat import apply_cpu_workarounds, seed_model_parallel_rng
from clawrl.trainer.megatron.layout import ModelShape
from clawrl.trainer.megatron.mapping import megatron_to_hf
from clawrl.trainer.megatron.model import build_gpt_model, load_hf_weights
from clawrl.trainer.megatron.rank import allreduce_qk_norm_grads, causal_mask, tp_clip_grad_norm
from tests.unit.megatron.tiny import hf_tensors, random_hf_model, tiny_configs


def gather(tensors: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    shards: list = [None] * tp
    dist.all_gather_object(shards, {k: v.detach().contiguous() for k, v in tensors.items()})
    return shards


def check_family(config, rank: int, tp: int) -> dict[str, float]:
    hf = random_hf_model(config)
    shape = ModelShape.from_hf_config(config)
    model = build_gpt_model(config, tp, torch.float32, torch.device("cpu"))
    load_hf_weights(model, hf_tensors(hf), shape, rank, tp)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)[None].expand(2, -1)
    weights = torch.linspace(-1, 1, 11)  # a loss that pushes some tokens up and others down

    logits = model(ids, positions, causal_mask(12, torch.device("cpu")))[:, :-1]
    logp = vp.token_logprobs(logits, ids[:, 1:], config.vocab_size, rank)
    entropy = vp.token_entropy(logits, config.vocab_size, rank)
    topk = vp.logprobs_at(logits, ids[:, 1:, None].expand(-1, -1, 3) + torch.arange(3),
                          config.vocab_size, rank)  # fmt: skip
    (logp * weights).sum().backward()
    allreduce_qk_norm_grads(model)
    grad_norm = tp_clip_grad_norm(list(model.parameters()), max_norm=1e9)

    ref_all = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1]
    ref_logp = ref_all.gather(-1, ids[:, 1:, None])[..., 0]
    (ref_logp * weights).sum().backward()
    ref_ids = (ids[:, 1:, None] + torch.arange(3)).clamp(max=config.vocab_size - 1)
    ref_topk = ref_all.gather(-1, ref_ids)
    valid_topk = ids[:, 1:, None] + torch.arange(3) < config.vocab_size

    params = gather({n: p for n, p in model.named_parameters()}, tp)
    grads = gather({n: p.grad for n, p in model.named_parameters()}, tp)
    full_params, full_grads = megatron_to_hf(params, shape), megatron_to_hf(grads, shape)
    ref_params = hf_tensors(hf)
    ref_grads = {n: p.grad for n, p in hf.named_parameters() if n in ref_params}
    ref_norm = torch.sqrt(sum(g.square().sum() for g in ref_grads.values()))
    return {
        "logp": (logp - ref_logp).abs().max().item(),
        "entropy": (entropy - (-(ref_all.exp() * ref_all).sum(-1))).abs().max().item(),
        "topk": (topk - ref_topk)[valid_topk].abs().max().item(),
        "weights_equal": all(torch.equal(full_params[n], t) for n, t in ref_params.items())
        and sorted(full_params) == sorted(ref_params),
        "grads": max((full_grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "grad_norm": abs(grad_norm - ref_norm.item()) / ref_norm.item(),
    }


def main() -> None:
    rank, tp, port = (int(arg) for arg in sys.argv[1:4])
    apply_cpu_workarounds()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_model_parallel_rng(0, rank)
    result = {family: check_family(config, rank, tp) for family, config in tiny_configs().items()}
    print(json.dumps({"rank": rank, "tp": tp, "families": result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
