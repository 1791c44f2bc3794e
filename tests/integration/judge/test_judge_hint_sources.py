"""Where hints come from and how one of several is picked, with the real tiny model as teacher:
the sources in their order (an explicit feedback's comment, the hint plug-in, the judge's hint
votes), a failing plug-in masking its turn, the policy engine's base weights as the teacher with
no judge engine at all, and the multi-candidate selections (teacher log-probs checked against
the engine's own)."""

from __future__ import annotations

import io
import json

import orjson
import pytest
from redis.asyncio import Redis

from clawrl.common.chat import ChatRenderer
from clawrl.common.feedback import Feedback
from clawrl.common.proto.records_pb2 import MaskReason
from clawrl.common.sglang_client import SGLangClient
from clawrl.judge.audit import export
from clawrl.judge.feedback import TurnFeedback
from clawrl.judge.hints import inject_hint, sequence_optimal, token_optimal, topk_overlap
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.service import build_judge, running
from clawrl.judge.turns import TurnView

from .helpers import expected_teacher, judge_settings, make_turn, put_turns, said, wait_samples
from .scripted_judge import openai_backend, scripted_judge

pytestmark = pytest.mark.integration

TINY = "smollm2-tiny"
PLUGIN = "tests.integration.judge.plugins:hint_by_next_message"
JUDGE_HINT = "Hint from the judge: show the sum first."
VOTE = f"\\boxed{{1}} [HINT_START]{JUDGE_HINT}[HINT_END]"


def engine_logprobs(engine: str, prompt_ids: list[int], response_ids: list[int], top_k: int = 0):
    """The engine's own log-probs (and top-K ids per row) of the response after `prompt_ids`."""
    lps, tops = expected_teacher(engine, prompt_ids, response_ids, top_k)
    return [e[0] for e in lps], [[e[1] for e in row[:top_k]] for row in tops] if top_k else []


def turn_for(renderer: ChatRenderer, session: str, next_text: str):
    response = "The sum of two and three is five."
    ids = renderer.tokenizer.encode(response, add_special_tokens=False)
    turn = make_turn(session, 0, response=response, response_ids=ids, next_state=said(next_text))
    turn.prompt_ids[:] = renderer.render_ids(json.loads(turn.messages_json))
    return turn


async def test_hint_sources_are_asked_in_order_and_a_failing_plugin_masks_its_turn(
    redis_url: str, tiny_engine: str, renderer: ChatRenderer
) -> None:
    async with scripted_judge(lambda kind, prompt: VOTE) as judge:
        settings = judge_settings(
            redis_url,
            judging={"mode": "opd", "hint_fn": PLUGIN},
            backend=openai_backend(judge.url, engine_url=tiny_engine),
            model={"path": TINY},
        )
        metrics = JudgeMetrics()
        core = build_judge(settings, metrics, SGLangClient(tiny_engine))
        comment = TurnFeedback((Feedback(id="f1", comment="Hint from feedback: be brief."),))
        cases = {
            "feedback": (turn_for(renderer, "a", "plugin please"), comment),
            "plugin": (turn_for(renderer, "b", "plugin please"), None),
            "judge": (turn_for(renderer, "c", "something else"), None),
            "crash": (turn_for(renderer, "d", "crash now"), None),
            "garbage": (turn_for(renderer, "e", "garbage now"), None),
        }
        got = {name: await core.judge(TurnView(turn), fb) for name, (turn, fb) in cases.items()}
        await core.backend.aclose()
        await core.teacher.engine.aclose()
    expected = {
        "feedback": ("feedback", "Hint from feedback: be brief."),
        "plugin": (f"hint_fn:{PLUGIN}", "Hint from the plug-in: answer with the number only."),
        "judge": ("judge", JUDGE_HINT),
    }
    for name, (source, hint) in expected.items():
        sample = got[name].sample
        assert (sample.hint_source, sample.hint) == (source, hint), name
        assert got[name].audit["hint_source"] == source
        assert sample.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED and sample.has_teacher
        turn = cases[name][0]
        hinted = renderer.render_ids(inject_hint(json.loads(turn.messages_json), hint))
        lps, _ = engine_logprobs(tiny_engine, hinted, list(turn.response_ids))
        assert list(sample.teacher_logprobs) == pytest.approx(lps, abs=1e-5), name
    # The judge was asked for hint votes only for the turn that neither source answered.
    assert len(judge.prompts("hint")) == settings.judging.votes
    for name in ("crash", "garbage"):
        sample = got[name].sample
        assert sample.mask_reason == MaskReason.MASK_REASON_HINT_FN_FAILED, name
        assert set(sample.loss_mask) == {0.0} and not sample.has_teacher
        assert PLUGIN in got[name].audit["hint_fn_error"]
    assert "RuntimeError: hint plug-in bug" in got["crash"].audit["hint_fn_error"]
    assert metrics.hint_fn_errors._value.get() == 2
    for source, count in (("feedback", 1), ("hint_fn", 1), ("judge", 1)):
        assert metrics.hint_sources.labels(source)._value.get() == count


async def test_the_policy_engines_base_weights_teach_with_no_judge_engine(
    redis: Redis, redis_url: str, tiny_engine: str, renderer: ChatRenderer
) -> None:
    settings = judge_settings(
        redis_url,
        judging={"mode": "opd", "hint_fn": PLUGIN, "hint_votes": False},
        teacher={"engine": "policy", "policy_engine_url": tiny_engine},
        model={"path": TINY},
    )
    assert settings.backend.engine_url is None and not settings.needs_votes
    turns = [turn_for(renderer, "p", "plugin please"), turn_for(renderer, "q", "no hint here")]
    await put_turns(redis, settings, turns)
    async with running(settings, serve=False) as service:
        found = {s.session_id: s for s in await wait_samples(redis, settings, 2)}
        out = io.BytesIO()
        await export(redis, settings.audit.stream, out)
    assert service.judge.backend is None  # no vote backend, no judge engine
    hinted = renderer.render_ids(inject_hint(json.loads(turns[0].messages_json), found["p"].hint))
    lps, _ = engine_logprobs(tiny_engine, hinted, list(turns[0].response_ids))
    assert list(found["p"].teacher_logprobs) == pytest.approx(lps, abs=1e-5)
    assert found["q"].mask_reason == MaskReason.MASK_REASON_NO_HINT
    records = {r["session_id"]: r for r in map(orjson.loads, out.getvalue().splitlines())}
    assert records["p"]["hint_source"] == f"hint_fn:{PLUGIN}"
    assert records["q"]["hint_source"] == ""


@pytest.mark.parametrize("select", ["sequence_optimal", "token_optimal", "shortest", "longest"])
async def test_several_candidates_are_deduplicated_scored_and_one_is_selected(
    redis_url: str, tiny_engine: str, renderer: ChatRenderer, select: str
) -> None:
    settings = judge_settings(
        redis_url,
        judging={"mode": "opd", "hint_fn": PLUGIN, "hint_votes": False, "hint_candidates": 3,
                 "hint_select": select, "min_hint_chars": 5},
        teacher={"engine": "policy", "policy_engine_url": tiny_engine, "top_k": 2,
                 "select_top_k": 4},
        model={"path": TINY},
    )  # fmt: skip
    engine = SGLangClient(tiny_engine)
    core = build_judge(settings, JudgeMetrics(), None, engine)
    turn = turn_for(renderer, "s", "many please")
    judgement = await core.judge(TurnView(turn))
    await engine.aclose()
    sample = judgement.sample
    # Four hints from the plug-in, one a repeat: three candidates.
    hints = ["Answer with the number only.",
             "Reply in one short sentence that ends with the number.", "Be brief."]  # fmt: skip
    assert judgement.audit["hint_candidates"] == hints and sample.hint_candidates == 3
    response = list(turn.response_ids)
    scored = [
        engine_logprobs(tiny_engine, renderer.render_ids(inject_hint(json.loads(
            turn.messages_json), h)), response, 4)
        for h in hints
    ]  # fmt: skip
    _, student = engine_logprobs(tiny_engine, list(turn.prompt_ids), response, 4)
    flat = [i for row in student for i in row]
    overlaps = [topk_overlap(flat, [i for row in tops for i in row], 4) for _, tops in scored]
    if select == "sequence_optimal":
        choice = [sequence_optimal(overlaps)] * len(response)
    elif select == "token_optimal":
        choice = token_optimal(overlaps)
    else:
        choice = [{"shortest": 2, "longest": 1}[select]] * len(response)
    assert judgement.audit["hint_chosen"] == max(range(3), key=lambda c: (choice.count(c), -c))
    assert sample.hint == hints[judgement.audit["hint_chosen"]]
    expected = [scored[c][0][t] for t, c in enumerate(choice)]
    assert list(sample.teacher_logprobs) == pytest.approx(expected, abs=1e-5)
    assert sample.teacher_top_k == 2 and len(sample.teacher_topk_ids) == 2 * len(response)
    assert list(sample.teacher_topk_ids) == [i for t, c in enumerate(choice)
                                             for i in scored[c][1][t][:2]]  # fmt: skip
