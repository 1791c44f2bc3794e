"""`clawrl simulate --remarks varied` through a real gateway (tiny model): the varied user's
remarks land in the recorded turns' next states, each one of its wordings for the verdict the
reply earned, and `remark_sentiment` reads from them what the simulator's own check says."""

from __future__ import annotations

import asyncio

import pytest

from clawrl.judge.reward_examples import remark_sentiment
from clawrl.judge.turns import check_turn
from clawrl.simulate.main import parse_args, simulate
from clawrl.simulate.preference import PARAGRAPH, REMARKS, satisfies

pytestmark = [pytest.mark.integration]


def test_the_varied_users_words_carry_the_reward(gateway, tmp_path, capsys) -> None:
    before = {t.turn_id for t in gateway.turns()}
    args = parse_args(
        ["simulate", "--base-url", gateway.base_url, "--sessions", "2", "--turns", "3",
         "--concurrency", "2", "--max-tokens", "48", "--seed", "5", "--redis-url", "",
         "--remarks", "varied", "--no-held-out", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert asyncio.run(simulate(args)) == 0
    assert "6 turns, 0 failed requests" in capsys.readouterr().out
    [made] = tmp_path.glob("simulate-*.csv")
    run_id = made.stem.removeprefix("simulate-")
    ours = [t for t in gateway.turns() if t.turn_id not in before
            and t.session_id.startswith(f"sim-{run_id}-")]  # fmt: skip
    with_remark = [v for v in map(check_turn, ours) if v.has_next_state]
    assert len(with_remark) == 6
    remarks = [view.next_user_text().split(" Next: ")[0] for view in with_remark]
    assert set(remarks) - set(REMARKS.values())  # not the fixed wording
    for view, said in zip(with_remark, remarks, strict=True):
        assert said in PARAGRAPH.varied[PARAGRAPH.judge(view.response_text)], said
        expected = 1.0 if satisfies(view.response_text) else -1.0
        assert remark_sentiment(view) == expected, (view.response_text, said)
