"""The chart's PrometheusRule: on with the ServiceMonitors, valid for Prometheus's own `promtool`,
reading metrics that exist, scoped to the release's pods, and firing (in promtool's unit tests)
exactly when it should. tests/e2e/test_dashboards_live.py evaluates the same rules against the
live stack."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.conftest import render
from tests.helm.dashboards import known_metric_names, metric_names, unscoped

# The issue's list (22): trainer stalled, version lag, sync failures, judge lag, 5xx, engine
# queue or KV cache, Redis memory, RayJob failed, a scrape target down.
ALERTS = {
    "ClawrlTrainerStalled", "ClawrlPolicyVersionLag", "ClawrlWeightSyncFailing",
    "ClawrlJudgeLagGrowing", "ClawrlGateway5xxHigh", "ClawrlEngineKVCacheFull",
    "ClawrlEngineQueueing", "ClawrlRedisMemoryHigh", "ClawrlRayJobFailed", "ClawrlTargetDown",
    "ClawrlTenantVersionLag",  # per-tenant mode (20)
}  # fmt: skip
# render() installs release `clawrl` in namespace `ml`: its pods are named clawrl-<component>-...
RELEASE_SCOPE = re.compile(
    r'(?:exported_)?namespace="ml", (?:pod=~"clawrl-\.\+"|name=~"clawrl-trainer-\[0-9a-f\]\{8\}")'
)
GATEWAY = 'namespace="ml", pod="clawrl-gateway-6c9d8f7b5-q4z2k", job="clawrl-gateway"'


def prometheus_rules(*sets: str) -> list[dict]:
    return [o for o in render(sets=sets) if o["kind"] == "PrometheusRule"]


def rules_by_alert(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


@pytest.fixture(scope="module")
def rule() -> dict:
    (rule,) = prometheus_rules("serviceMonitor.enabled=true")
    return rule


@pytest.fixture(scope="module")
def rules_file(rule: dict, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def test_the_alerts_come_with_the_service_monitors() -> None:
    assert not prometheus_rules()  # no ServiceMonitors: no Prometheus Operator assumed
    assert not prometheus_rules("serviceMonitor.enabled=true", "prometheusRule.enabled=false")
    assert len(prometheus_rules("prometheusRule.enabled=true")) == 1


def test_every_alert_of_the_issue_is_there_and_passes_promtool(rule, promtool, rules_file):
    assert set(rules_by_alert(rule)) == ALERTS
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for name, alert in rules_by_alert(rule).items():
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name


def test_every_alert_reads_known_metrics_of_this_release_only(rule) -> None:
    known = known_metric_names()
    for name, alert in rules_by_alert(rule).items():
        assert metric_names(alert["expr"]) and metric_names(alert["expr"]) <= known, name
        assert not unscoped(alert["expr"], RELEASE_SCOPE), name


def run_rule_tests(promtool: str, rules_file: Path, tmp_path: Path, tests: list[dict]) -> None:
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "evaluation_interval": "1m",
                                    "tests": tests}))  # fmt: skip
    result = subprocess.run([promtool, "test", "rules", str(path)],
                            capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def alert_test(series: dict[str, str], alert: str, eval_time: str, fired: list[dict]) -> dict:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": fired}],
    }


def fired(rule: dict, alert: str, **labels: str) -> list[dict]:
    spec = rules_by_alert(rule)[alert]
    # Prometheus fills in {{ $labels.<name> }} from the alert's labels.
    annotations = {
        key: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
        for key, text in spec["annotations"].items()
    }
    return [{"exp_labels": {**spec["labels"], **labels}, "exp_annotations": annotations}]


def test_the_trainer_stalls_when_samples_arrive_and_no_step_follows(
    rule, promtool, rules_file, tmp_path
) -> None:
    samples = 'clawrl_judge_samples_total{namespace="ml", pod="clawrl-judge-7b9-abcde", kind="rl"}'
    steps = 'clawrl_trainer_steps_total{namespace="ml", pod="clawrl-trainer-1a2b3c4d-head-x"}'
    stalled = "ClawrlTrainerStalled"
    run_rule_tests(promtool, rules_file, tmp_path, [
        # Samples every minute, steps up to minute 10 and none after: silent while the 15 m
        # window still holds a step, firing 5 m after it no longer does.
        alert_test({samples: "0+4x45", steps: "0+1x10 10x35"}, stalled, "20m", []),
        alert_test({samples: "0+4x45", steps: "0+1x10 10x35"}, stalled, "32m",
                   fired(rule, stalled)),
        # A step every 4 samples: silent; no samples at all (nothing to train): silent.
        alert_test({samples: "0+4x30", steps: "0+1x30"}, stalled, "25m", []),
        alert_test({samples: "12x30", steps: "7x30"}, stalled, "25m", []),
        # Another release's samples are not this trainer's business.
        alert_test({samples.replace("clawrl-judge", "other-clawrl-judge"): "0+4x30",
                    steps: "7x30"}, stalled, "25m", []),
    ])  # fmt: skip


def test_gateway_errors_fire_past_one_percent(rule, promtool, rules_file, tmp_path) -> None:
    ok = f'clawrl_gateway_requests_total{{{GATEWAY}, route="/v1/chat/completions", status="200"}}'
    err = f'clawrl_gateway_requests_total{{{GATEWAY}, route="/v1/chat/completions", status="502"}}'
    alert = "ClawrlGateway5xxHigh"
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test({ok: "0+98x20", err: "0+2x20"}, alert, "12m", fired(rule, alert)),  # 2 %
        alert_test({ok: "0+199x20", err: "0+1x20"}, alert, "12m", []),  # 0.5 %
    ])  # fmt: skip


def test_a_target_down_fires_for_this_release_only(rule, promtool, rules_file, tmp_path) -> None:
    other = GATEWAY.replace('pod="clawrl-', 'pod="other-clawrl-')
    alert = "ClawrlTargetDown"
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test({f"up{{{GATEWAY}}}": "0x10"}, alert, "7m",
                   fired(rule, alert, namespace="ml", pod="clawrl-gateway-6c9d8f7b5-q4z2k",
                         job="clawrl-gateway")),
        alert_test({f"up{{{other}}}": "0x10", f"up{{{GATEWAY}}}": "1x10"}, alert, "7m", []),
    ])  # fmt: skip


def test_a_failed_rayjob_of_the_release_fires(rule, promtool, rules_file, tmp_path) -> None:
    status = ('kuberay_job_deployment_status{{namespace="kuberay", exported_namespace="ml", '
              'name="{name}", deployment_status="{status}"}}')  # fmt: skip
    ours, theirs = "clawrl-trainer-0123abcd", "other-clawrl-trainer-0123abcd"
    alert = "ClawrlRayJobFailed"
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test({status.format(name=ours, status="Failed"): "1x5"}, alert, "2m",
                   fired(rule, alert, name=ours)),
        alert_test({status.format(name=ours, status="Running"): "1x5",
                    status.format(name=ours, status="Failed"): "0x5",
                    status.format(name=theirs, status="Failed"): "1x5"}, alert, "2m", []),
    ])  # fmt: skip


def test_a_tenant_served_an_old_adapter_fires_for_that_tenant(
    rule, promtool, rules_file, tmp_path
) -> None:
    trainer = ('clawrl_trainer_tenant_policy_version{{namespace="ml", '
               'pod="clawrl-trainer-1a2b3c4d-head-x", tenant="{}"}}')  # fmt: skip
    gateway = ('clawrl_gateway_tenant_policy_version{{namespace="ml", pod="clawrl-gateway-{}", '
               'tenant="{}"}}')  # fmt: skip
    alert = "ClawrlTenantVersionLag"
    # Tenant alice's adapter reaches v10 while one gateway stays at v5; bob's syncs keep up.
    series = {
        trainer.format("alice"): "0+1x10 10x30", gateway.format("a", "alice"): "0+1x10 10x30",
        gateway.format("b", "alice"): "0+1x5 5x35",
        trainer.format("bob"): "0+1x40", gateway.format("a", "bob"): "0 0+1x39",
    }  # fmt: skip
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test(series, alert, "20m", []),  # lagging for 10 m only
        alert_test(series, alert, "30m", fired(rule, alert, tenant="alice")),
    ])  # fmt: skip
