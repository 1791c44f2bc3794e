"""Do the trainer's LoRA steps raise the probability of rewarded replies? SmolLM2-135M-Instruct
samples replies to fixed prompts; half are rewarded (+1) and half punished (-1), as a batch
baseline leaves them; two steps on that fixed batch must raise the mean log-prob of every
rewarded reply and lower every punished one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.common.models import resolve_model_dir
from clawrl.common.records import Sample
from clawrl.common.settings import ModelSettings
from clawrl.trainer.samples import collate
from clawrl.trainer.settings import LoraSettings, PPOSettings, TrainSettings
from clawrl.trainer.torch_backend import TorchBackend

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTIONS = (
    "What makes a good morning routine?",
    "How do I keep houseplants alive?",
    "Why is the sky blue?",
    "What should I pack for a weekend hike?",
    "How can I get better at chess?",
    "What is a healthy breakfast?",
    "How do I start learning to cook?",
    "Why do cats purr?",
)


@torch.no_grad()
def sample_replies(model_dir, count: int, new_tokens: int, seed: int = 0) -> list[Sample]:
    """`count` replies of up to `new_tokens` sampled (T=0.8) from the base model, as Samples
    with reward +1 for even indices and -1 for odd ones (advantages of a batch baseline)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    samples = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        out = model.generate(
            torch.tensor([prompt]), do_sample=True, temperature=0.8, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens // 2,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        response = out[0, len(prompt) :].tolist()
        samples.append(Sample(sample_id=f"q:{i}", session_id=f"q{i}", prompt_ids=prompt,
                              response_ids=response, old_logprobs=[0.0] * len(response),
                              loss_mask=[1.0] * len(response),
                              reward=1.0 if i % 2 == 0 else -1.0))  # fmt: skip
    return samples


def mean_logprob(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B]: each reply's mean token log-prob."""
    return (logp * mask).sum(dim=1) / mask.sum(dim=1)


def test_lora_steps_raise_the_probability_of_rewarded_replies() -> None:
    model_dir = resolve_model_dir(ModelSettings(path="SmolLM2-135M-Instruct"))
    batch = collate(sample_replies(model_dir, count=4, new_tokens=24))
    backend = TorchBackend(
        TrainSettings(num_threads=1), PPOSettings(lr=5e-4), lora=LoraSettings(enabled=True)
    )
    backend.load(model_dir, load_reference=False)
    before = mean_logprob(backend.compute_logprobs(batch), batch.loss_mask)
    advantages = batch.reward[:, None] * batch.loss_mask
    for _ in range(2):
        old = backend.compute_logprobs(batch)
        figures = backend.train_step(
            batch.with_targets(old, advantages), PPOSettings().loss_config()
        )
        assert figures["grad_norm"] > 0
    after = mean_logprob(backend.compute_logprobs(batch), batch.loss_mask)
    delta = after - before
    print(f"mean log-prob per reply: before {before.tolist()}, change {delta.tolist()}")
    rewarded, punished = batch.reward > 0, batch.reward < 0
    assert (delta[rewarded] > 0.02).all() and (delta[punished] < -0.02).all()
