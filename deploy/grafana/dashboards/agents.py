"""The agents dashboard (Track 2): the agent runner's episodes (clawrl_agent_*), the sandbox
service's leases and commands (clawrl_environments_*), and how the judges merged the episodes'
outcomes into their turns (clawrl_judge_episode_*, clawrl_judge_outcome_*)."""

from __future__ import annotations

from deploy.grafana.dashboards.panels import Panel, Row, quantiles, rate, sel

EPISODES = "clawrl_agent_episodes_total"
TRAIN = '{split="train"}'
TRAIN_PASSED = '{split="train", result="passed"}'
NOT_OK = '{outcome!="ok"}'


def per_minute(expr: str) -> str:
    return f"({expr}) * 60"


RUNNER = [
    Row("Episodes (agent runner)"),
    Panel(
        "Episode success rate (train)",
        "percentunit",
        (
            (
                f"({rate(EPISODES, match=TRAIN_PASSED)} or 0 * {rate(EPISODES, match=TRAIN)})"
                f" / {rate(EPISODES, match=TRAIN)}",
                "all families",
            ),
            (
                f"({rate(EPISODES, 'family', TRAIN_PASSED)}"
                f" or 0 * {rate(EPISODES, 'family', TRAIN)})"
                f" / {rate(EPISODES, 'family', TRAIN)}",
                "{{family}}",
            ),
        ),
        "Share of the train split's finished episodes whose checker passed (sampled replies), "
        "over the rate window, in all and per task family. Episodes that broke off (error) "
        "count as unsolved.",
    ),
    Panel(
        "Held-out success (greedy)",
        "percentunit",
        ((f"max({sel('clawrl_agent_held_out_success_ratio')})", "held-out success"),),
        "Share of the held-out tasks the newest evaluated policy version solved, greedily "
        "(`clawrl agent run --held-out-every K`); the version it was measured on is in the "
        "next panel. 0 until the first evaluation.",
    ),
    Panel(
        "Policy versions",
        "short",
        (
            (f"max({sel('clawrl_agent_policy_version')})", "newest version replying to the runner"),
            (f"max({sel('clawrl_agent_held_out_version')})", "version of the held-out figure"),
            (f"max({sel('clawrl_gateway_policy_version')})", "version the gateways serve"),
        ),
        "The newest policy version the runner's replies came from, the version the held-out "
        "success was measured on, and the gateways' version: held-out success per version is "
        "the previous panel read at each step of the second line.",
    ),
    Panel(
        "Episodes by result",
        "opm",
        (
            (
                per_minute(f"{rate(EPISODES, 'split, result')} or vector(0)"),
                "{{split}} {{result}}",
            ),
        ),
        "Episodes finished per minute, by split and result: passed or failed (the checker's "
        "verdict), error (broke off: see the failures panel).",
    ),
    Panel(
        "Episode failures",
        "opm",
        (
            (
                per_minute(f"{rate('clawrl_agent_failures_total', 'stage')} or vector(0)"),
                "{{stage}}",
            ),
        ),
        "Episode failures per minute by stage: allocate (no lease), reset, model (the gateway "
        "failed a request), tool (the sandbox failed a command), evaluate (the checker could "
        "not run), outcome (not posted: the judge masks the episode's turns).",
    ),
    Panel(
        "Tool calls",
        "ops",
        (
            (
                f"{rate('clawrl_agent_tool_calls_total', 'outcome')} or vector(0)",
                "runner: {{outcome}}",
            ),
            (
                f"{rate('clawrl_environments_commands_total', 'kind, outcome')} or vector(0)",
                "sandbox: {{kind}} {{outcome}}",
            ),
        ),
        "The model's tool calls by what became of them (run, bad_json, over_limit), and the "
        "commands the sandboxes ran by kind (tool, evaluate = a checker) and exit (ok, failed, "
        "timeout, error).",
    ),
    Panel(
        "Steps per episode",
        "short",
        quantiles("clawrl_agent_episode_steps"),
        "Commands run in the sandbox per finished episode.",
    ),
    Panel(
        "Episode duration",
        "s",
        quantiles("clawrl_agent_episode_duration_seconds"),
        "Wall clock of an episode, from its lease to its outcome.",
    ),
    Panel(
        "Episodes in progress",
        "short",
        (
            (f"sum({sel('clawrl_agent_active_episodes')})", "episodes in progress"),
            (f"sum({sel('clawrl_environments_leases_active')})", "sandbox leases held"),
        ),
        "Episodes the runners play now, and the sandbox leases held for them (more leases than "
        "episodes: leases of a gone runner, waiting for their TTL).",
    ),
]

SANDBOXES = [
    Row("Sandboxes (sandbox service)"),
    Panel(
        "Sandbox leases",
        "short",
        (
            (f"sum({sel('clawrl_environments_leases_active')})", "held"),
            (f"sum({sel('clawrl_environments_leases_max')})", "limit (leases.max_leases)"),
        ),
        "Leases held now against the pool's limit: at the limit, /allocate answers 429 and "
        "episodes wait.",
    ),
    Panel(
        "Lease allocations and ends",
        "ops",
        (
            (
                f"{rate('clawrl_environments_allocations_total', 'outcome')} or vector(0)",
                "allocate: {{outcome}}",
            ),
            (
                f"{rate('clawrl_environments_leases_closed_total', 'reason')} or vector(0)",
                "ended: {{reason}}",
            ),
        ),
        "/allocate by outcome (granted, reused, pool_exhausted, error) and leases ended by "
        "reason: closed, expired (no heartbeat within the TTL: a runner died and its sandbox "
        "was reclaimed), shutdown.",
    ),
    Panel(
        "Sandbox failures",
        "ops",
        (
            (
                f"{rate('clawrl_environments_request_errors_total', 'route, code')} or vector(0)",
                "{{route}} {{code}}",
            ),
            (
                f"{rate('clawrl_environments_backend_errors_total', 'op')} or vector(0)",
                "backend: {{op}}",
            ),
            (
                f"{rate('clawrl_environments_resets_total', 'outcome', NOT_OK)} or vector(0)",
                "reset: {{outcome}}",
            ),
        ),
        "Requests answered with an error (by route and code), backend failures (the sandbox "
        "itself, e.g. a claim agent-sandbox will not fulfil) and resets that failed.",
    ),
    Panel(
        "Command latency",
        "s",
        quantiles("clawrl_environments_command_duration_seconds", "kind", legend="{{kind}}"),
        "Wall clock of one command in a sandbox, by kind (tool, evaluate).",
    ),
    Panel(
        "Limits hit and checker verdicts",
        "ops",
        (
            (
                f"{rate('clawrl_environments_limit_hits_total', 'limit')} or vector(0)",
                "limit: {{limit}}",
            ),
            (
                f"{rate('clawrl_environments_evaluations_total', 'verdict')} or vector(0)",
                "checker: {{verdict}}",
            ),
        ),
        "Commands that hit a limit (timeout, cpu, file_size, pids, output) and the checkers' "
        "verdicts (passed, failed, error).",
    ),
]

OUTCOMES = [
    Row("Episode outcomes (judge)"),
    Panel(
        "Episode turns merged vs masked",
        "ops",
        (
            (
                f"{rate('clawrl_judge_episode_turns_total', 'result')} or vector(0)",
                "{{result}}",
            ),
        ),
        "Episodes' turns by result: merged (trained with (2 * outcome - 1) + prm_step_coef * "
        "step score), no_outcome (none within outcome_timeout_s: masked, never trained), unused "
        "(episodes off on the judge, or opd: judged like a chat turn).",
    ),
    Panel(
        "Outcome wait",
        "s",
        quantiles("clawrl_judge_outcome_wait_seconds"),
        "How long an episode's turn waited at the judge for its outcome (until it came or "
        "expired). Near outcome_timeout_s: outcomes are not arriving.",
    ),
    Panel(
        "Turns waiting for an outcome",
        "short",
        ((f"sum({sel('clawrl_judge_outcome_waiting_turns')})", "waiting"),),
        "Turns held by the judges until their episode's outcome arrives (reading pauses at "
        "episodes.max_waiting per worker).",
    ),
]

AGENTS = [*RUNNER, *SANDBOXES, *OUTCOMES]
