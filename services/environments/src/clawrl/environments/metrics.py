"""The sandbox service's Prometheus metrics, built on a registry made at start. Labels are
bounded (routes, kinds, outcomes, reasons, limits); never a lease or task id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clawrl.common.metrics import LATENCY_BUCKETS_S

# Every value of the labelled counters, exported at 0 from the start: increase() over a series
# that appears with its first event misses that event (the alerts on expired leases and
# backend errors would never see a service's first one).
ALLOCATION_OUTCOMES = ("granted", "reused", "pool_exhausted")
CLOSE_REASONS = ("closed", "expired", "shutdown")
RESET_OUTCOMES = ("ok", "bad_task", "error")
COMMAND_KINDS = ("tool", "evaluate")
COMMAND_OUTCOMES = ("ok", "failed", "timeout", "error")
LIMITS = ("timeout", "cpu", "file_size", "pids", "output")
VERDICTS = ("passed", "failed", "error")
BACKEND_OPS = ("reset", "exec", "destroy", "reap", "reclaim")


class EnvironmentsMetrics:
    """Every metric the sandbox service exports, registered by concern."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._leases(self.registry)
        self._commands(self.registry)
        self._errors(self.registry)
        for counter, values in (
            (self.allocations, ALLOCATION_OUTCOMES),
            (self.leases_closed, CLOSE_REASONS),
            (self.resets, RESET_OUTCOMES),
            (self.limit_hits, LIMITS),
            (self.evaluations, VERDICTS),
            (self.backend_errors, BACKEND_OPS),
        ):
            for value in values:
                counter.labels(value)
        for kind in COMMAND_KINDS:
            for outcome in COMMAND_OUTCOMES:
                self.commands.labels(kind, outcome)

    def _leases(self, r: CollectorRegistry) -> None:
        """Leases: how many, how they were granted and how they ended."""
        self.leases_active = Gauge(
            "clawrl_environments_leases_active",
            "Leases held now (each holds at most one sandbox).",
            registry=r,
        )
        self.leases_limit = Gauge(
            "clawrl_environments_leases_max",
            "The pool's limit on leases held at once (leases.max_leases).",
            registry=r,
        )
        self.allocations = Counter(
            "clawrl_environments_allocations_total",
            "/allocate calls by outcome: granted, reused (a repeated request_id), "
            "pool_exhausted (429).",
            ["outcome"],
            registry=r,
        )
        self.leases_closed = Counter(
            "clawrl_environments_leases_closed_total",
            "Leases ended, by reason: closed (/close), expired (no call within the TTL: the "
            "runner is gone, its sandbox reclaimed), shutdown.",
            ["reason"],
            registry=r,
        )
        self.leftovers = Counter(
            "clawrl_environments_leftover_sandboxes_removed_total",
            "Sandboxes found at start that no lease owns (an earlier process's), destroyed.",
            registry=r,
        )
        self.resets = Counter(
            "clawrl_environments_resets_total",
            "/reset calls by outcome: ok, bad_task (unknown tool, bad limits, failed setup: "
            "400), error (the backend failed).",
            ["outcome"],
            registry=r,
        )

    def _commands(self, r: CollectorRegistry) -> None:
        """Commands run in sandboxes: tool calls and checkers."""
        self.commands = Counter(
            "clawrl_environments_commands_total",
            "Commands run in sandboxes, by kind (tool = an agent's tool call, evaluate = a "
            "checker) and outcome (ok = exit 0, failed = other exit, timeout = killed at its "
            "wall-clock limit, error = the sandbox itself failed).",
            ["kind", "outcome"],
            registry=r,
        )
        self.command_seconds = Histogram(
            "clawrl_environments_command_duration_seconds",
            "Wall clock of one command in a sandbox (setup and teardown of the sandbox "
            "included), by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.limit_hits = Counter(
            "clawrl_environments_limit_hits_total",
            "Commands that hit a limit, by limit: timeout, cpu (SIGXCPU), file_size "
            "(SIGXFSZ), pids (a fork refused), output (stdout/stderr cut).",
            ["limit"],
            registry=r,
        )
        self.invalid_tool_calls = Counter(
            "clawrl_environments_invalid_tool_calls_total",
            "Tool calls the model made that could not run (unknown tool, bad arguments); "
            "answered as an observation.",
            registry=r,
        )
        self.evaluations = Counter(
            "clawrl_environments_evaluations_total",
            "Checker verdicts: passed, failed (non-zero exit or timeout), error.",
            ["verdict"],
            registry=r,
        )

    def _errors(self, r: CollectorRegistry) -> None:
        """Requests that were refused or failed."""
        self.request_errors = Counter(
            "clawrl_environments_request_errors_total",
            "Requests answered with an error, by route and code (BAD_REQUEST, UNAUTHORIZED, "
            "LEASE_NOT_FOUND, NOT_RESET, POOL_EXHAUSTED, BAD_TASK, SANDBOX_ERROR, ...).",
            ["route", "code"],
            registry=r,
        )
        self.backend_errors = Counter(
            "clawrl_environments_backend_errors_total",
            "Backend failures (the sandbox, not the command), by operation.",
            ["op"],
            registry=r,
        )
