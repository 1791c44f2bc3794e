"""The demo's learning measured offline, without the stack: a LoRA adapter of SmolLM2-135M (rank
16, alpha 32, all seven projections) learns the simulated user's preference with token-mean
REINFORCE (advantage = reward - batch mean, AdamW, clip 1.0) on batches of training questions
sampled with transformers; the held-out score (greedy, the 32 held-out questions) every few
steps. Per step it prints what says whether learning works at all: the reward and each reply's
verdict (p pleased, l layout, t too short, r repetitive), the gradient norm, and on the same batch
how much the step moved the mean log-prob of the rewarded replies and of the others. Asserts
nothing.

    .venv/bin/python tests/bench/bench_preference_offline.py [--steps 10] [--eval-every 5]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.simulate.preference import satisfies, verdict
from clawrl.simulate.questions import held_out_questions, training_question

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def generate(model, tokenizer, questions: list[str], max_tokens: int, temperature: float):
    """(prompt encoding, response ids [B, T]) for the questions, sampled (greedy at 0)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    sampling = {"do_sample": True, "temperature": temperature} if temperature else {}
    with torch.no_grad():
        out = model.generate(**encoded, max_new_tokens=max_tokens, top_p=None, top_k=None,
                             pad_token_id=tokenizer.pad_token_id, **sampling)  # fmt: skip
    return encoded, out[:, encoded.input_ids.shape[1] :]


def response_mask(response: torch.Tensor, eos: int) -> torch.Tensor:
    """response: [B, T] -> [B, T] 1.0 up to and including the first EOS (padding after it)."""
    is_eos = response == eos
    length = torch.where(is_eos.any(1), is_eos.float().argmax(1), response.shape[1])
    return (torch.arange(response.shape[1])[None] <= length[:, None]).float()


def response_logp(model, encoded, response: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of the response tokens after their prompts."""
    ids = torch.cat([encoded.input_ids, response], 1)
    attention = torch.cat([encoded.attention_mask, torch.ones_like(response)], 1)
    start = encoded.input_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, start - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, response[..., None])[..., 0]


def held_out_score(model, tokenizer, max_tokens: int) -> float:
    questions = held_out_questions()
    met = 0
    for i in range(0, len(questions), 16):
        _, out = generate(model, tokenizer, questions[i : i + 16], max_tokens, 0.0)
        met += sum(satisfies(tokenizer.decode(o, skip_special_tokens=True)) for o in out)
    return met / len(questions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--eval-every", type=int, default=5, help="0: no held-out score")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_model_dir(ModelSettings(path=args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=PROJECTIONS))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(args.seed)
    started = time.monotonic()

    def elapsed() -> str:
        return f"({time.monotonic() - started:.0f}s)"

    if args.eval_every:
        model.eval()
        print(f"step 0: held-out {held_out_score(model, tokenizer, args.max_tokens):.3f}",
              elapsed(), flush=True)  # fmt: skip
    for step in range(1, args.steps + 1):
        model.eval()
        questions = [training_question(rng) for _ in range(args.batch)]
        encoded, response = generate(model, tokenizer, questions, args.max_tokens,
                                     args.temperature)  # fmt: skip
        replies = [tokenizer.decode(r, skip_special_tokens=True) for r in response]
        reward = torch.tensor([1.0 if satisfies(r) else -1.0 for r in replies])
        advantage = reward - reward.mean()
        mask = response_mask(response, tokenizer.eos_token_id)
        model.train()
        logp = response_logp(model, encoded, response)
        loss = -(advantage[:, None] * logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        # Did the step raise the rewarded replies' probability, on the very same batch?
        with torch.no_grad():
            moved = ((response_logp(model, encoded, response) - logp) * mask).sum(1) / mask.sum(1)
        liked, other = moved[reward > 0], moved[reward < 0]
        kinds = "".join(verdict(r).value[0] for r in replies)
        print(f"step {step}: reward {reward.mean():+.2f} [{kinds}] grad {grad_norm:.3f} "
              f"mean dlogp rewarded {liked.mean():+.4f} others {other.mean():+.4f}", elapsed(),
              flush=True)  # fmt: skip
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            print(f"step {step}: held-out {held_out_score(model, tokenizer, args.max_tokens):.3f}",
                  elapsed(), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
