"""The judge's Prometheus metrics, built on a registry made at start. Labels are bounded
(kinds, outcomes, reasons); never a session or turn id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from clawrl.common.metrics import LATENCY_BUCKETS_S

AGREEMENT_BUCKETS = (0.0, 0.34, 0.5, 0.67, 0.75, 0.99, 1.0)
# An episode's turn waits for the rest of the episode and its checker: seconds to many minutes.
OUTCOME_WAIT_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class JudgeMetrics:
    """Every metric the judge exports, registered by concern."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._outcomes(self.registry)
        self._judging(self.registry)
        self._latency(self.registry)
        self._streams(self.registry)
        self._episodes(self.registry)

    def _outcomes(self, r: CollectorRegistry) -> None:
        """What became of each turn: published, dead-lettered, retried, failed."""
        self.turns = Counter(
            "clawrl_judge_turns_total",
            "Turns handled, by outcome: published (a sample was written), promoted, duplicate "
            "(already judged: acknowledged only), dead_letter, failed (left for redelivery).",
            ["outcome"],
            registry=r,
        )
        self.samples = Counter(
            "clawrl_judge_samples_total",
            "Samples published, by kind (rl, opd, combined) and score sign (positive, "
            "negative, zero, none); masked ones included.",
            ["kind", "score"],
            registry=r,
        )
        self.masked = Counter(
            "clawrl_judge_masked_samples_total",
            "Samples published with an all-zero loss mask, by reason.",
            ["reason"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "clawrl_judge_dead_lettered_total",
            "Turns moved to the dead-letter stream, by reason (malformed, teacher, "
            "reward_fn, max_deliveries).",
            ["reason"],
            registry=r,
        )
        self.engine_retries = Counter(
            "clawrl_judge_engine_retries_total",
            "Turns put back to wait because an engine or judge API was unavailable.",
            registry=r,
        )
        self.errors = Counter(
            "clawrl_judge_errors_total",
            "Unexpected failures, by stage: judging a turn (left pending for redelivery), Redis, "
            "feedback, outcome, gRPC, and a worker loop that died (worker: the judge exits 1).",
            ["stage"],
            registry=r,
        )
        self.shortened = Counter(
            "clawrl_judge_prompts_shortened_total",
            "Judge prompts with a part shortened in the middle to fit, by kind (prm, hint).",
            ["kind"],
            registry=r,
        )

    def _judging(self, r: CollectorRegistry) -> None:
        """How turns were judged: PRM votes, hindsight hints, explicit feedback."""
        self.votes = Counter(
            "clawrl_judge_votes_total",
            "Votes asked, by kind (prm, hint) and result (valid, invalid = no parsable "
            "verdict, failed = the backend rejected it). With judging.prm=logprob a turn's PRM "
            "is one vote: invalid when no yes/no token is among the top log-probs.",
            ["kind", "result"],
            registry=r,
        )
        self.agreement = Histogram(
            "clawrl_judge_vote_agreement_ratio",
            "Share of a turn's valid PRM votes that agree with the majority.",
            buckets=AGREEMENT_BUCKETS,
            registry=r,
        )
        self.hints = Counter(
            "clawrl_judge_hints_total",
            "Hint selections: accepted (a usable hint) or none (no OPD signal).",
            ["result"],
            registry=r,
        )
        self.hint_sources = Counter(
            "clawrl_judge_hint_sources_total",
            "Turns whose hint came from each source, in the order they are asked: feedback (an "
            "explicit feedback's comment), hint_fn (the plug-in), judge (the hint votes); none.",
            ["source"],
            registry=r,
        )
        self.hint_fn_errors = Counter(
            "clawrl_judge_hint_fn_errors_total",
            "Turns masked because the hint plug-in raised or returned something that is not text.",
            registry=r,
        )
        self.hint_selections = Counter(
            "clawrl_judge_hint_selections_total",
            "Turns with more than one hint candidate, by the selection that picked one.",
            ["select"],
            registry=r,
        )
        self.feedback = Counter(
            "clawrl_judge_feedback_total",
            "Explicit feedback (POST /v1/feedback) by use: reward_override, reward_weighted, "
            "hint (a comment as the hindsight hint), reward_unused (opd trains on the teacher "
            "only), late (arrived while its turn was judged: audited, not merged).",
            ["use"],
            registry=r,
        )

    def _latency(self, r: CollectorRegistry) -> None:
        """How long judging takes."""
        self.judge_latency = Histogram(
            "clawrl_judge_vote_duration_seconds",
            "Time for a turn's m votes (all concurrent), by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.teacher_latency = Histogram(
            "clawrl_judge_teacher_duration_seconds",
            "Time for a turn's teacher log-probs.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.turn_latency = Histogram(
            "clawrl_judge_turn_duration_seconds",
            "Time from reading a turn to its sample being committed.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )

    def _streams(self, r: CollectorRegistry) -> None:
        """The turns stream and Redis, as the judge's housekeeping sees them."""
        self.lag = Gauge(
            "clawrl_judge_consumer_lag_entries",
            "Turns on the stream not yet delivered to the judges group.",
            registry=r,
        )
        self.pending = Gauge(
            "clawrl_judge_pending_entries",
            "Turns delivered to the judges group but not yet acknowledged.",
            registry=r,
        )
        self.in_flight = Gauge(
            "clawrl_judge_in_flight_turns", "Turns being judged by this process now.", registry=r
        )
        self.trimmed = Counter(
            "clawrl_judge_trimmed_entries_total",
            "Entries trimmed by retention, by stream (turns, samples: acknowledged and older "
            "than keep_s; audit: older than audit_keep_s).",
            ["stream"],
            registry=r,
        )
        # Redis refuses writes at maxmemory (noeviction): an alert must fire well before.
        self.redis_used_memory = Gauge(
            "clawrl_judge_redis_used_memory_bytes",
            "Redis's used_memory (INFO memory), read by the judge's housekeeping.",
            registry=r,
        )
        self.redis_max_memory = Gauge(
            "clawrl_judge_redis_maxmemory_bytes",
            "Redis's maxmemory setting (0: no limit), read by the judge's housekeeping.",
            registry=r,
        )

    def _episodes(self, r: CollectorRegistry) -> None:
        """Episodes' turns waiting for, and merged with, their outcome (POST /v1/outcomes)."""
        self.episode_turns = Counter(
            "clawrl_judge_episode_turns_total",
            "Turns of episodes (X-Episode: true) by result: merged (trained with (2 * outcome - "
            "1) + prm_step_coef * step score), no_outcome (none in time: masked, "
            "MASK_REASON_NO_OUTCOME), unused (episodes off on this judge, or opd mode: judged "
            "like a chat turn).",
            ["result"],
            registry=r,
        )
        for result in ("merged", "no_outcome", "unused"):
            self.episode_turns.labels(result)
        self.outcome_wait = Histogram(
            "clawrl_judge_outcome_wait_seconds",
            "How long an episode's turn waited for the outcome (until it came or expired).",
            buckets=OUTCOME_WAIT_BUCKETS_S,
            registry=r,
        )
        self.outcome_waiting = Gauge(
            "clawrl_judge_outcome_waiting_turns",
            "Turns of this process waiting for their episode's outcome now.",
            registry=r,
        )
