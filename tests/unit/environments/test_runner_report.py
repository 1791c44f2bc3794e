"""Success rates by version and by family (agent_report.py) against hand-counted episodes, and
their CSV, table and plots."""

from __future__ import annotations

from clawrl.environments import agent_report as report
from clawrl.environments.episode import EpisodeResult


def episode(task_id: str, passed: bool | None, versions=(0,), split="heldout") -> EpisodeResult:
    result = EpisodeResult(f"s-{task_id}", task_id, task_id.split(".")[0], split)
    result.passed = passed
    for version in versions:
        result.saw(version)
    return result


def test_version_rates_count_whole_checked_episodes_only():
    results = [
        episode("a.1", True, (0,)),
        episode("a.2", False, (0,)),
        episode("b.1", True, (0,)),
        episode("b.2", True, (0, 1)),  # split by a sync: neither version's
        episode("c.1", None, (1,)),  # broke off: no verdict
        episode("c.2", True, (1,)),
    ]
    rates = report.version_rates(results, tasks=3, elapsed_s=12.0)
    assert rates == [
        report.VersionRate(0, 3, 2, True, 12.0),
        report.VersionRate(1, 1, 1, False, 12.0),
    ]
    assert rates[0].rate == 2 / 3
    assert report.version_rates([], tasks=3) == []


def test_family_rates_and_split_totals():
    results = [
        episode("a.1", True, split="train"),
        episode("a.1", False, split="train"),
        episode("a.2", None, split="train"),
        episode("a.3", True),
        episode("b.1", False, split="train"),
    ]
    rates = report.family_rates(results)
    assert rates == [
        report.FamilyRate("heldout", "a", tasks=1, attempts=1, passed=1, errors=0),
        report.FamilyRate("train", "a", tasks=2, attempts=2, passed=1, errors=1),
        report.FamilyRate("train", "b", tasks=1, attempts=1, passed=0, errors=0),
    ]
    assert [r.rate for r in rates] == [1.0, 0.5, 0.0]
    assert report.split_totals(rates) == [
        report.FamilyRate("heldout", "all", 1, 1, 1, 0),
        report.FamilyRate("train", "all", 3, 3, 1, 1),
    ]
    table = report.families_table(rates)
    assert table.splitlines()[3] == "| train | a | 2 | 2 | 1 | 0.50 | 1 |"


def test_merge_keeps_one_row_per_version_and_prefers_complete_ones():
    old = [report.VersionRate(0, 4, 1, True), report.VersionRate(2, 2, 2, False)]
    new = [
        report.VersionRate(0, 2, 2, False),  # partial: never over a complete one
        report.VersionRate(2, 4, 3, True),  # complete: replaces the partial one
        report.VersionRate(5, 4, 4, True),
    ]
    assert report.merge_versions(old, new) == [old[0], new[1], new[2]]


def test_versions_csv_round_trip_and_plots(tmp_path):
    rates = [report.VersionRate(0, 4, 1, True, None), report.VersionRate(3, 4, 3, True, 95.5),
             report.VersionRate(4, 1, 0, False, 120.0)]  # fmt: skip
    path = tmp_path / "held-out.csv"
    report.write_versions(rates, path)
    assert path.read_text().splitlines()[:3] == [
        "policy_version,episodes,passed,success_rate,complete,elapsed_s",
        "0,4,1,0.2500,1,",
        "3,4,3,0.7500,1,95.5",
    ]
    assert report.read_versions(path) == rates
    assert report.read_versions(tmp_path / "none.csv") == []
    report.plot_versions(rates, tmp_path / "held-out.png", "title")
    families = [report.FamilyRate("train", "a", 2, 4, 1, 0),
                report.FamilyRate("heldout", "a", 1, 2, 2, 0)]  # fmt: skip
    report.write_families(families, tmp_path / "base.csv")
    assert (tmp_path / "base.csv").read_text().splitlines()[1] == "train,a,2,4,1,0.2500,0"
    report.plot_families(families, tmp_path / "base.png", "title")
    for png in ("held-out.png", "base.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "no (split by a sync)" in report.versions_table(rates)


def test_the_package_that_draws_the_plots_depends_on_matplotlib() -> None:
    """The runner's image installs clawrl-environments alone: its held-out plot crashed the runner
    on Kubernetes while matplotlib came only with the simulator's package."""
    import tomllib

    from tests.conftest import REPO

    project = tomllib.loads((REPO / "services/environments/pyproject.toml").read_text())
    assert any(d.startswith("matplotlib") for d in project["project"]["dependencies"])
