"""`make run RUN_ARGS="--method rl|opd|combine"`: what the judge and the trainer are told, and
when the judge engine is started at all (deploy/local/stack.py)."""

from __future__ import annotations

import json
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy/local"))
import options
import stack


def args(*argv: str):
    parsed = stack.parse_args(list(argv))
    stack.resolve_lora_rank(parsed)
    return parsed


def test_rl_with_a_reward_plugin_needs_no_judge_engine() -> None:
    a = args("--method", "rl", "--reward-fn", "m:f")
    assert not stack.needs_judge_engine(a)
    assert stack.judge_env(a) == {"CLAWRL_JUDGING__MODE": "rl", "CLAWRL_JUDGING__PRM": "votes",
                                  "CLAWRL_JUDGING__REWARD_FN": "m:f"}  # fmt: skip
    assert stack.training_env(a)["CLAWRL_ADVANTAGE__ESTIMATOR"] == "grpo"
    prm = args("--method", "rl", "--judge-prm", "logprob")
    assert stack.needs_judge_engine(prm)  # the PRM votes on it
    assert stack.judge_env(prm)["CLAWRL_JUDGING__PRM"] == "logprob"


def test_opd_defaults_to_the_hint_plugin_and_the_policy_engine_as_teacher() -> None:
    a = args("--method", "opd", "--policy-port", "4242")
    assert not stack.needs_judge_engine(a)  # one engine for the policy and the teacher
    env = stack.judge_env(a)
    assert env["CLAWRL_JUDGING__MODE"] == "opd"
    assert env["CLAWRL_JUDGING__HINT_FN"] == options.HINT_FN
    assert json.loads(env["CLAWRL_JUDGING__HINT_FN_ARGS"]) == {"drop_after": "Next:"}
    assert env["CLAWRL_JUDGING__HINT_VOTES"] == "false"
    assert env["CLAWRL_TEACHER__ENGINE"] == "policy"
    assert env["CLAWRL_TEACHER__POLICY_ENGINE_URL"] == "http://127.0.0.1:4242"
    training = stack.training_env(a)
    assert training["CLAWRL_ADVANTAGE__ESTIMATOR"] == "on_policy_distillation"
    assert training["CLAWRL_ADVANTAGE__OPD_CLIP"] == "2.0"


def test_the_judge_engine_starts_when_something_asks_it() -> None:
    assert stack.needs_judge_engine(args("--method", "opd", "--hint-fn", ""))  # hint votes
    assert stack.needs_judge_engine(args("--method", "opd", "--teacher", "judge"))
    assert stack.needs_judge_engine(args("--method", "combine"))  # PRM votes: no reward_fn
    assert not stack.needs_judge_engine(args("--method", "combine", "--reward-fn", "m:f"))
    assert stack.needs_judge_engine(args("--method", "config"))
    assert stack.judge_env(args("--method", "config")) == {}
    assert "CLAWRL_ADVANTAGE__ESTIMATOR" not in stack.training_env(args("--method", "config"))


def test_several_hint_candidates_and_their_selection() -> None:
    a = args("--method", "combine", "--reward-fn", "m:f", "--hint-candidates", "3",
             "--hint-select", "token_optimal")  # fmt: skip
    env = stack.judge_env(a)
    assert env["CLAWRL_JUDGING__HINT_CANDIDATES"] == "3"
    assert env["CLAWRL_JUDGING__HINT_SELECT"] == "token_optimal"
    assert env["CLAWRL_JUDGING__REWARD_FN"] == "m:f"
    assert stack.training_env(a)["CLAWRL_ADVANTAGE__ESTIMATOR"] == "combine"
