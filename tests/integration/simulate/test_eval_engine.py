"""`clawrl eval` against a real CPU engine (the tiny model): every held-out question asked once,
greedily, of the base model or of a LoRA adapter named policy-vN, and scored with the same
preference check as the simulated user's."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from openai import OpenAI

from clawrl.common.models import resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.simulate.main import evaluate, parse_args
from clawrl.simulate.preference import satisfies, verdict
from clawrl.simulate.questions import held_out_questions
from tests.integration.engine.lora_adapters import make_adapter

pytestmark = [pytest.mark.integration]

MODEL = "smollm2-tiny"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def url(engine_factory, tmp_path_factory) -> str:
    adapter = make_adapter(
        resolve_model_dir(ModelSettings(path=MODEL)),
        Path(tmp_path_factory.mktemp("adapter")) / "v3",
        seed=3,
        scale=0.5,  # large enough to change greedy replies
    )
    return engine_factory(
        MODEL, "--lora-paths", f"policy-v3={adapter}", "--max-lora-rank", "8",
        "--lora-target-modules", "all",
    )  # fmt: skip


def greedy_replies(url: str, lora: str | None) -> list[str]:
    """The engine's own greedy replies, one question at a time."""
    client = OpenAI(base_url=f"{url}/v1", api_key="local")
    replies = []
    for question in held_out_questions():
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"lora_path": lora} if lora else None,
        )  # fmt: skip
        replies.append(reply.choices[0].message.content or "")
    return replies


def score_line(version: int, replies: list[str]) -> str:
    met = sum(satisfies(r) for r in replies)
    missed = Counter(verdict(r).value for r in replies if not satisfies(r))
    why = ", ".join(f"{name} {count}" for name, count in sorted(missed.items()))
    return f"v{version}: held-out score {met / 32:.3f} ({met}/32" + (
        f"; missed: {why})" if why else ")"
    )


def run_eval(url: str, *extra: str) -> int:
    argv = ["eval", "--base-url", f"{url}/v1", "--max-tokens", str(MAX_TOKENS), *extra]
    return asyncio.run(evaluate(parse_args(argv)))


def test_clawrl_eval_scores_the_base_model_and_an_adapter(url, capsys) -> None:
    base, adapted = greedy_replies(url, None), greedy_replies(url, "policy-v3")
    assert base != adapted  # the adapter answers differently: lora_path reached the engine
    assert run_eval(url) == 0
    assert capsys.readouterr().out.strip() == score_line(0, base)
    assert run_eval(url, "--lora", "policy-v3") == 0
    assert capsys.readouterr().out.strip() == score_line(3, adapted)


def test_clawrl_eval_fails_clearly(url, capsys) -> None:
    assert run_eval(url, "--lora", "policy-v9") == 1  # not loaded: the engine refuses it
    assert "held-out question" in capsys.readouterr().err
    assert run_eval("http://127.0.0.1:9", "--model", MODEL) == 1  # nothing listens there
    assert "held-out question" in capsys.readouterr().err


def test_simulate_scores_each_version_pinned_on_the_engine(url) -> None:
    """With --engine-url, `clawrl simulate`'s evaluator asks the engine pinned to the newest
    version's adapter (the base model for v0): a sync cannot split the evaluation, so each
    version it reaches is scored whole."""
    from clawrl.simulate.main import Evaluator
    from clawrl.simulate.simulation import Progress

    args = parse_args(["simulate", "--base-url", "http://127.0.0.1:9/v1",
                       "--engine-url", url, "--max-tokens", str(MAX_TOKENS)])  # fmt: skip
    base, adapted = greedy_replies(url, None), greedy_replies(url, "policy-v3")

    async def scores() -> tuple[float, float, int]:
        # One loop: the evaluator's clients keep their connections to it.
        evaluator = Evaluator(OpenAIAsync(), MODEL, args)
        progress = Progress()
        found = []
        for version in (0, 3):
            progress.newest_version = version
            assert evaluator.behind(progress)
            assert await evaluator.once(progress.newest_version)
            found.append(evaluator.found[version].score)
            # The engine also scored the replies on its base weights (fluency kept).
            assert evaluator.found[version].base_nll > 0
        return found[0], found[1], evaluator.failures

    base_score, adapted_score, failures = asyncio.run(scores())
    assert base_score == sum(satisfies(r) for r in base) / 32
    assert adapted_score == sum(satisfies(r) for r in adapted) / 32
    assert failures == 0


def OpenAIAsync():
    """A gateway client that must not be used: nothing listens there."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0)


def hf_mean_nll(exchanges: list[tuple[str, str]]) -> tuple[float, int]:
    """The tiny model's mean NLL per reply token, by a plain transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from clawrl.simulate.fluency import renderer_for

    renderer = renderer_for(MODEL)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(ModelSettings(path=MODEL)))
    total, tokens = 0.0, 0
    for question, reply in exchanges:
        prompt = renderer.render_ids([{"role": "user", "content": question}])
        ids = renderer.tokenizer.encode(reply, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        total -= logprobs[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
        tokens += len(ids)
    return total / tokens, tokens


def test_clawrl_eval_scores_the_replies_base_nll(url, capsys) -> None:
    """With --engine-url, `clawrl eval` also prints the base model's mean NLL per token of the
    replies, each one scored after its question with no adapter: the same figure as a plain
    forward pass, for the base model's replies and for the adapter's."""
    for lora, version in ((None, 0), ("policy-v3", 3)):
        replies = greedy_replies(url, lora)
        assert run_eval(url, "--engine-url", url, *(["--lora", lora] if lora else [])) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[0] == score_line(version, replies)
        expected, tokens = hf_mean_nll(list(zip(held_out_questions(), replies, strict=True)))
        prefix = f"v{version}: base NLL per token "
        assert lines[1].startswith(prefix) and lines[1].endswith(f" ({tokens} reply tokens)")
        assert float(lines[1].removeprefix(prefix).split()[0]) == pytest.approx(expected, rel=2e-3)
