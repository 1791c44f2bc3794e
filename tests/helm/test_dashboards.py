"""The Grafana dashboards: generated from deploy/grafana/dashboards.py and up to date, valid
JSON that Grafana imports, shipped by the chart, and querying only metrics that exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.grafana.dashboards import render_all
from deploy.local.prometheus_local import write_config
from tests.helm.conftest import render
from tests.helm.dashboards import DASHBOARDS, dashboards, known_metric_names, metric_names, queries

EXPECTED = {"serving", "engines", "judge", "learning"}


def test_the_committed_dashboards_are_the_generated_ones() -> None:
    committed = {path.name: path.read_text() for path in DASHBOARDS.glob("*.json")}
    assert committed == render_all(), "run: python deploy/grafana/dashboards.py"


def test_every_area_has_a_dashboard() -> None:
    assert set(dashboards()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_is_importable(name: str) -> None:
    board = dashboards()[name]
    assert board["uid"] == f"clawrl-{name}" and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and ids
    for panel in board["panels"]:
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_queried_metric_exists(name: str) -> None:
    known = known_metric_names()
    unknown = {
        (title, metric)
        for title, expr in queries(dashboards()[name])
        for metric in metric_names(expr)
        if metric not in known
    }
    assert not unknown
    assert all(metric_names(expr) for _, expr in queries(dashboards()[name]))


def test_the_metric_check_catches_a_misspelt_name() -> None:
    expr = 'sum by (route) (rate(clawrl_gateway_request_total{status=~"5.."}[5m])) or vector(0)'
    assert metric_names(expr) == {"clawrl_gateway_request_total"}
    assert "clawrl_gateway_request_total" not in known_metric_names()
    assert metric_names(
        "histogram_quantile(0.99, sum by (le, job) (rate(sglang:e2e_request_latency_seconds_bucket"
        "[$__rate_interval]))) / on (job) group_left sglang:num_running_reqs"
    ) == {"sglang:e2e_request_latency_seconds_bucket", "sglang:num_running_reqs"}


def test_the_chart_ships_every_dashboard_labelled_for_grafana() -> None:
    maps = [
        o for o in render() if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]
    shipped = {key for m in maps for key in m["data"]}
    assert shipped == {f"{name}.json" for name in dashboards()}
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert not [
        o
        for o in render(sets=("dashboards.enabled=false",))
        if "dashboard" in o["metadata"]["name"]
    ]


def test_the_local_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (make setup installs prometheus)")
    ports = {"gateway": 1, "policy-engine": 2, "judge-engine": 3, "judge": 4, "trainer": 5,
             "weight-sync": 6}  # fmt: skip
    config = write_config(tmp_path / "prometheus.yml", ports)
    result = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = config.read_text()
    assert all(f"127.0.0.1:{port}" in text for port in ports.values())
    # Jobs the stack does not run are left out rather than shown as down.
    assert "trainer" not in write_config(tmp_path / "some.yml", {"gateway": 1}).read_text()
