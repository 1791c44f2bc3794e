"""Metric helpers shared by the services. Each service owns one metrics module that builds its
metrics on a `CollectorRegistry` it creates at start (no process-wide registry), named
`clawrl_<service>_<what>_<unit>` with bounded labels."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# Request latencies from a millisecond (gateway overhead) up to minutes (long CPU generations).
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
TOKEN_COUNT_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus text format, with its content type, for a /metrics route."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
