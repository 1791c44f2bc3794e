"""`clawrl simulate` and `clawrl eval` through a real gateway (tiny model): the user's remark on
each reply lands in the recorded turn's next state, where the judge's `stated_preference` reads
the reward, and it agrees with the simulator's own check of the reply; the held-out questions are
side turns, never recorded."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.judge.reward_examples import stated_preference
from clawrl.judge.turns import check_turn
from clawrl.simulate.main import evaluate, parse_args, simulate
from clawrl.simulate.preference import satisfies

pytestmark = [pytest.mark.integration]


def served_version(gateway) -> int:
    """The version the shared gateway serves now (earlier modules' syncs and Resumes move it):
    from a side turn's system_fingerprint."""
    reply = gateway.chat([{"role": "user", "content": "hi"}], headers={"X-Turn-Type": "side"},
                         max_tokens=1)  # fmt: skip
    return int(reply.json()["system_fingerprint"].removeprefix("clawrl-policy-v"))


def test_the_simulated_users_words_carry_the_reward(gateway, tmp_path, capsys) -> None:
    before = {t.turn_id for t in gateway.turns()}
    version = served_version(gateway)
    args = parse_args(
        ["simulate", "--base-url", gateway.base_url, "--sessions", "2", "--turns", "3",
         "--concurrency", "2", "--max-tokens", "48", "--seed", "3", "--redis-url", "",
         "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert asyncio.run(simulate(args)) == 0
    out = capsys.readouterr().out
    assert "6 turns, 0 failed requests, 0 failed evaluations" in out
    # The held-out questions were scored for the only version served, beside the live figures.
    assert f"held-out score of v{version}: " in out
    [made] = tmp_path.glob("simulate-*.csv")
    header, row = made.read_text().splitlines()
    assert header.endswith(",held_out_score") and row.startswith(f"{version},6,")
    assert row[-1].isdigit()
    run_id = made.stem.removeprefix("simulate-")
    turns = [t for t in gateway.turns() if t.turn_id not in before]
    ours = [t for t in turns if t.session_id.startswith(f"sim-{run_id}-")]
    judged = [check_turn(t) for t in ours]
    # 3 answers per session, each followed by the user's remark (the last one in the closing
    # request, whose own 1-token reply is the session's last turn, with no next state).
    with_remark = [v for v in judged if v.has_next_state]
    assert len(with_remark) == 6 and len(judged) == 8
    for view in with_remark:
        expected = 1.0 if satisfies(view.response_text) else -1.0
        assert stated_preference(view) == expected, (view.response_text, view.next_user_text())
    assert all(stated_preference(v) is None for v in judged if not v.has_next_state)
    assert not [t for t in turns if t.session_id.startswith("eval-")]  # side turns only


def test_held_out_questions_are_side_turns(gateway, capsys) -> None:
    before = len(gateway.turns())
    version = served_version(gateway)
    args = parse_args(["eval", "--base-url", gateway.base_url, "--max-tokens", "16"])
    assert asyncio.run(evaluate(args)) == 0
    assert capsys.readouterr().out.startswith(f"v{version}: held-out score ")
    assert len(gateway.turns()) == before  # nothing recorded: never trained
