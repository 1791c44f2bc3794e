"""`make run RUN_ARGS="--track terminal"` (deploy/local/terminal.py): what the stack starts
beside the learning loop, and what the judge and trainer are told; the chat track unchanged."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "deploy/local"))
import stack
import terminal


def args(*argv: str):
    parsed = stack.parse_args(list(argv))
    stack.resolve_lora_rank(parsed)
    return parsed


def test_the_chat_track_starts_and_sets_nothing_of_the_terminal_track(tmp_path) -> None:
    chat = args("--run-dir", str(tmp_path))
    assert chat.track == "chat"
    assert terminal.ports(chat) == () and terminal.scraped(chat) == {}
    assert "CLAWRL_EPISODES__PRM_STEP_COEF" not in stack.judge_env(chat)
    assert stack.training_env(chat)["CLAWRL_ADVANTAGE__ESTIMATOR"] == "grpo"


def test_the_terminal_track_rewards_outcomes_against_the_batch_or_step_wise(tmp_path) -> None:
    a = args("--track", "terminal", "--run-dir", str(tmp_path))
    assert stack.judge_env(a)["CLAWRL_EPISODES__PRM_STEP_COEF"] == "0.0"
    batch = stack.training_env(a)
    assert batch["CLAWRL_ADVANTAGE__ESTIMATOR"] == "grpo"
    assert batch["CLAWRL_ADVANTAGE__GROUP_BY"] == "batch"
    assert batch["CLAWRL_ADVANTAGE__NORMALIZE_GROUPS"] == "true"
    step_wise = args("--track", "terminal", "--terminal-advantage", "step_wise")
    assert stack.training_env(step_wise)["CLAWRL_ADVANTAGE__ESTIMATOR"] == "step_wise"
    coef = args("--track", "terminal", "--prm-step-coef", "0.5", "--method", "config")
    assert stack.judge_env(coef) == {"CLAWRL_EPISODES__PRM_STEP_COEF": "0.5"}
    assert "CLAWRL_ADVANTAGE__ESTIMATOR" not in stack.training_env(coef)  # clawrl.toml's
    assert terminal.ports(a) == (30040, 30041)
    assert terminal.scraped(a) == {"environments": 30040, "agent-runner": 30041}


def test_the_runner_plays_the_train_split_until_stopped_with_held_out_evaluations(tmp_path):
    a = args("--track", "terminal", "--run-dir", str(tmp_path), "--gateway-port", "4000",
             "--environments-port", "4001", "--terminal-families", "write_file,make_dir",
             "--held-out-every", "3", "--terminal-seed", "7",
             "--api-key", "sk-1", "--api-key", "sk-2")  # fmt: skip
    argv = terminal.runner_argv(a)
    assert argv[1:3] == ["agent", "run"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags == {
        "--gateway-url": "http://127.0.0.1:4000/v1",
        "--environments-url": "http://127.0.0.1:4001",
        "--model": "SmolLM2-135M-Instruct",
        "--split": "train",
        "--episodes": "0",
        "--concurrency": "2",
        "--seed": "7",
        "--held-out-every": "3",
        "--metrics-port": "30041",
        "--eval-dir": str(tmp_path / "agent"),
        "--out": str(tmp_path / "agent" / "episodes.jsonl"),
        "--families": "write_file,make_dir",
        "--api-key": "sk-1",
    }
    # The runner's own parser takes every flag the stack gives it.
    from clawrl.simulate.main import parse_args

    parsed = parse_args(argv[1:])
    assert (parsed.episodes, parsed.held_out_every, parsed.families, parsed.seed) == (
        0,
        3,
        ["write_file", "make_dir"],
        7,
    )
    service, env = terminal.sandbox_service(a)
    assert Path(service[0]).name == "clawrl-environments"
    assert env["CLAWRL_ENVIRONMENTS_SERVER__PORT"] == "4001"
    root = Path(env["CLAWRL_SANDBOX__ROOT_DIR"])
    # Outside the run dir (which may sit under a 0700 directory the sandbox uid cannot pass),
    # one per run dir, the same one again for a restarted stack.
    assert root.parent == Path(tempfile.gettempdir()) and root.stat().st_mode & 0o777 == 0o711
    assert root == terminal.sandbox_root(tmp_path / "." / "")
    assert root != terminal.sandbox_root(tmp_path / "other")
    root.rmdir()


def test_make_run_leaves_the_chat_reward_plugin_out_of_the_terminal_track() -> None:
    def command(run_args: str) -> str:
        return subprocess.run(
            ["make", "-n", "-o", "setup", "run", f"RUN_ARGS={run_args}"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    assert "--reward-fn" in command("--method rl")
    terminal_run = command("--track terminal")
    assert "--reward-fn" not in terminal_run and "--track terminal" in terminal_run
