"""The agent runner's Prometheus metrics (`clawrl agent run --metrics-port`), built on a
registry made at start. Labels are bounded: splits, the task set's families, results, stages;
never a session, lease or task id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clawrl.common.metrics import LATENCY_BUCKETS_S

STEP_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 100)
# Where an episode can fail; each failure is counted here and logged once.
STAGES = ("allocate", "reset", "model", "tool", "evaluate", "outcome")


class RunnerMetrics:
    """Every metric the agent runner exports."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.episodes = Counter(
            "clawrl_agent_episodes_total",
            "Episodes finished, by split, task family and result: passed or failed (the "
            "checker's verdict) or error (the episode broke off: see "
            "clawrl_agent_failures_total).",
            ["split", "family", "result"],
            registry=r,
        )
        self.failures = Counter(
            "clawrl_agent_failures_total",
            "Failures by stage: allocate (no lease after the retries), reset, model (the "
            "gateway failed a request), tool (the sandbox failed a command), evaluate (the "
            "checker could not run), outcome (the outcome could not be posted: the judge masks "
            "the episode's turns once outcome_timeout_s passes).",
            ["stage"],
            registry=r,
        )
        self.tool_calls = Counter(
            "clawrl_agent_tool_calls_total",
            "The model's tool calls, by what became of them: run (in the sandbox; an unknown "
            "tool or bad arguments come back as its observation), bad_json (the arguments "
            "were no JSON object: not run, the error is the observation), over_limit (past "
            "the task's step limit: not run).",
            ["outcome"],
            registry=r,
        )
        self.steps = Histogram(
            "clawrl_agent_episode_steps",
            "Commands run in the sandbox per finished episode.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "clawrl_agent_episode_duration_seconds",
            "Wall clock of an episode, lease to outcome.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.active = Gauge("clawrl_agent_active_episodes", "Episodes in progress.", registry=r)
        self.policy_version = Gauge(
            "clawrl_agent_policy_version",
            "The newest policy version a reply came from (its system_fingerprint).",
            registry=r,
        )
        self.held_out = Gauge(
            "clawrl_agent_held_out_success_ratio",
            "Share of the held-out tasks the newest evaluated version solved (greedy).",
            registry=r,
        )
        self.held_out_version = Gauge(
            "clawrl_agent_held_out_version",
            "The policy version clawrl_agent_held_out_success_ratio was measured on.",
            registry=r,
        )
        for stage in STAGES:
            self.failures.labels(stage)
        for outcome in ("run", "bad_json", "over_limit"):
            self.tool_calls.labels(outcome)
