"""The sandbox service's labelled counters exist at 0 from the start, so that the chart's alerts
(increase() of expired leases, backend errors) see a service's first event."""

from __future__ import annotations

from prometheus_client import generate_latest

from clawrl.environments.metrics import EnvironmentsMetrics


def test_every_label_value_the_alerts_watch_is_exported_at_zero_before_any_event() -> None:
    page = generate_latest(EnvironmentsMetrics().registry).decode()
    for series in (
        'clawrl_environments_leases_closed_total{reason="expired"} 0.0',
        'clawrl_environments_allocations_total{outcome="pool_exhausted"} 0.0',
        'clawrl_environments_backend_errors_total{op="exec"} 0.0',
        'clawrl_environments_backend_errors_total{op="reset"} 0.0',
        'clawrl_environments_resets_total{outcome="error"} 0.0',
        'clawrl_environments_commands_total{kind="tool",outcome="timeout"} 0.0',
        'clawrl_environments_evaluations_total{verdict="passed"} 0.0',
        'clawrl_environments_limit_hits_total{limit="pids"} 0.0',
    ):
        assert series in page, series
