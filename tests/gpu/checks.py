"""GPU checks of the Megatron backend (one GPU, NCCL, no Ray): run by tests/gpu/run_checks.sh.

1. Log-probs of Megatron's GPTModel (fp32, TP=1, NCCL group of one, loaded through mbridge)
   equal transformers' on the same tokens, for tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE
   models, and mbridge's export gives back the checkpoint's tensors; prints the max abs
   differences.
2. PPO steps on a fixed batch in bf16 with Megatron's DDP + optimizer: the loss falls and a
   positive advantage raises its tokens' log-probs; prints tokens/s of a step on the largest
   model of the list that fits the time (random weights of a real model's shape).
3. The weight broadcast of that trained model (`connect_engines` + `broadcast_weights`, the
   path of `weight_sync.transport = nccl`) to a receiver process that joins the group as an
   engine does (tests/integration/megatron/recording_engine.py): over NCCL into the second GPU
   when one is visible, else over gloo from the GPU-resident weights (NCCL refuses two ranks on
   one device); every tensor must arrive (checksums); prints GiB/s.
TP=2 needs two GPUs (NCCL refuses two ranks on one device); on one GPU only TP=1 runs here.
Prints figures; exits non-zero when a check fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from clawrl.trainer.backend import TrainBatch  # noqa: E402
from clawrl.trainer.losses import LossConfig  # noqa: E402
from clawrl.trainer.megatron.nccl_sync import Engine  # noqa: E402
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


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def start_receiver(device: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.integration.megatron.recording_engine", str(port), device]
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            get_json(url + "/health")
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the receiver did not start") from None
            time.sleep(0.5)


def broadcast_check(r: MegatronRank) -> list[str]:
    """Check 3 (see the module docstring) on the trained rank `r`; -> failures."""
    if torch.cuda.device_count() >= 2:
        backend, device, env = "nccl", "cuda", {"CUDA_VISIBLE_DEVICES": "1"}
    else:
        backend, device, env = "gloo", "cpu", {}
        print("[broadcast] one GPU: gloo from the GPU weights (NCCL needs a GPU per rank)")
    proc, url = start_receiver(device, env)
    try:
        r.connect_engines([Engine(url)], "127.0.0.1", 0, "gpu-check", 512 << 20, 300.0, backend)
        started = time.perf_counter()
        buckets = r.broadcast_weights(1)
        seconds = time.perf_counter() - started  # includes gathering the HF tensors
        init, *updates = get_json(url + "/recorded")
        received = {
            n: x for c in updates for n, x in zip(c["body"]["names"], c["sums"], strict=True)
        }
        hf = r.gather_hf()
        expected = {n: float(t.double().sum()) for n, t in hf.items()}
        gib = sum(t.numel() * t.element_size() for t in hf.values()) / 2**30
        print(f"[broadcast] {init['body']['backend']}: {len(received)} tensors, {gib:.2f} GiB "
              f"in {buckets} buckets, {seconds:.2f}s = {gib / seconds:.2f} GiB/s")  # fmt: skip
        wrong = [n for n in expected if abs(received.get(n, float("nan")) - expected[n])
                 > 1e-6 * max(1.0, abs(expected[n]))]  # fmt: skip
        failures = [f"broadcast: {len(wrong)} tensors differ or are missing"] if wrong else []
        if updates[-1]["body"].get("weight_version") != "1":
            failures.append("broadcast: the last bucket did not carry the version")
        return failures
    finally:
        r.disconnect_engines()
        proc.terminate()
        proc.wait(30)


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
        saved, exported = load_file(work / family / "model.safetensors"), r.gather_hf()
        wrong = sorted(set(saved) ^ set(exported)) or [
            n for n, t in saved.items() if not torch.equal(exported[n].cpu(), t)
        ]
        print(f"[export] {family}: {len(exported)} tensors, {len(wrong)} differ or are missing")
        if wrong:
            failures.append(f"{family} export differs from the checkpoint: {wrong[:3]}")
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
    failures += broadcast_check(r)
    r.close()
    for failure in failures:
        print("FAILED:", failure)
    print("all GPU checks passed" if not failures else f"{len(failures)} GPU check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
