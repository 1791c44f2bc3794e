"""The judge dashboard: turns judged, samples published, votes, hints, latency and lag."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import Panel, quantile, quantiles, rate, sel

ACCEPTED = '{result="accepted"}'

JUDGE = [
    Panel(
        "Turns judged",
        "ops",
        ((f"{rate('clawrl_judge_turns_total', 'outcome')} or vector(0)", "{{outcome}}"),),
        "Turns the judges finished, by outcome.",
    ),
    Panel(
        "Samples published (score mix)",
        "ops",
        (
            (
                f"{rate('clawrl_judge_samples_total', 'kind, score')} or vector(0)",
                "{{kind}} {{score}}",
            ),
        ),
        "Training samples the judges put on the samples stream, by kind (rl, opd, combined) and "
        "score sign.",
    ),
    Panel(
        "Votes",
        "ops",
        (
            (
                f"{rate('clawrl_judge_votes_total', 'kind, result')} or vector(0)",
                "{{kind}} {{result}}",
            ),
        ),
        "valid: a parsable verdict; invalid: none; failed: the backend refused.",
    ),
    Panel(
        "Vote agreement",
        "percentunit",
        (
            (
                f"{rate('clawrl_judge_vote_agreement_ratio_sum')}"
                f" / {rate('clawrl_judge_vote_agreement_ratio_count')}",
                "mean share agreeing with the majority",
            ),
        ),
        "Mean share of a turn's PRM votes that agree with the majority (low: the judge is unsure).",
    ),
    Panel(
        "Hint acceptance",
        "percentunit",
        (
            (
                f"({rate('clawrl_judge_hints_total', match=ACCEPTED)} or vector(0))"
                f" / {rate('clawrl_judge_hints_total')}",
                "accepted",
            ),
        ),
        "Share of hint selections that gave a usable hindsight hint (OPD signal).",
    ),
    Panel(
        "Latency",
        "s",
        (
            *quantiles("clawrl_judge_turn_duration_seconds", legend="turn"),
            (quantile(0.99, "clawrl_judge_vote_duration_seconds", "kind"), "votes {{kind}} p99"),
            (quantile(0.99, "clawrl_judge_teacher_duration_seconds"), "teacher p99"),
        ),
        "Time to judge one turn, one vote round and one teacher pass.",
    ),
    Panel(
        "Dead letters and masked samples",
        "ops",
        (
            (
                f"{rate('clawrl_judge_dead_lettered_total', 'reason')} or vector(0)",
                "dead: {{reason}}",
            ),
            (
                f"{rate('clawrl_judge_masked_samples_total', 'reason')} or vector(0)",
                "masked: {{reason}}",
            ),
        ),
        "Turns given up on (dead-lettered) and samples published with their loss masked, by "
        "reason.",
    ),
    Panel(
        "Lag",
        "short",
        (
            (f"max({sel('clawrl_judge_consumer_lag_entries')})", "not yet delivered"),
            (f"max({sel('clawrl_judge_pending_entries')})", "pending (unacknowledged)"),
            (f"sum({sel('clawrl_judge_in_flight_turns')})", "in flight"),
        ),
        "Turns on the stream not yet delivered to a judge, delivered but not acknowledged, and "
        "being judged now. Growing lag: the judges fall behind (ClawrlJudgeLagGrowing).",
    ),
    Panel(
        "Errors and retries",
        "ops",
        (
            (f"{rate('clawrl_judge_errors_total', 'stage')} or vector(0)", "error: {{stage}}"),
            (rate("clawrl_judge_engine_retries_total"), "engine unavailable, retried"),
            (
                f"{rate('clawrl_judge_prompts_shortened_total', 'kind')} or vector(0)",
                "shortened: {{kind}}",
            ),
        ),
        "Judge errors by stage, engine calls retried while the judge engine was unavailable, "
        "prompts shortened to fit.",
    ),
    Panel(
        "Explicit feedback merged",
        "ops",
        ((f"{rate('clawrl_judge_feedback_total', 'use')} or vector(0)", "{{use}}"),),
        "How the judges used explicit feedback: reward_override, reward_weighted, hint (a "
        "comment as the hindsight hint), reward_unused (opd trains on the teacher only), late "
        "(arrived while its turn was judged: audited, not merged).",
    ),
]
