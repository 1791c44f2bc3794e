"""The judge with real engines (the CPU engine serving SGLang's API): teacher log-probs that
equal the engine's own prompt log-probs of `hinted prompt + response`, the four combine cases,
votes through the engine's OpenAI-compatible API with the official client, and real PRM votes
from SmolLM2-135M (whose judgement is weak: only the mechanics are asserted)."""

from __future__ import annotations

import io
import itertools
import json

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.chat import ChatRenderer
from clawrl.common.proto.records_pb2 import MaskReason, SampleMode
from clawrl.judge.audit import export
from clawrl.judge.hints import inject_hint
from clawrl.judge.service import running
from clawrl.judge.votes import majority, parse_boxed

from .helpers import expected_teacher, judge_settings, make_turn, put_turns, said, wait_samples
from .scripted_judge import openai_backend, scripted_judge

pytestmark = pytest.mark.integration

TINY = "smollm2-tiny"
HINT = "Answer with the number only, and nothing else."
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Adds numbers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip


async def test_opd_teacher_logprobs_are_the_engines_over_hinted_prompt_and_response(
    redis: Redis, redis_url: str, tiny_engine: str, renderer: ChatRenderer
) -> None:
    votes = itertools.cycle(
        [f"\\boxed{{1}} [HINT_START]{HINT}[HINT_END]", "\\boxed{-1}", "\\boxed{1} no hint"]
    )
    response_ids = renderer.tokenizer.encode("The sum is 5.", add_special_tokens=False)
    async with scripted_judge(lambda kind, prompt: next(votes)) as judge:
        settings = judge_settings(
            redis_url,
            judging={"mode": "opd"},
            backend=openai_backend(judge.url, engine_url=tiny_engine),
            teacher={"top_k": 3},
            model={"path": TINY},
        )
        turn = make_turn("opd", 0, response="The sum is 5.", response_ids=response_ids,
                         next_state=said("Just the number please."), tools=TOOLS)  # fmt: skip
        no_hint = make_turn("opd", 1, next_state=said("fine"))
        no_state = make_turn("opd", 2)
        await put_turns(redis, settings, [turn])
        async with running(settings, serve=False):
            (sample,) = await wait_samples(redis, settings, 1)
            votes = itertools.cycle(["\\boxed{-1}"])
            await put_turns(redis, settings, [no_hint, no_state])
            found = {s.sample_id: s for s in await wait_samples(redis, settings, 3)}
    assert sample.mode == SampleMode.SAMPLE_MODE_OPD and sample.hint == HINT
    assert sample.has_teacher and list(sample.loss_mask) == [1.0] * len(response_ids)
    assert len(sample.teacher_logprobs) == len(response_ids)
    hinted = renderer.render_ids(inject_hint(json.loads(turn.messages_json), HINT), TOOLS)
    assert "calc" in renderer.tokenizer.decode(hinted)  # rendered with the turn's tools
    lps, tops = expected_teacher(tiny_engine, hinted, response_ids, 3)
    assert [e[1] for e in lps] == response_ids
    assert list(sample.teacher_logprobs) == pytest.approx([e[0] for e in lps], abs=1e-5)
    assert sample.teacher_top_k == 3 and len(sample.teacher_topk_ids) == 3 * len(response_ids)
    assert list(sample.teacher_topk_ids) == [e[1] for row in tops for e in row]
    assert list(sample.teacher_topk_logprobs) == pytest.approx(
        [e[0] for row in tops for e in row], abs=1e-5
    )
    # Without the hint the teacher would differ: the hint is really in the prompt.
    plain, _ = expected_teacher(tiny_engine, list(turn.prompt_ids), response_ids, 0)
    assert [e[0] for e in plain] != pytest.approx(list(sample.teacher_logprobs), abs=1e-5)
    assert found["opd:1"].mask_reason == MaskReason.MASK_REASON_NO_HINT
    assert found["opd:2"].mask_reason == MaskReason.MASK_REASON_NO_NEXT_STATE
    assert not found["opd:1"].has_teacher and set(found["opd:1"].loss_mask) == {0.0}


COMBINE_SCRIPT = {  # reply tag -> (PRM verdict, hint vote)
    "case-A": ("\\boxed{1}", f"\\boxed{{1}} [HINT_START]{HINT}[HINT_END]"),
    "case-B": ("\\boxed{0}", f"\\boxed{{1}} [HINT_START]{HINT}[HINT_END]"),
    "case-C": ("\\boxed{-1}", "\\boxed{-1}"),
    "case-D": ("\\boxed{0}", "\\boxed{-1}"),
}


def combine_answer(kind: str, prompt: str) -> str:
    tag = next(t for t in COMBINE_SCRIPT if t in prompt)
    prm, hint = COMBINE_SCRIPT[tag]
    return prm if kind == "prm" else hint


async def test_combine_produces_the_four_cases(
    redis: Redis, redis_url: str, tiny_engine: str
) -> None:
    async with scripted_judge(combine_answer) as judge:
        settings = judge_settings(
            redis_url,
            judging={"mode": "combine"},
            backend=openai_backend(judge.url, engine_url=tiny_engine),
            model={"path": TINY},
        )
        turns = [make_turn(f"c{i}", 0, response=tag, next_state=said("next"))
                 for i, tag in enumerate(COMBINE_SCRIPT)]  # fmt: skip
        await put_turns(redis, settings, turns)
        async with running(settings, serve=False):
            found = {s.session_id: s for s in await wait_samples(redis, settings, 4)}
    a, b, c, d = (found[f"c{i}"] for i in range(4))
    for s in (a, b, c, d):
        assert s.mode == SampleMode.SAMPLE_MODE_COMBINED
    # hint and +1: teacher log-probs and the reward
    assert a.has_teacher and len(a.teacher_logprobs) == 3 and a.reward == 1.0
    assert a.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED and set(a.loss_mask) == {1.0}
    # hint and 0: teacher log-probs, reward 0, trained
    assert b.has_teacher and len(b.teacher_logprobs) == 3 and b.reward == 0.0
    assert set(b.loss_mask) == {1.0}
    # no hint and -1: reward only, no teacher signal (an exact zero distillation term)
    assert not c.has_teacher and not c.teacher_logprobs and c.reward == -1.0
    assert set(c.loss_mask) == {1.0} and c.hint == ""
    # neither: masked
    assert d.mask_reason == MaskReason.MASK_REASON_NO_SIGNAL and set(d.loss_mask) == {0.0}
    assert not d.has_teacher


async def test_openai_backend_votes_through_the_cpu_engines_chat_api(
    redis: Redis, redis_url: str, tiny_engine: str
) -> None:
    settings = judge_settings(
        redis_url,
        backend={"kind": "openai", "openai_base_url": f"{tiny_engine}/v1", "openai_model": TINY,
                 "api_key": "unused", "max_new_tokens": 8, "engine_url": None},
    )  # fmt: skip
    await put_turns(redis, settings, [make_turn("oa", 0, next_state=said("thanks"))])
    async with running(settings, serve=False):
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=60)
    out = io.BytesIO()
    await export(redis, settings.audit.stream, out)
    (record,) = map(orjson.loads, out.getvalue().splitlines())
    assert len(sample.votes) == 3 and sample.reward_source == "prm"
    assert len(record["votes"]) == 3 and all("error" not in v for v in record["votes"])
    assert sample.reward == majority([parse_boxed(v["text"]) for v in record["votes"]])


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_rl_scores_a_turn_from_real_votes_of_the_135m_model(
    redis: Redis, redis_url: str, engine_factory
) -> None:
    engine = engine_factory("SmolLM2-135M-Instruct")
    settings = judge_settings(
        redis_url,
        model={"path": "SmolLM2-135M-Instruct"},
        # Short votes: on a loaded 2-core host three 135M votes can take minutes.
        backend={"kind": "sglang", "engine_url": engine, "max_new_tokens": 16, "timeout_s": 900},
        judging={"promote_first_in_session": False},
    )
    turn = make_turn("real", 0, user="What is 2+3?", response="2+3 = 5.",
                     next_state=said("Thanks, that's right!"))  # fmt: skip
    await put_turns(redis, settings, [turn])
    async with running(settings, serve=False):
        (sample,) = await wait_samples(redis, settings, 1, timeout_s=540)
    out = io.BytesIO()
    await export(redis, settings.audit.stream, out)
    (record,) = map(orjson.loads, out.getvalue().splitlines())
    texts = [v["text"] for v in record["votes"]]
    assert len(texts) == 3 and all(texts) and len(sample.votes) == 3
    scores = [parse_boxed(t) for t in texts]
    assert [v["score"] for v in record["votes"]] == scores
    assert sample.reward == majority(scores) == record["score"]
    assert sample.reward_source == "prm"
    expected = MaskReason.MASK_REASON_UNSPECIFIED if sample.reward else (
        MaskReason.MASK_REASON_NEUTRAL_SCORE)  # fmt: skip
    assert sample.mask_reason == expected
