"""`clawrl judge-eval` end to end (the installed CLI, the judge core's real PRM and hint paths):
the scripted judges check the harness (perfect scores 1.0, the seeded coin its known figures),
and the logprob PRM runs on a real CPU engine with the tiny model (random weights: only the
mechanics are asserted, never its judgement), in judge-eval and in the judge service."""

from __future__ import annotations

import io
import json
import math
import subprocess

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.chat import ChatRenderer
from clawrl.common.settings import ModelSettings
from clawrl.common.sglang_client import SGLangClient
from clawrl.judge.audit import export
from clawrl.judge.prompts import Budget, judge_input, prm_yes_no_messages
from clawrl.judge.service import running
from clawrl.judge.settings import JudgeSettings
from clawrl.judge.verdicts import LogprobPRM, tokenizer_yes_no_ids
from tests.conftest import VENV_BIN

from .helpers import judge_settings, make_turn, put_turns, said, wait_samples

pytestmark = pytest.mark.integration

TINY = "smollm2-tiny"
TINY_VOCAB = 49152  # every id among the top log-probs: the tiny model's yes/no are always seen


def judge_eval(*args: str) -> dict:
    done = subprocess.run(
        [str(VENV_BIN / "clawrl"), "judge-eval", *args, "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tiny_engine(engine_factory) -> str:
    return engine_factory(TINY)


def test_a_perfect_judge_scores_one_through_the_real_parsers() -> None:
    found = judge_eval("--judge", "scripted:perfect")
    assert found["accuracy"] == 1.0 and found["accuracy_all"] == 1.0
    assert found["hint_yield"] == 1.0 and found["false_hint_rate"] == 0.0
    assert found["parse_rate"] == 1.0 and found["vote_agreement"] == 1.0
    assert found["votes"] == 3 * found["cases"]
    confusion = found["confusion"]
    assert sum(confusion[g][p] for g in confusion for p in confusion[g] if g != p) == 0


def test_a_coin_flipping_judge_scores_its_seeds_figures() -> None:
    found = judge_eval("--judge", "scripted:random", "--seed", "0")
    # The coin says good or bad, never neutral: about half of the +1/-1 cases, none of the 0s.
    assert found["accuracy"] == 0.5 and found["accuracy_all"] == pytest.approx(16 / 46)
    assert found["accuracy_all"] < 0.8 and found["confusion"]["0"]["0"] == 0
    assert found["parse_rate"] == 1.0 and found["vote_agreement"] < 1.0
    assert found["false_hint_rate"] > 0.5  # a coin gives hints where none belongs
    assert judge_eval("--judge", "scripted:random", "--seed", "1")["accuracy"] == 0.5625


def test_bad_options_are_refused_with_a_reason() -> None:
    done = subprocess.run(
        [str(VENV_BIN / "clawrl"), "judge-eval", "--judge", "scripted:perfect", "--prm", "logprob"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--prm logprob reads an engine's log-probs" in done.stderr
    with pytest.raises(
        ValueError, match=r"judging\.prm=logprob reads the judge model's next-token"
    ):
        JudgeSettings(
            judging={"prm": "logprob"},
            backend={"kind": "openai", "openai_base_url": "http://x/v1", "openai_model": "m"},
        )


def test_judge_eval_logprob_on_a_real_engine_gives_a_verdict_for_every_case(
    tiny_engine: str,
) -> None:
    found = judge_eval(
        "--judge", "engine", "--engine-url", tiny_engine, "--judge-model", TINY,
        "--prm", "logprob", "--top-logprobs", str(TINY_VOCAB), "--limit", "3",
        "--max-new-tokens", "4", "--votes", "1",
    )  # fmt: skip
    assert found["cases"] == 3 and found["prm"] == "logprob"
    assert found["parse_rate"] == 1.0 and found["votes"] == 3
    assert found["vote_agreement"] is None  # one verdict per case
    assert all(0.0 <= r["yes_share"] <= 1.0 for r in found["results"])
    assert all(r["predicted"] in (1, 0, -1) and r["votes"] == [r["predicted"]]
               for r in found["results"])  # fmt: skip


async def test_the_logprob_verdict_sums_the_engines_own_yes_and_no_probabilities(
    tiny_engine: str,
) -> None:
    renderer = ChatRenderer.from_settings(ModelSettings(path=TINY))
    ids = tokenizer_yes_no_ids(renderer.tokenizer)
    question, reply = (
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5."},
    )
    data = judge_input([question], reply, said("Wrong."), Budget())
    prompt = renderer.render_ids(prm_yes_no_messages(data))
    engine = SGLangClient(tiny_engine)
    try:
        verdict = await LogprobPRM(engine, ids, top_k=TINY_VOCAB, margin=0.2).verdict(prompt)
    finally:
        await engine.aclose()

    def probability(token: int) -> float:
        """The engine's log-prob of `token` right after the prompt, from another request."""
        meta = httpx.post(
            f"{tiny_engine}/generate",
            json={"input_ids": [*prompt, token], "return_logprob": True,
                  "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 0}},
            timeout=60,
        ).json()["meta_info"]  # fmt: skip
        return math.exp(meta["input_token_logprobs"][-1][0])

    assert verdict.error is None and verdict.score in (1, 0, -1)
    assert verdict.p_yes == pytest.approx(sum(map(probability, ids.yes)), rel=1e-3)
    assert verdict.p_no == pytest.approx(sum(map(probability, ids.no)), rel=1e-3)
    share = verdict.p_yes / (verdict.p_yes + verdict.p_no)
    assert verdict.score == (1 if share > 0.7 else -1 if share < 0.3 else 0)


async def test_the_judge_service_scores_rl_turns_by_logprob(
    redis: Redis, redis_url: str, tiny_engine: str
) -> None:
    settings = judge_settings(
        redis_url,
        model={"path": TINY},
        backend={"kind": "sglang", "engine_url": tiny_engine},
        judging={"prm": "logprob", "prm_top_logprobs": TINY_VOCAB,
                 "promote_first_in_session": False},
    )  # fmt: skip
    await put_turns(redis, settings, [make_turn("lp", 0, next_state=said("Wrong."))])
    async with running(settings, serve=False) as service:
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=60)
        counted = service.metrics.votes.labels("prm", "valid")._value.get()
    out = io.BytesIO()
    await export(redis, settings.audit.stream, out)
    (record,) = map(orjson.loads, out.getvalue().splitlines())
    assert sample.reward_source == "prm:logprob" and record["reward_source"] == "prm:logprob"
    verdict = record["prm_logprob"]
    assert verdict["p_yes"] + verdict["p_no"] > 0 and verdict["score"] in (1, 0, -1)
    assert record["score"] == verdict["score"] == sample.reward
    assert list(sample.votes) == [verdict["score"]] and counted == 1
    assert "votes" not in record  # no sampled vote was asked
