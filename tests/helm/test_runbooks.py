"""Every alert of the chart's PrometheusRule has a runbook: its `runbook_url` names its section of
docs/runbooks.md (under prometheusRule.runbookBaseUrl), and every runbook section is an alert's
(the chart rendered with the terminal track, whose alerts come with it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helm.conftest import render
from tests.unit.docs.markdown_links import slugify

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs/runbooks.md"
# The terminal track on too, so that its alerts (rendered only with it) are checked.
TERMINAL = ROOT / "deploy/values-terminal.yaml"
DEFAULT_BASE = yaml.safe_load((ROOT / "helm/clawrl/values.yaml").read_text())["prometheusRule"][
    "runbookBaseUrl"
]


def alerts(*sets: str) -> dict[str, dict]:
    (rule,) = [o for o in render(TERMINAL, sets=sets) if o["kind"] == "PrometheusRule"]
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def runbook_sections() -> dict[str, str]:
    """Anchor -> heading of each `## ` section of the runbooks page."""
    headings = re.findall(r"^## (.+?)\s*$", RUNBOOKS.read_text(), flags=re.MULTILINE)
    return {slugify(heading): heading for heading in headings}


@pytest.fixture(scope="module")
def rules() -> dict[str, dict]:
    return alerts("serviceMonitor.enabled=true")


def test_every_alert_links_its_runbook_section(rules: dict[str, dict]) -> None:
    sections = runbook_sections()
    for name, rule in rules.items():
        url = rule["annotations"].get("runbook_url", "")
        base, _, anchor = url.partition("#")
        assert base == DEFAULT_BASE, name
        assert anchor == name.lower(), name
        assert sections.get(anchor) == name, f"{name}: no `## {name}` in docs/runbooks.md"


def test_every_runbook_section_is_an_alert(rules: dict[str, dict]) -> None:
    assert sorted(runbook_sections().values()) == sorted(rules)


def test_each_runbook_says_what_it_means_how_to_confirm_and_what_to_do() -> None:
    text = RUNBOOKS.read_text()
    for heading in runbook_sections().values():
        body = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in body, f"{heading}: {part}"


def test_the_runbooks_move_with_the_docs_site() -> None:
    site = "https://docs.example.com/clawrl/runbooks/"
    for name, rule in alerts(
        "serviceMonitor.enabled=true", f"prometheusRule.runbookBaseUrl={site}"
    ).items():
        assert rule["annotations"]["runbook_url"] == f"{site}#{name.lower()}"
