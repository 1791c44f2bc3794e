"""A dashboard's Grafana JSON: its panels laid out two per line, the scope's variables and the
annotations every dashboard shares."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import Panel, Row, sel

PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}
SYNCS = sel("clawrl_weight_sync_syncs_total")
# Grafana annotations on every dashboard: each weight sync (by outcome) and each change of the
# policy version the gateways serve. A sync counter's outcome appears at its first sync, which
# increase() cannot see (no sample before it): a series new within the minute counts too.
ANNOTATIONS = (
    (
        "Weight syncs",
        "blue",
        f"sum by (outcome) ((increase({SYNCS}[1m]) > 0) or ({SYNCS} unless {SYNCS} offset 1m))",
        "weight sync: {{outcome}}",
    ),
    (
        "Policy version served",
        "green",
        f"max(changes({sel('clawrl_gateway_policy_version')}[1m])) > 0",
        "policy version changed",
    ),
)


def panel_json(panel: Panel, index: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.threshold is not None:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": "green", "value": None},
                {"color": "red", "value": panel.threshold},
            ],
        }
        defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": PROMETHEUS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": PROMETHEUS,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def layout(items: list[Panel | Row]) -> list[dict]:
    """Panels two per line, 8 high; a row header across the full width starts a new line."""
    placed, y, column = [], 0, 0
    for index, item in enumerate(items):
        if isinstance(item, Row):
            y += 8 if column else 0
            header = {"id": index + 1, "type": "row", "title": item.title, "collapsed": False}
            placed.append({**header, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y, column = y + 1, 0
            continue
        placed.append(panel_json(item, index, column * 12, y))
        y, column = (y + 8, 0) if column else (y, 1)
    return placed


def query_variable(name: str, label: str, query: str, **extra) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": PROMETHEUS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,  # on time range change: pods come and go
        "current": {},
        "hide": 0,
        "sort": 1,
        "includeAll": False,
        "multi": False,
        **extra,
    }


# The scope's variables. The chart sets namespace and release to its own (and gives each
# release's dashboards their own uid); the pod picker drills down to some pods.
VARIABLES = [
    query_variable("namespace", "Namespace", "label_values(up, namespace)"),
    query_variable(
        "release",
        "Release",
        'label_values(up{namespace="$namespace"}, pod)',
        # The object prefix in the names of the pods of a Deployment of the chart.
        regex="/^(.+)-(?:gateway|judge|judge-engine|policy-engine)(?:-[a-z0-9]+){0,2}$/",
    ),
    query_variable(
        "pod",
        "Pod",
        'label_values(up{namespace="$namespace", pod=~"$release-.+"}, pod)',
        includeAll=True,
        multi=True,
        allValue=".*",
        current={"selected": True, "text": ["All"], "value": ["$__all"]},
    ),
]


# A dashboard with per-tenant panels picks tenants (several or All).
TENANT_VARIABLE = query_variable(
    "tenant",
    "Tenant",
    'label_values(clawrl_trainer_tenant_steps_total{namespace="$namespace", '
    'pod=~"$release-.+"}, tenant)',
    includeAll=True,
    multi=True,
    allValue=".*",
    current={"selected": True, "text": ["All"], "value": ["$__all"]},
)


def dashboard_json(name: str, title: str, panels: list[Panel | Row]) -> dict:
    per_tenant = any(
        "$tenant" in expr for p in panels if isinstance(p, Panel) for expr, _ in p.queries
    )
    return {
        "uid": f"clawrl-{name}",
        "title": title,
        "description": f"clawrl's {name} dashboard, scoped to one namespace and release.",
        "tags": ["clawrl"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {
            "list": [
                {
                    "name": label,
                    "datasource": PROMETHEUS,
                    "enable": True,
                    "iconColor": color,
                    "expr": expr,
                    "step": "30s",
                    "titleFormat": text,
                    "useValueForTime": False,
                }
                for label, color, expr, text in ANNOTATIONS
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                *VARIABLES,
                *([TENANT_VARIABLE] if per_tenant else []),
            ]
        },
        "panels": layout(panels),
    }
