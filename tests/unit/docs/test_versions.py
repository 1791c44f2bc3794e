"""One version number for the whole project: the chart's version and appVersion, every service
package's version, and the newest release CHANGELOG.md (Keep a Changelog) names."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = yaml.safe_load((ROOT / "helm/clawrl/Chart.yaml").read_text())
PACKAGES = sorted(ROOT.glob("services/*/pyproject.toml"))
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def test_the_chart_and_every_package_have_one_version() -> None:
    assert CHART["appVersion"] == CHART["version"]
    assert len(PACKAGES) >= 6
    versions = {
        path.parent.name: tomllib.loads(path.read_text())["project"]["version"] for path in PACKAGES
    }
    assert versions == dict.fromkeys(versions, CHART["version"])


def test_the_changelog_keeps_a_changelog_and_names_the_version() -> None:
    assert CHANGELOG.startswith("# Changelog\n")
    assert "## [Unreleased]" in CHANGELOG
    releases = RELEASE.findall(CHANGELOG)
    assert releases, "a `## [x.y.z] - YYYY-MM-DD` release heading"
    assert releases[0][0] == CHART["version"], "the newest release is the chart's version"
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True), "newest release first"
    sections = set(re.findall(r"^### (.+)$", CHANGELOG, flags=re.MULTILINE))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
