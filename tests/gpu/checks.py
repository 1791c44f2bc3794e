"""GPU checks of the Megatron backend (one GPU, NCCL, no Ray): run by tests/gpu/run_checks.sh.

1. Log-probs of Megatron's GPTModel (fp32, TP=1, NCCL group of one) equal transformers' on the
   same tokens, for tiny random Llama / Qwen2 / Qwen3 models; prints the max abs difference.
2. PPO steps on a fixed batch in bf16 with Megatron's DDP + optimizer: the loss falls and a
   positive advantage raises its tokens' log-probs; prints tokens/s of a step on the largest
   model of the list that fits the time (random weights of a real model's shape).
TP=2 needs two GPUs (NCCL refuses two ranks on one device); on one GPU only TP=1 runs here.
Prints figures; exits non-zero when a check fails.
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.trainer.backend import TrainBatch  # noqa: E402
from clawrl.trainer.losses import LossConfig  # noqa: E402
from clawrl.trainer.megatron.rank import MegatronRank, RankConfig  # noqa: E402
from tests.unit.megatron.tiny import random_hf_model, tiny_configs  # noqa: E402

# A real model's shape (Qwen2.5-1.5B) with random weights: the step's cost, not its quality.
BIG = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def batch(vocab: int, size: int, prompt: int, response: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (size, prompt + response), generator=gen)
    mask = torch.ones(size, response)
    zeros = torch.zeros(size, response)
    return TrainBatch(
        sample_ids=tuple(f"g:{i}" for i in range(size)), input_ids=ids,
        prompt_lengths=torch.full((size,), prompt), response_lengths=torch.full((size,), response),
        loss_mask=mask, rollout_logp=zeros, teacher_logp=zeros,
        reward=torch.tensor([1.0 if i % 2 else -1.0 for i in range(size)]),
        has_teacher=torch.zeros(size, dtype=torch.bool),
        policy_versions=torch.zeros(size, dtype=torch.long),
    )  # fmt: skip


def hf_logprobs(model, b: TrainBatch) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(model(b.input_ids.cuda()).logits.float(), -1)
    p = int(b.prompt_lengths[0])
    targets = b.input_ids[:, p:].cuda()
    return logp[:, p - 1 : -1].gather(-1, targets[..., None])[..., 0].cpu()


def save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def rank(dtype: str, micro_tokens: int, lr: float = 1e-4) -> MegatronRank:
    cfg = RankConfig(tp=1, device="cuda", dtype=dtype, seed=0, micro_batch_tokens=micro_tokens,
                     lr=lr, beta1=0.9, beta2=0.98, weight_decay=0.0, grad_clip=1.0)  # fmt: skip
    return MegatronRank(0, "127.0.0.1", free_port(), cfg)


def main() -> int:
    failures = []
    work = Path(tempfile.mkdtemp())
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for family, config in tiny_configs().items():
        hf = random_hf_model(config).cuda()
        r = rank("float32", 4096)
        r.load(save(hf, work / family), load_reference=False)
        b = batch(config.vocab_size, 4, 8, 8)
        diff = (r.compute_logprobs(b) - hf_logprobs(hf, b)).abs().max().item()
        print(f"[logprobs] {family}: max |megatron - transformers| = {diff:.2e} (fp32, TP=1)")
        if diff > 1e-4:
            failures.append(f"{family} log-probs differ by {diff}")
        r.close()

    started = time.perf_counter()
    torch.manual_seed(0)
    big = AutoModelForCausalLM.from_config(BIG, dtype=torch.bfloat16)
    r = rank("bfloat16", 8 * 1024, lr=1e-5)
    r.load(save(big, work / "big"), load_reference=False)
    del big
    print(f"[ppo] Qwen2.5-1.5B-shaped model loaded in {time.perf_counter() - started:.1f}s")
    b = batch(BIG.vocab_size, 8, 512, 512)
    before = r.compute_logprobs(b)
    targets = b.with_targets(before, b.reward[:, None] * b.loss_mask)
    losses, times = [], []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(r.train_step(targets, LossConfig())["loss"])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    after = r.compute_logprobs(b)
    delta = (after - before).mean(dim=1)
    tokens = int(b.lengths.sum())
    step_s = sum(times[1:]) / len(times[1:])
    print(f"[ppo] losses {[round(x, 4) for x in losses]}; mean log-prob change per sample "
          f"{[round(x, 3) for x in delta.tolist()]}")  # fmt: skip
    print(f"[ppo] train step {step_s:.2f}s = {tokens / step_s:.0f} tokens/s (bf16, batch 8 x 1024,"
          f" peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)")  # fmt: skip
    if not losses[-1] < losses[0]:
        failures.append("the PPO loss did not fall")
    if not ((delta[1::2] > 0).all() and (delta[0::2] < 0).all()):
        failures.append("log-probs did not follow the advantage signs")
    r.close()
    for failure in failures:
        print("FAILED:", failure)
    print("all GPU checks passed" if not failures else f"{len(failures)} GPU check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
