"""The shared panel helpers: a panel is a title, a unit and its queries (PromQL, legend), and
the query builders every dashboard's panels are written with.

`$__rate_interval` is Grafana's; series are split by `job` (the scrape job: one per service
locally, the Service name on Kubernetes). Labelled counters that only appear on their first
event are written `... or vector(0)` so a quiet failure panel shows 0 rather than nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

RATE = "[$__rate_interval]"
# Every selector's scope: the namespace, the release (its pods' names start with the release's
# object prefix, `<release>-clawrl` unless fullnameOverride) and the pods picked (drill-down).
SCOPE = 'namespace="$namespace", pod=~"$release-.+", pod=~"$pod"'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    threshold: float | None = None  # drawn as a red line: past it, something needs attention


@dataclass(frozen=True)
class Row:
    """A row header: the panels after it, up to the next row, are its panels."""

    title: str


def sel(metric: str, match: str = "") -> str:
    """A selector of `metric` scoped to the dashboard's namespace, release and pods; `match`
    (written `{label="value"}`) adds matchers."""
    extra = match.strip("{}")
    return f"{metric}{{{SCOPE}{', ' + extra if extra else ''}}}"


def rate(metric: str, by: str = "", match: str = "") -> str:
    """Per-second rate of a counter, summed (by the given labels)."""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({sel(metric, match)}{RATE}))"


def quantile(q: float, histogram: str, by: str = "", match: str = "") -> str:
    """The q-quantile of a histogram over the rate window (by the given labels)."""
    labels = f"le, {by}" if by else "le"
    buckets = sel(f"{histogram}_bucket", match)
    return f"histogram_quantile({q}, sum by ({labels}) (rate({buckets}{RATE})))"


def quantiles(histogram: str, by: str = "", match: str = "", legend: str = "") -> tuple:
    prefix = f"{legend} " if legend else ""
    return tuple(
        (quantile(q, histogram, by, match), f"{prefix}p{round(q * 100)}") for q in (0.5, 0.99)
    )
