"""The Grafana dashboards as code: `python -m deploy.grafana.dashboards` writes
helm/clawrl/dashboards/<name>.json, which the chart ships as ConfigMaps and a local Grafana
imports. Panels query only metrics the services export (tests/helm/test_dashboards.py checks the
names against the services' registries and proves the queries against a live Prometheus).

One module per dashboard holds its panels; `panels` the helpers they are written with, `board`
the Grafana JSON around them.
"""

from __future__ import annotations

import json
from pathlib import Path

from deploy.grafana.dashboards.agents import AGENTS
from deploy.grafana.dashboards.board import dashboard_json
from deploy.grafana.dashboards.cluster import CLUSTER
from deploy.grafana.dashboards.engines import ENGINES
from deploy.grafana.dashboards.judge import JUDGE
from deploy.grafana.dashboards.learning import LEARNING, TENANTS
from deploy.grafana.dashboards.panels import Row
from deploy.grafana.dashboards.serving import SERVING

OUT = Path(__file__).resolve().parents[3] / "helm" / "clawrl" / "dashboards"

DASHBOARDS = {
    "serving": ("clawrl / serving", SERVING),
    "engines": ("clawrl / engines (SGLang)", ENGINES),
    "judge": ("clawrl / judge", JUDGE),
    "learning": ("clawrl / learning", [*LEARNING, Row("Tenants"), *TENANTS]),
    "cluster": ("clawrl / cluster (pods, GPUs, Redis, Ray)", CLUSTER),
    "agents": ("clawrl / agents (Track 2: episodes, sandboxes, outcomes)", AGENTS),
}


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{name}.json": json.dumps(dashboard_json(name, title, panels), indent=2) + "\n"
        for name, (title, panels) in DASHBOARDS.items()
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for file_name, text in render_all().items():
        (OUT / file_name).write_text(text)
        print(OUT / file_name)
    return 0
