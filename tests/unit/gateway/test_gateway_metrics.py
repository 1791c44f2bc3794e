"""The gateway's metrics as Prometheus first sees them."""

from __future__ import annotations

from prometheus_client import generate_latest

from clawrl.gateway.app import ROUTES, GatewayApp
from clawrl.gateway.metrics import GatewayMetrics


def test_every_route_has_a_latency_series_before_its_first_request():
    """rate() needs a sample before the traffic: a latency series that appeared only with the
    first chat request left the dashboard's latency panel empty after a burst of traffic."""
    metrics = GatewayMetrics()
    GatewayApp(api=None, metrics=metrics)
    text = generate_latest(metrics.registry).decode()
    for route in (*ROUTES, "other"):
        assert f'clawrl_gateway_request_duration_seconds_count{{route="{route}"}} 0.0' in text
