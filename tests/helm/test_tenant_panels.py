"""The learning dashboard's Tenants row against the series the services export in per-tenant
mode. The live dashboard test runs the local stack in shared mode, where these panels are empty
by design; here the services' own metrics code records two tenants' activity (a gateway
admitting and switching through its real PauseGate, the trainer's per-step record and a reset,
a tenant's sync and unroute, the engine's adapter slots), its exposition becomes Prometheus
series labelled as a release's pods, and Prometheus's own engine (promtool test rules) evaluates
every query of the row: each must return data, and picking one tenant must leave only that
tenant's series."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clawrl.engine.metrics import EngineMetrics
from clawrl.gateway.control import PauseGate
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.weight_sync.job import SyncResult
from clawrl.trainer.weight_sync.metrics import WeightSyncMetrics
from tests.helm.dashboards import dashboards, queries, rows

SCOPE = {"$__rate_interval": "5m", "$namespace": "ml", "$release": "clawrl", "$pod": ".*"}
STEPS = 20  # minutes of samples; counters grow by their value every minute


async def exported_series() -> list[dict]:
    """promtool input series: every sample the services' metrics hold after two tenants'
    activity, labelled with the pod that exports it."""
    gateway = GatewayMetrics()
    gate = PauseGate(gateway, hold_timeout_s=1.0, retry_after_s=1, policy_version=3,
                     adapter="policy-v3")  # fmt: skip
    gate.switch(2, "tenant-alice-v2", tenant="alice")
    for tenant in ("alice", "alice", "bob", ""):  # bob has no adapter: served (and counted) shared
        async with gate.admit(tenant):
            pass
    trainer = TrainerMetrics()
    trainer.record_tenant_step("alice", 4, {"reward_mean": 0.75, "staleness_mean": 1.0})
    trainer.record_tenant_step("", 8, {"reward_mean": 0.25, "staleness_mean": 0.0})
    trainer.tenant_version.labels("alice").set(2)
    trainer.tenant_overflow.inc(3)
    trainer.tenant_resets.labels(outcome="reset").inc()
    sync = WeightSyncMetrics()
    sync.observe(SyncResult(version=2, outcome="ok", adapter="tenant-alice-v2", tenant="alice"))
    sync.tenant_unroutes.labels(tenant="alice", outcome="ok").inc()
    engine = EngineMetrics("policy")
    engine.lora_resident.set(2)
    engine.lora_adapters.set(3)
    engine.lora_on_demand_loads.inc()
    engine.lora_evictions.labels("resident").inc()
    engine.lora_slot_waits.inc()
    pods = {
        "clawrl-gateway-5d9f-abcde": gateway,
        "clawrl-trainer-ray-head": trainer,
        "clawrl-weight-sync-v2-xyz": sync,
        "clawrl-policy-engine-7c4-fghij": engine,
    }
    series = []
    for pod, metrics in pods.items():
        text = generate_latest(metrics.registry).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {**sample.labels, "namespace": "ml", "pod": pod}
                matchers = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                growing = family.type in ("counter", "histogram") and sample.value > 0
                values = f"0+{sample.value}x{STEPS}" if growing else f"{sample.value}x{STEPS}"
                series.append({"series": f"{sample.name}{{{matchers}}}", "values": values})
    return series


def row_queries(tenant: str) -> list[tuple[str, str]]:
    board = dashboards()["learning"]
    in_row = {title for title, row in rows(board).items() if row == "Tenants"}
    filled = []
    for title, expr in queries(board):
        if title in in_row:
            for variable, value in {**SCOPE, "$tenant": tenant}.items():
                expr = expr.replace(variable, value)
            filled.append((title, expr))
    return filled


def test_every_tenants_panel_shows_the_tenants_the_services_report(
    promtool: str, tmp_path: Path
) -> None:
    every, alice = row_queries(".*"), row_queries("alice")
    assert len(every) >= 10
    rules, checks = [], []
    for i, (_, expr) in enumerate(every):
        # 1 when the query returns data of its own (not the `or vector(0)` of a quiet panel).
        data = f"count({expr.removesuffix(' or vector(0)')})"
        rules.append({"record": f"q:every:{i}", "expr": f"({data} > bool 0) or vector(0)"})
        checks.append((f"q:every:{i}", 1))
    for i, (_, expr) in enumerate(alice):
        if 'tenant=~"alice"' not in expr:
            continue  # engine-wide panels, and the overflow count (no tenant)
        # 1 when it returns series of exactly one tenant (alice: the matcher admits no other).
        tenants = f"count(count by (tenant) ({expr.removesuffix(' or vector(0)')}))"
        rules.append({"record": f"q:alice:{i}", "expr": f"({tenants} == bool 1) or vector(0)"})
        checks.append((f"q:alice:{i}", 1))
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "tenants", "rules": rules}]})
    )
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": asyncio.run(exported_series()),
                "promql_expr_test": [
                    {
                        "expr": name,
                        "eval_time": f"{STEPS}m",
                        "exp_samples": [{"labels": name, "value": value}],
                    }
                    for name, value in checks
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    titles = "\n".join(f"q:every:{i} = {title}" for i, (title, _) in enumerate(every))
    assert result.returncode == 0, result.stdout + result.stderr + titles
