"""What the dashboards query, and which metric names exist: shared by the static dashboard tests
and the live test against Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from clawrl.common.metrics import GarbageCollection
from clawrl.engine.metrics import EngineMetrics
from clawrl.environments.metrics import EnvironmentsMetrics
from clawrl.environments.runner_metrics import RunnerMetrics
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.judge.metrics import JudgeMetrics
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from tests.conftest import REPO

DASHBOARDS = REPO / "helm" / "clawrl" / "dashboards"
SGLANG_DOCUMENTED = Path(__file__).parent / "sglang_metrics.txt"
EXTERNAL_DOCUMENTED = Path(__file__).parent / "external_metrics.txt"
# What every selector of a dashboard matches: its namespace, its release's pods, the pods picked
# (dcgm-exporter's series may name the GPU's pod in exported_namespace / exported_pod).
SCOPE = re.compile(
    r'(?:exported_)?namespace="\$namespace", (?:exported_)?pod=~"\$release-\.\+", '
    r'(?:exported_)?pod=~"\$pod"'
)
# Words of PromQL that look like metric names but are not.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "inf", "nan"}  # fmt: skip
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def rows(dashboard: dict) -> dict[str, str]:
    """Panel title -> the title of the row it sits in ("" above the first row)."""
    found, row = {}, ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        else:
            found[panel["title"]] = row
    return found


def annotation_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(annotation name, PromQL) of every Prometheus annotation of a dashboard."""
    return [(item["name"], item["expr"]) for item in dashboard["annotations"]["list"]]


def unscoped(expr: str, scope: re.Pattern = SCOPE) -> list[str]:
    """The selectors of a PromQL expression whose matchers do not start with `scope` (by
    default the dashboards')."""
    strings = [m.span() for m in re.finditer(r'"(?:[^"\\]|\\.)*"', expr)]
    missing = []
    for name in metric_names(expr):
        for match in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])", expr):
            if any(start <= match.start() < end for start, end in strings):
                continue  # inside a label value
            rest = expr[match.end() :]
            if not rest.startswith("{") or not scope.match(rest[1:]):
                missing.append(f"{name}{rest[:60]}")
    return missing


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery windows
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.:$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group().lower() not in KEYWORDS:
            names.add(match.group())
    return names


def exported(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes, labelled metrics included before their first use."""
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def known_metric_names() -> set[str]:
    """Names the services' metrics modules export, plus those SGLang and the cluster's other
    exporters (kube-state-metrics, cAdvisor, dcgm-exporter, redis_exporter, Ray, KubeRay)
    document."""
    names = set()
    services = (GatewayMetrics(), EngineMetrics("model"), JudgeMetrics(), TrainerMetrics(),
                WeightSyncMetrics(), EnvironmentsMetrics(), RunnerMetrics())  # fmt: skip
    for metrics in services:
        names |= exported(metrics.registry)
    for service in ("gateway", "engine"):  # installed by the serving processes at start
        registry = CollectorRegistry()
        registry.register(GarbageCollection(service))
        names |= exported(registry)
    documented = [
        *SGLANG_DOCUMENTED.read_text().splitlines(),
        *EXTERNAL_DOCUMENTED.read_text().splitlines(),
    ]
    return names | {line.strip() for line in documented if line.strip() and line[0] != "#"}
