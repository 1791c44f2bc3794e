"""Reward plug-in loading and the two shipped examples; teacher log-prob alignment; settings
that refuse to start without what a mode needs."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from clawrl.common.records import Turn
from clawrl.judge.reward_examples import arithmetic_confirmed, ends_with_word
from clawrl.judge.rewards import RewardFnError, check_reward, load_reward_fn
from clawrl.judge.settings import JudgeSettings
from clawrl.judge.teacher import TeacherMismatch, teacher_from_meta, teacher_request
from clawrl.judge.turns import MalformedTurn, TurnView, check_turn


def view(response: str, next_user: str | None = None) -> TurnView:
    turn = Turn(turn_id="s:0", session_id="s", response_text=response, messages_json="[]")
    if next_user is not None:
        turn.next_state_messages_json.append(json.dumps({"role": "user", "content": next_user}))
    return TurnView(turn)


def test_ends_with_word() -> None:
    assert ends_with_word(view("I love a good Banana!"), word="banana") == 1.0
    assert ends_with_word(view("banana split"), word="banana") == -1.0
    assert ends_with_word(view(""), word="banana") == -1.0


def test_arithmetic_confirmed() -> None:
    assert arithmetic_confirmed(view("2 + 3 = 5", "Yes, 5 is right")) == 1.0
    assert arithmetic_confirmed(view("It is 6.", "No, it is 5")) == -1.0
    assert arithmetic_confirmed(view("It is 2.50", "2.5")) == 1.0
    assert arithmetic_confirmed(view("It is 6.", "thanks")) is None
    assert arithmetic_confirmed(view("It is six.", "5")) is None
    assert arithmetic_confirmed(view("It is 5.")) is None  # no next state


async def test_load_reward_fn_sync_and_async() -> None:
    fn = load_reward_fn("clawrl.judge.reward_examples:ends_with_word", {"word": "ok"})
    assert fn.source == "reward_fn:clawrl.judge.reward_examples:ends_with_word"
    assert await fn(view("that is ok")) == 1.0

    async def later(turn, bonus):
        return 0.5 + bonus

    from clawrl.judge.rewards import RewardFn

    assert await RewardFn("x:y", later, {"bonus": 0.25})(view("")) == 0.75


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "module:function"),
        ("clawrl.nowhere:f", "cannot import"),
        ("clawrl.judge.reward_examples:missing", "no callable"),
    ],
)
def test_bad_reward_fn_specs_fail_clearly(spec: str, message: str) -> None:
    with pytest.raises(RewardFnError, match=message):
        load_reward_fn(spec)


def test_check_reward() -> None:
    assert check_reward(1, "f") == 1.0 and check_reward(None, "f") is None
    for bad in (True, "1", float("nan"), float("inf"), [1]):
        with pytest.raises(RewardFnError, match="finite number"):
            check_reward(bad, "f")


def test_teacher_request_and_alignment() -> None:
    payload = teacher_request([1, 2, 3], [7, 8], top_k=2)
    # One position before the response: SGLang pads the start position's entry with None.
    assert payload["input_ids"] == [1, 2, 3, 7, 8] and payload["logprob_start_len"] == 2
    assert payload["sampling_params"]["max_new_tokens"] == 0 and payload["return_logprob"]
    assert payload["top_logprobs_num"] == 2
    assert "top_logprobs_num" not in teacher_request([1], [2], top_k=0)
    with pytest.raises(ValueError, match="non-empty prompt"):
        teacher_request([], [2], top_k=0)
    # SGLang's reply shape: entry 0 (the last prompt token) is None, then one per response id.
    meta = {
        "input_token_logprobs": [[None, 3, None], [-0.5, 7, None], [-1.5, 8, None]],
        "input_top_logprobs": [
            None,
            [[-0.1, 9, None], [-0.5, 7, None]],
            [[-1.5, 8, None], [-2, 3, None]],
        ],
    }
    signal = teacher_from_meta(meta, [7, 8], top_k=2)
    assert signal.logprobs == [-0.5, -1.5] and signal.top_k == 2
    assert signal.topk_ids == [9, 7, 8, 3] and signal.topk_logprobs == [-0.1, -0.5, -1.5, -2.0]
    assert teacher_from_meta(meta, [7, 8], top_k=0).topk_ids == []
    with pytest.raises(TeacherMismatch, match="not the 3 response ids"):
        teacher_from_meta(meta, [6, 7, 8], top_k=0)
    # The CPU engine puts a real value in entry 0: dropped just the same.
    cpu = {"input_token_logprobs": [[-3.0, 3, None], [-0.5, 7, None], [-1.5, 8, None]]}
    assert teacher_from_meta(cpu, [7, 8], top_k=0).logprobs == [-0.5, -1.5]
    with pytest.raises(TeacherMismatch, match="null"):
        teacher_from_meta({"input_token_logprobs": [[None, 3, None], [None, 7, None]]}, [7], 0)
    with pytest.raises(TeacherMismatch, match="top-3"):
        teacher_from_meta(meta, [7, 8], top_k=3)


def test_check_turn_rejects_malformed_turns() -> None:
    with pytest.raises(MalformedTurn, match="no turn_id"):
        check_turn(Turn())
    bad = Turn(turn_id="s:0", session_id="s", response_ids=[1], messages_json="{}")
    bad.response_logprobs.append(-1.0)
    with pytest.raises(MalformedTurn, match="must be a JSON list"):
        check_turn(bad)
    legacy = Turn(turn_id="s:0", session_id="s", next_state_json='{"role": "user", "content": "x"}')
    assert check_turn(legacy).next_state == [{"role": "user", "content": "x"}]


def test_settings_refuse_modes_without_what_they_need(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    with pytest.raises(ValidationError, match="needs teacher prompt log-probs"):
        JudgeSettings(judging={"mode": "opd"}, backend={"engine_url": None})
    with pytest.raises(ValidationError, match="openai_base_url and openai_model"):
        JudgeSettings(backend={"kind": "openai"})
    with pytest.raises(ValidationError, match=r"needs backend\.engine_url"):
        JudgeSettings(backend={"engine_url": None})
    with pytest.raises(ValidationError, match="does not exist"):
        JudgeSettings(backend={"api_key_file": "/nonexistent/key"})
    with pytest.raises(ValidationError, match="Extra inputs"):
        JudgeSettings(judging={"mdoe": "rl"})
    # rl with a reward_fn needs no engine at all.
    assert not JudgeSettings(judging={"reward_fn": "m:f"}, backend={"engine_url": None}).needs_votes


def test_settings_refuse_hint_setups_that_cannot_work(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    with pytest.raises(ValidationError, match="has no hint source"):
        JudgeSettings(judging={"mode": "opd", "hint_votes": False}, feedback={"enabled": False})
    with pytest.raises(ValidationError, match=r"teacher\.engine=policy needs"):
        JudgeSettings(judging={"mode": "opd"}, teacher={"engine": "policy",
                                                        "policy_engine_url": None})  # fmt: skip
    with pytest.raises(ValidationError, match="compares each hinted teacher with the student"):
        JudgeSettings(judging={"mode": "opd", "hint_candidates": 2,
                               "hint_select": "token_optimal"},
                      teacher={"policy_engine_url": None})  # fmt: skip
    # The hint plug-in and the policy engine as teacher: no judge engine, no votes at all.
    alone = JudgeSettings(judging={"mode": "opd", "hint_fn": "m:f", "hint_votes": False},
                          teacher={"engine": "policy"}, backend={"engine_url": None})  # fmt: skip
    assert not alone.needs_votes and alone.needs_teacher
    # By length, several candidates need no student.
    assert not JudgeSettings(judging={"mode": "opd", "hint_candidates": 3}).student_reference


def test_api_key_from_a_mounted_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    settings = JudgeSettings(
        backend={"kind": "openai", "openai_base_url": "http://h/v1", "openai_model": "m",
                 "api_key_file": str(key)}
    )  # fmt: skip
    assert settings.backend.openai_key() == "sk-secret"
