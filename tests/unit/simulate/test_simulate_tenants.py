"""`clawrl simulate --tenants 2`'s pure parts: the second user's opposite taste (points on
separate lines), what it says and how the judge reads it, the tenants' adapters named for the
held-out score, the users built per API key, the report's column under the other tenant's
adapter, and the refusals of a bad tenant setup."""

from __future__ import annotations

import pytest

from clawrl.common.tenants import key_tenant
from clawrl.judge.reward_examples import stated_preference
from clawrl.simulate.evaluation import HeldOutScore, adapter_version, scores
from clawrl.simulate.main import Evaluator, make_users, parse_args
from clawrl.simulate.preference import LINES, LINES_REMARKS, PARAGRAPH, Verdict, lines_verdict
from clawrl.simulate.report import per_version, table, write_csv
from clawrl.simulate.scenarios import SCENARIOS
from clawrl.simulate.simulation import Progress
from tests.unit.simulate.test_simulate_preference import LISTED, turn_with
from tests.unit.simulate.test_simulate_preference import PARAGRAPH as ONE_PARAGRAPH


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (LISTED, Verdict.PLEASED),
        (ONE_PARAGRAPH.replace(", which", ".\n\nThis"), Verdict.PLEASED),  # two paragraphs
        (f"- {ONE_PARAGRAPH}", Verdict.PLEASED),  # a list
        (ONE_PARAGRAPH, Verdict.PARAGRAPH),
        (f"\n  {ONE_PARAGRAPH}\n", Verdict.PARAGRAPH),  # surrounding blank lines are no break
        # The collapse guards hold for this user too: no pleasing it by saying next to nothing.
        ("- a\n- b", Verdict.TOO_SHORT),
        ("- plants make sugar\n" * 8, Verdict.REPETITIVE),
    ],
)
def test_the_lines_user_wants_the_opposite_layout(reply: str, expected: Verdict) -> None:
    assert lines_verdict(reply) is expected
    # Opposite tastes: a real answer pleases exactly one of the two users.
    if expected in (Verdict.PLEASED, Verdict.PARAGRAPH):
        assert LINES.satisfies(reply) != PARAGRAPH.satisfies(reply)


def test_what_the_lines_user_says_and_the_judge_reads() -> None:
    assert LINES.next_message(LISTED, "What is DNA?") == (
        "Thanks, points on separate lines are just how I like it. Next: What is DNA?"
    )
    assert LINES.next_message(ONE_PARAGRAPH, None) == LINES_REMARKS[Verdict.PARAGRAPH]
    for reply, reward in [(LISTED, 1.0), (ONE_PARAGRAPH, -1.0), ("Yes.", -1.0)]:
        said = LINES.next_message(reply, "What is DNA?")
        assert stated_preference(turn_with(reply, said)) == reward
    scenario = SCENARIOS["lines"]
    assert scenario.taste is LINES and scenario.check(LISTED, "q")
    assert not scenario.check(ONE_PARAGRAPH, "q")
    assert SCENARIOS["preference"].taste is PARAGRAPH and SCENARIOS["arithmetic"].taste is None


def test_held_out_scores_by_taste_and_tenant_adapters() -> None:
    answers = [(2, LISTED), (2, ONE_PARAGRAPH), (2, LISTED), (2, LISTED)]
    assert scores(answers) == [HeldOutScore(2, 4, 0.25)]  # the paragraph user by default
    [lines] = scores(answers, LINES.judge)
    assert lines == HeldOutScore(2, 4, 0.75) and lines.misses == {"paragraph": 1}
    assert adapter_version("tenant-k0123456789abcdef-v12") == 12
    assert adapter_version("tenant-team-v1-v3") == 3
    for bad in ("tenant--v2", "tenant-x-v", "team-x-v2"):
        with pytest.raises(ValueError, match="tenant-<id>-vN"):
            adapter_version(bad)
    assert parse_args(["eval", "--lora", "tenant-abc-v2", "--taste", "lines"]).taste == "lines"


def test_each_tenant_is_a_user_with_its_key_its_taste_and_the_others_adapter() -> None:
    args = parse_args(["simulate", "--tenants", "2", "--tenant-keys", "key-a,key-b",
                       "--seed", "3", "--engine-url", "http://engine"])  # fmt: skip
    a, b = make_users(args, "m", "run1")
    assert (a.name, a.scenario, b.name, b.scenario) == ("a", "preference", "b", "lines")
    assert a.client.api_key == "key-a" and b.client.api_key == "key-b"
    # Each user's sessions are its own (the judged rewards are read by this prefix).
    assert a.simulation.session_id(0) == "sim-run1a-0" != b.simulation.session_id(0)
    assert a.simulation.config.seed != b.simulation.config.seed
    # Own taste under its own tenant's adapters; the same taste under the other's adapters.
    assert a.held_out.taste is PARAGRAPH and b.held_out.taste is LINES
    assert a.held_out.adapter == f"tenant-{key_tenant('key-a')}"
    assert (a.cross.taste, a.cross.adapter) == (PARAGRAPH, b.held_out.adapter)
    assert (b.cross.taste, b.cross.adapter) == (LINES, a.held_out.adapter)
    assert a.cross.client is b.client  # through the gateway: asked with the other's key
    [alone] = make_users(parse_args(["simulate"]), "m", "run2")
    assert alone.held_out.adapter == "policy" and alone.cross is None
    assert alone.client.api_key == "local"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tenants", "0"], "at least 1"),
        (["--tenants", "2", "--tenant-keys", "same,same"], "distinct --tenant-keys"),
        (["--tenants", "3"], "distinct --tenant-keys"),
        (["--tenants", "2", "--tenant-scenarios", "lines"], "as many --tenant-scenarios"),
        (["--tenants", "2", "--tenant-scenarios", "lines,arithmetic"], "'arithmetic' is not"),
        (["--tenants", "2", "--tenant-keys", " , "], "comma-separated"),
    ],
)
def test_a_bad_tenant_setup_is_refused(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["simulate", *argv])
    assert message in capsys.readouterr().err


def test_the_report_keeps_the_score_under_the_other_tenants_adapter(tmp_path) -> None:
    own = [HeldOutScore(0, 32, 0.25), HeldOutScore(2, 32, 0.75)]
    cross = [HeldOutScore(0, 32, 0.25), HeldOutScore(1, 32, 0.125)]
    stats = per_version([], [(1, 1.0)], own, cross)
    assert [(s.version, s.held_out, s.cross) for s in stats] == [
        (0, 0.25, 0.25), (1, None, 0.125), (2, 0.75, None),
    ]  # fmt: skip
    lines = table(stats).splitlines()
    assert lines[0].split()[-3:] == ["held-out", "other", "adapter"]
    assert lines[2].split() == ["1", "0", "0.000", "1", "+1.000", "-", "0.125"]
    write_csv(stats, tmp_path / "a.csv")
    rows = (tmp_path / "a.csv").read_text().splitlines()
    assert rows[0].endswith("held_out_score,held_out_other_adapter")
    assert rows[1:] == ["0,0,0.0000,0,,0.2500,0.2500", "1,0,0.0000,1,1.0000,,0.1250",
                        "2,0,0.0000,0,,0.7500,"]  # fmt: skip


def test_one_user_reports_as_before(tmp_path) -> None:
    stats = per_version([], [], [HeldOutScore(0, 32, 0.5)])
    write_csv(stats, tmp_path / "one.csv")
    assert (tmp_path / "one.csv").read_text().splitlines()[0].endswith("held_out_score")
    assert "other" not in table(stats)


def test_tenant_arguments_default_to_two_opposite_users() -> None:
    args = parse_args(["simulate", "--tenants", "2"])
    assert args.tenant_keys == ["tenant-a", "tenant-b"]
    assert args.tenant_scenarios == ["preference", "lines"]


def test_held_out_every_k_versions_and_the_final_one() -> None:
    evaluator = Evaluator(None, "m", parse_args(["simulate", "--held-out-every", "3"]))
    progress = Progress()
    assert evaluator.behind(progress, 3)  # v0 first
    evaluator.found[0] = HeldOutScore(0, 32, 0.5)
    progress.newest_version = 2
    assert not evaluator.behind(progress, 3) and evaluator.behind(progress)  # the final one
    progress.newest_version = 3
    assert evaluator.behind(progress, 3)
    with pytest.raises(SystemExit):
        parse_args(["simulate", "--held-out-every", "0"])
