"""`clawrl eval` against a real CPU engine (the tiny model): every held-out question asked once,
greedily, and scored with the same preference check as the simulated user's."""

from __future__ import annotations

import asyncio

import pytest
from openai import OpenAI

from clawrl.simulate.main import evaluate, parse_args
from clawrl.simulate.preference import satisfies
from clawrl.simulate.questions import held_out_questions

pytestmark = [pytest.mark.integration]

MODEL = "smollm2-tiny"
MAX_TOKENS = 40


def expected_line(url: str, version: int, lora: str | None = None) -> str:
    """The score computed here from the engine's own greedy replies, one question at a time."""
    client = OpenAI(base_url=f"{url}/v1", api_key="local")
    met = 0
    for question in held_out_questions():
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"lora_path": lora} if lora else None,
        )  # fmt: skip
        met += satisfies(reply.choices[0].message.content or "")
    return f"v{version}: held-out score {met / 32:.3f} ({met}/32)"


def test_clawrl_eval_scores_the_held_out_questions(engine_factory, capsys) -> None:
    url = engine_factory(MODEL)
    args = parse_args(["eval", "--base-url", f"{url}/v1", "--max-tokens", str(MAX_TOKENS)])
    assert asyncio.run(evaluate(args)) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == expected_line(url, 0)


def test_clawrl_eval_refuses_an_unreachable_endpoint(capsys) -> None:
    args = parse_args(["eval", "--base-url", "http://127.0.0.1:9/v1", "--model", MODEL])
    assert asyncio.run(evaluate(args)) == 1
    assert "held-out question" in capsys.readouterr().err
