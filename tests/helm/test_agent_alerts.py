"""Track 2's alerts in the chart's PrometheusRule: the sandbox service's (with
environments.enabled), the judges' episode outcomes (and judge.episodes.enabled) and the agent
runner's (with agentRunner.enabled); valid for promtool, reading metrics the services export,
scoped to the release's pods, and firing in promtool's unit tests exactly when they should."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helm.conftest import CHART, CLUSTER_VALUES, helm, render
from tests.helm.dashboards import known_metric_names, metric_names, unscoped
from tests.helm.test_alerts import (
    ALERTS,
    RELEASE_SCOPE,
    alert_test,
    fired,
    rules_by_alert,
    run_rule_tests,
)

TERMINAL = REPO / "deploy" / "values-terminal.yaml"
SANDBOX_ALERTS = {"ClawrlSandboxLeasesExpiring", "ClawrlSandboxPoolExhausted",
                  "ClawrlSandboxBackendFailing"}  # fmt: skip
OUTCOME_ALERTS = {"ClawrlEpisodeOutcomesMissing"}
RUNNER_ALERTS = {"ClawrlAgentEpisodesFailing", "ClawrlAgentRunnerStalled"}
AGENT_ALERTS = SANDBOX_ALERTS | OUTCOME_ALERTS | RUNNER_ALERTS
# render() installs release `clawrl` in namespace `ml`: its pods are clawrl-<component>-...
SERVICE = 'namespace="ml", pod="clawrl-environments-5f7c9d-abcde"'
JUDGE = 'namespace="ml", pod="clawrl-judge-7b9d4-fghij"'
RUNNER = 'namespace="ml", pod="clawrl-agent-runner-x7k2p"'


def prometheus_rule(*values: Path, sets: tuple[str, ...] = ()) -> dict:
    """The chart's PrometheusRule (the ServiceMonitors on) with these values."""
    objects = render(*values, sets=("serviceMonitor.enabled=true", *sets))
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    return rule


def alert_names(*sets: str, terminal: bool = True) -> set[str]:
    return set(rules_by_alert(prometheus_rule(*((TERMINAL,) if terminal else ()), sets=sets)))


def cumulative(per_minute: list[int]) -> str:
    """A counter's promtool values, one a minute, from what it gains each minute."""
    total, values = 0, []
    for gain in per_minute:
        total += gain
        values.append(str(total))
    return " ".join(values)


@pytest.fixture(scope="module")
def rule() -> dict:
    return prometheus_rule(TERMINAL)


@pytest.fixture(scope="module")
def rules_file(rule: dict, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def test_the_agent_alerts_come_with_the_terminal_track_only() -> None:
    assert alert_names(terminal=False) == ALERTS  # Track 1 alone
    assert alert_names() == ALERTS | AGENT_ALERTS
    # The sandbox service without the chart's runner (a runner elsewhere uses it).
    service_only = ("environments.enabled=true", "environments.backend=local")
    assert alert_names(*service_only, terminal=False) == ALERTS | SANDBOX_ALERTS | OUTCOME_ALERTS
    # Episodes judged like chat turns never wait for an outcome.
    assert alert_names("judge.episodes.enabled=false") == ALERTS | SANDBOX_ALERTS | RUNNER_ALERTS


def test_the_agent_alerts_pass_promtool_and_read_known_metrics_of_the_release(
    rule, promtool, rules_file
) -> None:
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    known = known_metric_names()
    for name in AGENT_ALERTS:
        alert = rules_by_alert(rule)[name]
        assert metric_names(alert["expr"]) and metric_names(alert["expr"]) <= known, name
        assert not unscoped(alert["expr"], RELEASE_SCOPE), name
        assert alert["labels"]["severity"] == "warning", name


def test_the_thresholds_are_values(tmp_path: Path) -> None:
    values = tmp_path / "thresholds.yaml"  # a file: --set makes 0.3 a string
    values.write_text(yaml.safe_dump({"prometheusRule": {
        "sandboxExpiredRatio": 0.3, "sandboxBackendErrors": 9, "episodeNoOutcomeRatio": 0.5,
        "agentFailureRatio": 0.6, "agentStalledWindow": "40m"}}))  # fmt: skip
    rules = rules_by_alert(prometheus_rule(TERMINAL, values))
    exprs = {name: r["expr"] for name, r in rules.items()}
    assert exprs["ClawrlSandboxLeasesExpiring"].endswith("> 0.3")
    assert exprs["ClawrlSandboxBackendFailing"].endswith("> 9")
    assert exprs["ClawrlEpisodeOutcomesMissing"].endswith("> 0.5")
    assert exprs["ClawrlAgentEpisodesFailing"].endswith("> 0.6")
    assert "offset 40m" in exprs["ClawrlAgentRunnerStalled"]
    assert "[40m]" in exprs["ClawrlAgentRunnerStalled"]
    refused = helm("template", "clawrl", str(CHART), "-n", "ml", "-f", str(CLUSTER_VALUES),
                   "--set", "prometheusRule.agentStalledWindow=15 minutes")  # fmt: skip
    assert refused.returncode != 0 and "agentStalledWindow" in refused.stderr


def test_leases_left_to_expire_fire(rule, promtool, rules_file, tmp_path) -> None:
    closed = f'clawrl_environments_leases_closed_total{{{SERVICE}, reason="closed"}}'
    expired = f'clawrl_environments_leases_closed_total{{{SERVICE}, reason="expired"}}'
    alert = "ClawrlSandboxLeasesExpiring"
    other = expired.replace('pod="clawrl-', 'pod="other-clawrl-')
    run_rule_tests(promtool, rules_file, tmp_path, [
        # 4 leases closed a minute; from minute 20 one a minute expires: 20 of 140 at 40 m.
        alert_test({closed: "0+4x60", expired: "0x20 1+1x39"}, alert, "40m", fired(rule, alert)),
        # One lease expired among 120 (a single runner's crash with one lease): under 10 %.
        alert_test({closed: "0+4x60", expired: "0x30 1x29"}, alert, "40m", []),
        # Another release's expiries are not this release's.
        alert_test({closed: "0+4x60", expired: "0x60", other: "0+2x60"}, alert, "40m", []),
    ])  # fmt: skip


def test_a_pool_refusing_leases_for_15_minutes_fires(rule, promtool, rules_file, tmp_path) -> None:
    refused = f'clawrl_environments_allocations_total{{{SERVICE}, outcome="pool_exhausted"}}'
    granted = f'clawrl_environments_allocations_total{{{SERVICE}, outcome="granted"}}'
    alert = "ClawrlSandboxPoolExhausted"
    # Bursts of refusals for 2 minutes every 10 minutes: a full pool for a moment.
    bursts = cumulative([2 if minute % 10 in (1, 2) else 0 for minute in range(60)])
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test({refused: "0+2x40", granted: "0+4x40"}, alert, "10m", []),  # pending
        alert_test({refused: "0+2x40", granted: "0+4x40"}, alert, "20m", fired(rule, alert)),
        alert_test({refused: bursts, granted: "0+4x60"}, alert, "45m", []),
        alert_test({refused: "0x40", granted: "0+4x40"}, alert, "30m", []),
    ])  # fmt: skip


def test_a_failing_sandbox_backend_fires_per_operation(
    rule, promtool, rules_file, tmp_path
) -> None:
    errors = 'clawrl_environments_backend_errors_total{{{}, op="{}"}}'
    reset, exec_ = errors.format(SERVICE, "reset"), errors.format(SERVICE, "exec")
    alert = "ClawrlSandboxBackendFailing"
    run_rule_tests(promtool, rules_file, tmp_path, [
        # Every command fails in the sandbox (1 a minute: 15 in 15 minutes); resets do not.
        alert_test({exec_: "0+1x30", reset: "0x30"}, alert, "20m", fired(rule, alert, op="exec")),
        # 4 failed resets and 4 failed commands in 15 minutes: under 5 for each operation.
        alert_test({exec_: "0x10 1+1x3 4x16", reset: "0x10 1+1x3 4x16"}, alert, "25m", []),
    ])  # fmt: skip


def test_turns_masked_for_want_of_an_outcome_fire(rule, promtool, rules_file, tmp_path) -> None:
    turns = 'clawrl_judge_episode_turns_total{{{}, result="{}"}}'
    merged, missing = turns.format(JUDGE, "merged"), turns.format(JUDGE, "no_outcome")
    unused = turns.format(JUDGE, "unused")
    alert = "ClawrlEpisodeOutcomesMissing"
    # 4 of every 10 episode turns masked; the many unused ones (judged like chat turns) would
    # dilute the share to 4 % were they counted.
    masking = {merged: "0+6x60", missing: "0+4x60", unused: "0+90x60"}
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test(masking, alert, "10m", []),  # pending for 15 minutes
        alert_test(masking, alert, "20m", fired(rule, alert)),
        # 1 in 11 masked (an episode broken off now and then): silent.
        alert_test({merged: "0+10x60", missing: "0+1x60", unused: "0x60"}, alert, "30m", []),
    ])  # fmt: skip


def test_episodes_breaking_off_fire_for_each_failing_stage(
    rule, promtool, rules_file, tmp_path
) -> None:
    failures = 'clawrl_agent_failures_total{{{}, stage="{}"}}'
    tool, allocate = failures.format(RUNNER, "tool"), failures.format(RUNNER, "allocate")
    model = failures.format(RUNNER, "model")
    episodes = f"clawrl_agent_episode_duration_seconds_count{{{RUNNER}}}"
    alert = "ClawrlAgentEpisodesFailing"
    both = {tool: "0+1x40", allocate: "0+1x40", model: "0x40", episodes: "0+6x40"}
    run_rule_tests(promtool, rules_file, tmp_path, [
        # Half the episodes break off in the sandbox's commands; the model stage never fails.
        alert_test({tool: "0+1x40", model: "0x40", episodes: "0+2x40"}, alert, "8m", []),
        alert_test({tool: "0+1x40", model: "0x40", episodes: "0+2x40"}, alert, "25m",
                   fired(rule, alert, stage="tool")),
        # A third break off, a sixth at each of two stages: both stages are named.
        alert_test(both, alert, "25m",
                   fired(rule, alert, stage="allocate") + fired(rule, alert, stage="tool")),
        # One episode in 8 breaks off: silent.
        alert_test({tool: "0+1x40", model: "0x40", episodes: "0+8x40"}, alert, "25m", []),
    ])  # fmt: skip


def test_a_runner_up_without_finishing_an_episode_fires(
    rule, promtool, rules_file, tmp_path
) -> None:
    active = f"clawrl_agent_active_episodes{{{RUNNER}}}"
    episodes = f"clawrl_agent_episode_duration_seconds_count{{{RUNNER}}}"
    alert = "ClawrlAgentRunnerStalled"
    # Episodes end until minute 10, none after, with 4 in progress all along.
    hung = {active: "4x60", episodes: "0+1x10 10x50"}
    # A runner (Job pod) that started at minute 20 and has finished nothing yet.
    starting = {active: "_x20 4x40", episodes: "_x20 0x40"}
    # A runner that finished its episodes and exited at minute 20.
    done = {active: "4x10 0x10", episodes: "0+1x20"}
    run_rule_tests(promtool, rules_file, tmp_path, [
        alert_test(hung, alert, "24m", []),  # the window still holds an episode
        alert_test(hung, alert, "35m", fired(rule, alert, pod="clawrl-agent-runner-x7k2p")),
        alert_test(starting, alert, "33m", []),  # up for 13 minutes: still in its first window
        alert_test(starting, alert, "45m", fired(rule, alert, pod="clawrl-agent-runner-x7k2p")),
        alert_test(done, alert, "25m", []),
        alert_test({active: "4x60", episodes: "0+1x60"}, alert, "40m", []),
    ])  # fmt: skip
