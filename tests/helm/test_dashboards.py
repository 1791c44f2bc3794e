"""The Grafana dashboards: generated from deploy/grafana/dashboards/ and up to date, valid
JSON that Grafana imports, shipped by the chart, and querying only metrics that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from clawrl.environments.runner_metrics import RunnerMetrics
from deploy.grafana.dashboards import render_all
from deploy.local.prometheus_local import write_config
from tests.helm.conftest import CHART, CLUSTER_VALUES, helm, render
from tests.helm.dashboards import (
    DASHBOARDS,
    annotation_queries,
    dashboards,
    known_metric_names,
    metric_names,
    queries,
    rows,
    unscoped,
)

EXPECTED = {"serving", "engines", "judge", "learning", "cluster", "agents"}


def test_the_committed_dashboards_are_the_generated_ones() -> None:
    committed = {path.name: path.read_text() for path in DASHBOARDS.glob("*.json")}
    assert committed == render_all(), "run: python -m deploy.grafana.dashboards"


def test_every_area_has_a_dashboard() -> None:
    assert set(dashboards()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_is_importable(name: str) -> None:
    board = dashboards()[name]
    assert board["uid"] == f"clawrl-{name}" and board["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and ids
    panels = [panel for panel in board["panels"] if panel["type"] != "row"]
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
    names = [v["name"] for v in board["templating"]["list"]]
    per_tenant = ["tenant"] if name == "learning" else []
    assert names == ["datasource", "namespace", "release", "pod", *per_tenant]
    assert all(panel["description"] for panel in panels)
    assert board["description"]
    # Nothing overlaps: no two panels share a grid cell.
    cells = [(x, y) for p in board["panels"] for x in range(p["gridPos"]["x"],
             p["gridPos"]["x"] + p["gridPos"]["w"]) for y in range(p["gridPos"]["y"],
             p["gridPos"]["y"] + p["gridPos"]["h"])]  # fmt: skip
    assert len(cells) == len(set(cells))


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


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_query_is_scoped_to_one_namespace_release_and_pods(name: str) -> None:
    board = dashboards()[name]
    loose = {
        (title, selector)
        for title, expr in queries(board) + annotation_queries(board)
        for selector in unscoped(expr)
    }
    assert not loose


def test_the_scope_check_catches_a_loose_selector() -> None:
    scoped = 'up{namespace="$namespace", pod=~"$release-.+", pod=~"$pod", job="x"}'
    assert unscoped(scoped) == []
    assert unscoped(f"{scoped} / up") == ["up"]
    assert unscoped('up{namespace="$namespace", job="x"}')  # a second release's pods
    assert unscoped('rate(x_total{pod=~"$pod"}[5m])')


def test_pod_variable_drills_down_within_the_release() -> None:
    variables = {v["name"]: v for v in dashboards()["serving"]["templating"]["list"]}
    assert variables["pod"]["multi"] and variables["pod"]["includeAll"]
    assert "$release" in variables["pod"]["definition"]
    assert "$namespace" in variables["release"]["definition"]


def test_the_tenants_row_shows_each_tenants_learning_and_adapters() -> None:
    """Per-tenant mode's row: reward, adapter versions (exported and served), samples and
    requests, steps, staleness and syncs, each per tenant and filtered by the tenant variable,
    and the engines' adapters (resident, loaded, evicted)."""
    board = dashboards()["learning"]
    in_row = {title for title, row in rows(board).items() if row == "Tenants"}
    metrics = {
        metric: expr
        for title, expr in queries(board)
        if title in in_row
        for metric in metric_names(expr)
    }
    wanted = {"clawrl_trainer_tenant_reward_mean", "clawrl_trainer_tenant_policy_version",
              "clawrl_gateway_tenant_policy_version", "clawrl_trainer_tenant_samples_total",
              "clawrl_gateway_tenant_requests_total", "clawrl_trainer_tenant_steps_total",
              "clawrl_trainer_tenant_staleness_mean"}  # fmt: skip
    assert wanted <= set(metrics)
    # The engines' adapter slots (LRU): resident and loaded adapters, evictions.
    engines = {"clawrl_engine_lora_adapters_resident", "clawrl_engine_lora_adapters",
               "clawrl_engine_lora_evictions_total",
               "clawrl_engine_lora_on_demand_loads_total"}  # fmt: skip
    assert engines <= set(metrics)
    wanted.add("clawrl_weight_sync_tenant_syncs_total")
    for metric in wanted:  # split by tenant and filtered to the tenants picked
        assert 'tenant=~"$tenant"' in metrics[metric] and "by (tenant" in metrics[metric], metric
    variables = {v["name"]: v for v in board["templating"]["list"]}
    tenant = variables["tenant"]
    assert tenant["multi"] and tenant["includeAll"] and tenant["allValue"] == ".*"
    assert 'namespace="$namespace", pod=~"$release-.+"' in tenant["definition"]
    selector = tenant["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
    assert metric_names(selector) == {"clawrl_trainer_tenant_steps_total"}
    # Only the learning dashboard has per-tenant panels, and so the variable.
    assert all("$tenant" not in expr for n, b in dashboards().items() if n != "learning"
               for _, expr in queries(b))  # fmt: skip


def test_the_agents_dashboard_shows_episodes_sandboxes_and_outcomes() -> None:
    """Track 2's dashboard: every metric the agent runner exports, the sandbox service's leases,
    commands and failures, and the judges' episode metrics, each in its row; the train success
    rate is passed over all finished train episodes, in all and per family."""
    board = dashboards()["agents"]
    in_row: dict[str, set[str]] = {}
    exprs = dict(queries(board))
    for title, expr in queries(board):
        in_row.setdefault(rows(board)[title], set()).update(metric_names(expr))
    # Each of the runner's metric families (a counter's name without _total, a histogram's
    # without _bucket) has a panel in the runner's row.
    families = {family.name for family in RunnerMetrics().registry.collect()}
    shown = {
        re.sub(r"_(total|bucket|sum|count)$", "", m) for m in in_row["Episodes (agent runner)"]
    }
    assert len(families) == 9 and families <= shown, families - shown
    sandboxes = {"clawrl_environments_leases_active", "clawrl_environments_leases_max",
                 "clawrl_environments_allocations_total",
                 "clawrl_environments_leases_closed_total",
                 "clawrl_environments_request_errors_total",
                 "clawrl_environments_backend_errors_total",
                 "clawrl_environments_command_duration_seconds_bucket"}  # fmt: skip
    assert sandboxes <= in_row["Sandboxes (sandbox service)"]
    # The sandboxes' commands beside the model's tool calls.
    assert "clawrl_environments_commands_total" in metric_names(exprs["Tool calls"])
    judge = {"clawrl_judge_episode_turns_total", "clawrl_judge_outcome_wait_seconds_bucket",
             "clawrl_judge_outcome_waiting_turns"}  # fmt: skip
    assert judge <= in_row["Episode outcomes (judge)"]
    success = exprs["Episode success rate (train)"]
    assert 'split="train", result="passed"' in success and "sum by (family)" in success
    merged = exprs["Episode turns merged vs masked"]
    assert "sum by (result) (rate(clawrl_judge_episode_turns_total{" in merged
    assert "sum by (split, result)" in exprs["Episodes by result"]


def test_request_latency_covers_every_api_route() -> None:
    """One latency panel per route of the API (chat completions, responses, messages): split
    by route, none filtered out."""
    (panel,) = [p for p in dashboards()["serving"]["panels"] if "latency" in p["title"].lower()]
    for target in panel["targets"]:
        assert "by (le, route)" in target["expr"] and "route=" not in target["expr"]
        assert target["legendFormat"].startswith("{{route}}")


def test_explicit_feedback_is_shown_where_it_is_taken_and_merged() -> None:
    exprs = {name: " ".join(expr for _, expr in queries(b)) for name, b in dashboards().items()}
    assert "sum by (outcome) (rate(clawrl_gateway_feedback_total{" in exprs["serving"]
    assert "sum by (use) (rate(clawrl_judge_feedback_total{" in exprs["judge"]


def test_annotations_mark_weight_syncs_and_version_changes() -> None:
    for name, board in dashboards().items():
        exprs = dict(annotation_queries(board))
        assert "clawrl_weight_sync_syncs_total" in exprs["Weight syncs"], name
        assert "clawrl_gateway_policy_version" in exprs["Policy version served"], name
        assert all(metric_names(expr) <= known_metric_names() for expr in exprs.values())


@pytest.mark.parametrize(
    ("board", "title", "threshold"),
    [("engines", "KV cache usage", 0.9), ("serving", "Error ratio (5xx)", 0.01)],
)
def test_saturation_and_error_panels_draw_their_threshold(
    board: str, title: str, threshold: float
) -> None:
    panel = next(p for p in dashboards()[board]["panels"] if p["title"] == title)
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["thresholds"]["steps"][-1] == {"color": "red", "value": threshold}
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"


def test_the_cluster_dashboard_shows_gpus_pods_redis_and_ray() -> None:
    metrics = {m for _, expr in queries(dashboards()["cluster"]) for m in metric_names(expr)}
    expected = {"DCGM_FI_DEV_GPU_UTIL", "kube_pod_container_status_restarts_total",
                "kube_pod_container_status_last_terminated_reason", "redis_stream_length",
                "clawrl_judge_redis_used_memory_bytes", "ray_node_gpus_utilization"}  # fmt: skip
    assert expected <= metrics


def test_ray_metrics_are_scraped_from_every_ray_node_once() -> None:
    """The Ray panels' series: port 8080 of the head and the GPU workers (KubeRay adds
    ray.io/is-ray-node to their pods), not of the job submitter, through one Service."""
    objects = render(sets=("serviceMonitor.enabled=true",))
    (rayjob,) = [o for o in objects if o["kind"] == "RayJob"]
    cluster = rayjob["spec"]["rayClusterSpec"]
    node = {"ray.io/is-ray-node": "yes"}  # what KubeRay adds to the Ray nodes' pods
    pods = {
        "head": {**cluster["headGroupSpec"]["template"]["metadata"]["labels"], **node},
        "gpu": {**cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"], **node},
        "submitter": rayjob["spec"]["submitterPodTemplate"]["metadata"]["labels"],
    }

    def selects(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    targets = []
    for monitor in [o for o in objects if o["kind"] == "ServiceMonitor"]:
        wanted = monitor["spec"]["selector"]["matchLabels"]
        scraped = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
        services = [
            o
            for o in objects
            if o["kind"] == "Service" and selects(wanted, o["metadata"]["labels"])
        ]
        targets += [(pod, port["port"]) for service in services for port in service["spec"]["ports"]
                    if port["name"] in scraped for pod, labels in pods.items()
                    if selects(service["spec"]["selector"], labels)]  # fmt: skip
    ray = sorted(target for target in targets if target[1] == 8080)
    assert ray == [("gpu", 8080), ("head", 8080)]
    assert len(targets) == len(set(targets))  # every series scraped once


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


def shipped_boards(release: str, namespace: str, *sets: str) -> dict[str, dict]:
    args = ["template", release, str(CHART), "--namespace", namespace, "-f", str(CLUSTER_VALUES)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    maps = [o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "ConfigMap"]
    return {
        key: {"board": json.loads(text), "annotations": m["metadata"].get("annotations", {})}
        for m in maps
        for key, text in m["data"].items()
        if key.endswith(".json")
    }


def test_each_release_ships_its_own_dashboards_opening_on_itself() -> None:
    first = shipped_boards("first", "ml")
    second = shipped_boards("second", "ml")
    elsewhere = shipped_boards("first", "staging")
    for name in first:
        uids = {b[name]["board"]["uid"] for b in (first, second, elsewhere)}
        assert len(uids) == 3 and all(len(uid) <= 40 for uid in uids)  # Grafana's uid limit
        board = second[name]["board"]
        assert "ml/second" in board["title"]
        current = {v["name"]: v["current"].get("value") for v in board["templating"]["list"]}
        assert current["namespace"] == "ml" and current["release"] == "second-clawrl"
        # The generated dashboard, with only its identity changed.
        generated = dashboards()[name.removesuffix(".json")]
        assert board["panels"] == generated["panels"]
        assert second[name]["annotations"] == {"grafana_folder": "clawrl"}
    custom = shipped_boards("x", "ml", "dashboards.folder=LLM", "dashboards.folderAnnotation=f")
    assert {b["annotations"]["f"] for b in custom.values()} == {"LLM"}
    assert not any(
        b["annotations"] for b in shipped_boards("x", "ml", "dashboards.folder=").values()
    )


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


def test_every_query_parses_as_promql(promtool: str, tmp_path: Path) -> None:
    """Each panel's and annotation's PromQL, with Grafana's variables filled in, is valid
    PromQL to Prometheus's own parser (promtool checks it as a recording rule's expression)."""
    filled = {"$__rate_interval": "1m", "$namespace": "ml", "$release": "clawrl", "$pod": ".*",
              "$tenant": ".*"}  # fmt: skip
    rules = []
    for name, board in dashboards().items():
        for i, (_, expr) in enumerate(queries(board) + annotation_queries(board)):
            for variable, value in filled.items():
                expr = expr.replace(variable, value)
            rules.append({"record": f"dashboard:{name}:{i}", "expr": expr})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
