"""tests/bench/learning_summary.py on small synthetic CSVs (a new run with its settings columns
and an older one without), and bench_learning's pure parts: the reward it asks for, the CSV it
writes to docs/ and what it reads from the judge's and trainer's /metrics."""

from __future__ import annotations

import csv

import pytest

from tests.bench.bench_learning import reward_spec, signal_counts, write_docs_csv
from tests.bench.learning_summary import main, read_run, reward_trend, table

OLD = """policy_version,turns,liked,samples,reward_mean,held_out_score
0,20,0.5000,20,0.0000,0.1250
1,7,0.2857,7,-0.5000,
2,6,0.6667,6,0.5000,0.2500
3,10,0.7000,10,1.0000,0.5000
"""
SETTINGS = "opd,1,varied,clawrl.judge.reward_examples:remark_sentiment,hint yield 0/24"
NEW = f"""policy_version,turns,liked,samples,reward_mean,held_out_score,held_out_base_nll,\
method,seed,remarks,reward_fn,signal
0,12,0.4000,12,-0.2000,0.2000,2.5000,{SETTINGS}
1,8,0.5000,8,0.0000,,,{SETTINGS}
2,4,0.5000,4,,0.2500,2.7500,{SETTINGS}
"""


@pytest.fixture
def docs(tmp_path):
    (tmp_path / "learning-SmolLM2-135M-Instruct-seed0.csv").write_text(OLD)
    (tmp_path / "learning-opd-seed1.csv").write_text(NEW)
    (tmp_path / "tenants-seed0-a.csv").write_text(OLD)  # not a learning run
    return tmp_path


def test_the_runs_are_read_with_or_without_settings_columns(docs) -> None:
    old = read_run(docs / "learning-SmolLM2-135M-Instruct-seed0.csv")
    assert (old.method, old.seed, old.remarks, old.reward_fn) == ("rl", "0", "fixed",
                                                                  "stated_preference")  # fmt: skip
    assert (old.turns, old.versions, old.signal) == (43, 3, "")
    assert old.held_out == [(0, 0.125), (2, 0.25), (3, 0.5)] and old.base_nll == []
    new = read_run(docs / "learning-opd-seed1.csv")
    assert (new.method, new.seed, new.remarks, new.reward_fn) == ("opd", "1", "varied",
                                                                  "remark_sentiment")  # fmt: skip
    assert (new.turns, new.versions, new.signal) == (24, 2, "hint yield 0/24")
    assert new.base_nll == [(0, 2.5), (2, 2.75)]


def test_the_table_says_which_runs_learned_and_why_not(docs, capsys) -> None:
    plot = docs / "methods.png"
    main(["--docs", str(docs), "--plot", str(plot)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| run | method | seed | remarks |") and len(out) == 2 + 2 + 2
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out[2:4]]
    old, new = sorted(cells)  # learning-SmolLM2... before learning-opd...
    assert old[:7] == ["learning-SmolLM2-135M-Instruct-seed0", "rl", "0", "fixed",
                       "stated_preference", "43", "3"]  # fmt: skip
    assert old[7:11] == ["0.125 -> 0.500 (v3, +0.375)", "+0.000 -> +0.333 (+0.333)", "-", "yes"]
    assert new[7:12] == ["0.200 -> 0.250 (v2, +0.050)", "-", "2.500 -> 2.750 (v2, +0.250)",
                         "no (held-out +0.050)", "hint yield 0/24"]  # fmt: skip
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_reward_trend_needs_v0_and_three_more() -> None:
    assert reward_trend([(0, 0.0), (1, 1.0), (2, 1.0)]) == "-"
    assert reward_trend([(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]) == "-"
    assert reward_trend([(0, -0.5), (1, 0.0), (2, 0.5), (3, 1.0)]) == "-0.500 -> +0.500 (+1.000)"
    assert table([]).count("\n") == 1  # the header only


def test_bench_learning_asks_for_the_reward_that_reads_its_user() -> None:
    spec = "clawrl.judge.reward_examples:"
    assert reward_spec("auto", "preference", "fixed") == spec + "stated_preference"
    assert reward_spec("auto", "preference", "varied") == spec + "remark_sentiment"
    assert reward_spec("auto", "arithmetic", "varied") == spec + "arithmetic_confirmed"
    assert reward_spec("judge", "preference", "varied") is None  # the judge's PRM
    assert reward_spec("my.mod:fn", "preference", "fixed") == "my.mod:fn"


def test_bench_learning_keeps_the_settings_in_the_docs_csv(tmp_path) -> None:
    made, target = tmp_path / "simulate-x.csv", tmp_path / "learning-opd-seed1.csv"
    made.write_text(OLD)
    write_docs_csv(made, target, {"method": "opd", "seed": "1", "remarks": "varied"})
    rows = list(csv.DictReader(target.open()))
    assert len(rows) == 4 and rows[3]["held_out_score"] == "0.5000"
    assert {(r["method"], r["seed"], r["remarks"]) for r in rows} == {("opd", "1", "varied")}
    assert read_run(target).method == "opd"


def test_bench_learning_reads_what_the_judge_and_trainer_counted() -> None:
    hints = "clawrl_judge_hints_total"
    judge = {
        (hints, (("result", "accepted"),)): 3.0,
        (hints, (("result", "none"),)): 9.0,
        ("clawrl_judge_hint_sources_total", (("source", "hint_fn"),)): 3.0,
        ("clawrl_judge_votes_total", (("kind", "prm"), ("result", "valid"))): 1.0,
        ("clawrl_judge_votes_total", (("kind", "prm"), ("result", "invalid"))): 23.0,
        ("clawrl_judge_masked_samples_total", (("reason", "no_hint"),)): 9.0,
        ("clawrl_judge_masked_samples_total", (("reason", "hint_fn_failed"),)): 0.0,
    }
    trainer = {
        ("clawrl_trainer_steps_total", ()): 4.0,
        ("clawrl_trainer_batches_skipped_total", (("reason", "no_signal"),)): 2.0,
    }
    assert signal_counts(judge, trainer) == (
        "hint yield 3/12 (feedback 0, hint_fn 3, judge 0); PRM votes valid 1/24; "
        "masked no_hint 9; steps 4; batches skipped 2"
    )
    assert signal_counts({}, {}) == "steps 0"


def test_a_run_that_never_stepped_is_said_not_to_learn(tmp_path, capsys) -> None:
    settings = "rl,0,varied,judge,PRM votes valid 0/15; steps 0"
    (tmp_path / "learning-rl-prm-seed0.csv").write_text(
        "policy_version,turns,liked,samples,reward_mean,held_out_score,held_out_base_nll,"
        f"method,seed,remarks,reward_fn,signal\n0,132,0.5000,25,0.0000,0.1250,0.6400,{settings}\n"
    )
    main(["--docs", str(tmp_path), "--plot", str(tmp_path / "methods.png")])
    row = [c.strip() for c in capsys.readouterr().out.splitlines()[2].strip("|").split("|")]
    assert row[6] == "0" and row[10:] == [
        "no (no version past v0: no trainable signal)",
        "PRM votes valid 0/15; steps 0",
    ]
