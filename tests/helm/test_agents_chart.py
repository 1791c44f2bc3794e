"""Track 2's operational values, rendered by the real `helm`: the judge's `[episodes]` settings
(judge.episodes), deploy/values-terminal.yaml as `make run RUN_ARGS="--track terminal"` runs
it (the outcome alone, rl samples, grpo against the batch's mean), the sandbox service's bearer
token reaching the agent runner (environments.tokenSecret, and the renders that must fail without
it), and the runner's /metrics scraped for the agents dashboard."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from clawrl.judge.settings import JudgeSettings
from clawrl.trainer.settings import TrainerSettings
from tests.conftest import REPO
from tests.helm.conftest import pod_specs, render
from tests.helm.test_chart import container_env
from tests.helm.test_tenants_chart import failure

TERMINAL = REPO / "deploy" / "values-terminal.yaml"
RUNNER_ON = ("environments.enabled=true", "environments.sandbox.enabled=true",
             "environments.sandbox.warmPool.enabled=true", "agentRunner.enabled=true")  # fmt: skip
JUDGE = ("Deployment", "clawrl-judge", "judge")
TRAINER_HEAD = ("RayJob", "clawrl-trainer/head", "ray-head")
TOKEN_VAR = "CLAWRL_ENVIRONMENTS_SERVER__TOKEN"


@functools.cache
def rendered(*sets: str, terminal: bool = False) -> list[dict]:
    return render(*((TERMINAL,) if terminal else ()), sets=sets)


def container(objects: list[dict], kind: str, name: str, container_name: str) -> dict:
    for obj in objects:
        for where, spec in pod_specs(obj):
            if where == f"{kind}/{name}":
                (found,) = [c for c in spec["containers"] if c["name"] == container_name]
                return found
    raise AssertionError(f"no {kind}/{name}/{container_name}")


def by_kind(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


# --- judge.episodes ---------------------------------------------------------------------------


def test_the_judge_gets_its_episode_settings_from_values(settings_of, tmp_path: Path) -> None:
    default = settings_of(JudgeSettings, container_env(rendered(), *JUDGE)).episodes
    assert (default.enabled, default.prm_step_coef, default.outcome_timeout_s) == (True, 1.0, 600.0)
    # A values file: `--set` would pass 0.25 as a string, which the schema refuses.
    values = tmp_path / "episodes.yaml"
    values.write_text(
        "judge:\n  episodes: {enabled: false, prmStepCoef: 0.25, outcomeTimeoutS: 90.5}\n"
    )
    env = container_env(render(values), *JUDGE)
    assert env["CLAWRL_EPISODES__PRM_STEP_COEF"] == "0.25"
    settings = settings_of(JudgeSettings, env)
    assert settings.episodes.enabled is False and not settings.waits_for_outcomes
    assert (settings.episodes.prm_step_coef, settings.episodes.outcome_timeout_s) == (0.25, 90.5)


def test_the_judges_own_settings_override_the_episode_values(settings_of) -> None:
    """judge.settings stays the last word, as for every other section."""
    env = container_env(rendered("judge.settings.episodes.prm_step_coef=2"), *JUDGE)
    assert settings_of(JudgeSettings, env).episodes.prm_step_coef == 2.0


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("judge.episodes.prmStepCoef=-0.5",), "/judge/episodes/prmStepCoef"),
        (("judge.episodes.outcomeTimeoutS=0",), "/judge/episodes/outcomeTimeoutS"),
        (("judge.episodes.enabled=maybe",), "/judge/episodes/enabled"),
        (("judge.episodes.prmStepcoef=1",), "/judge/episodes"),  # misspelt: not silently unused
        (("environments.tokenSecret=Not_A_Name",), "/environments/tokenSecret"),
        (("agentRunner.metricsPort=0",), "/agentRunner/metricsPort"),
    ],
)
def test_the_schema_refuses_bad_episode_and_runner_values(
    sets: tuple[str, ...], message: str
) -> None:
    assert message in failure(*sets)


def test_the_terminal_values_run_the_loop_as_make_run_does(settings_of) -> None:
    """deploy/values-terminal.yaml: the outcome alone (prm_step_coef 0: the small PRM judges
    at chance), rl samples, and grpo against the batch's mean (deploy/local/terminal.py's
    default --terminal-advantage batch)."""
    objects = rendered(terminal=True)
    judge = settings_of(JudgeSettings, container_env(objects, *JUDGE))
    assert judge.judging.mode == "rl" and judge.waits_for_outcomes
    assert judge.episodes.prm_step_coef == 0.0
    trainer = settings_of(TrainerSettings, container_env(objects, *TRAINER_HEAD))
    assert trainer.advantage.estimator == "grpo"
    assert trainer.advantage.normalize_groups and trainer.advantage.group_by == "batch"
    # The base chart trains combine: the terminal file is what changes it.
    base = container_env(rendered(), *TRAINER_HEAD)
    assert settings_of(TrainerSettings, base).advantage.estimator == "combine"


# --- the sandbox service's token ---------------------------------------------------------------


def test_the_token_secret_reaches_the_service_and_the_runner() -> None:
    objects = rendered(*RUNNER_ON, "environments.tokenSecret=sandbox-token")
    refs = {}
    for where in (("Deployment", "clawrl-environments", "environments"),
                  ("Job", "clawrl-agent-runner", "agent-runner")):  # fmt: skip
        (var,) = [e for e in container(objects, *where)["env"] if e["name"] == TOKEN_VAR]
        refs[where[0]] = var["valueFrom"]["secretKeyRef"]
    assert refs == {kind: {"name": "sandbox-token", "key": "token"} for kind in refs}
    # Without a Secret neither has the variable: the API is open to the release's pods.
    for where in (("Deployment", "clawrl-environments", "environments"),
                  ("Job", "clawrl-agent-runner", "agent-runner")):  # fmt: skip
        names = [e["name"] for e in container(rendered(*RUNNER_ON), *where)["env"]]
        assert TOKEN_VAR not in names


SERVICE_TOKEN = "environments.settings.environments_server.token=abc"
SERVICE_TOKEN_FILE = "environments.settings.environments_server.token_file=/run/token"
SERVICE_TOKEN_ENV = (f"environments.env[0].name={TOKEN_VAR}", "environments.env[0].value=abc")


@pytest.mark.parametrize(
    "service", [(SERVICE_TOKEN,), (SERVICE_TOKEN_FILE,), SERVICE_TOKEN_ENV], ids=str
)
def test_a_service_token_the_runner_lacks_does_not_render(service: tuple[str, ...]) -> None:
    message = failure(*RUNNER_ON, *service)
    assert "requires a bearer token" in message and "environments.tokenSecret" in message
    # The service alone (no runner) may require one: someone else calls it.
    render(sets=(*RUNNER_ON[:3], *service))


@pytest.mark.parametrize(
    "runner",
    [
        ("agentRunner.extraArgs={--environments-token,abc}",),
        ("agentRunner.extraArgs={--environments-token=abc}",),
        ("agentRunner.settings.environments_server.token=abc",),
        (f"agentRunner.env[0].name={TOKEN_VAR}", "agentRunner.env[0].value=abc"),
    ],
    ids=str,
)
def test_a_runner_given_the_token_its_own_way_renders(runner: tuple[str, ...]) -> None:
    objects = render(sets=(*RUNNER_ON, SERVICE_TOKEN, *runner))
    by_kind(objects, "Job", "clawrl-agent-runner")


def test_a_token_set_twice_does_not_render() -> None:
    message = failure(*RUNNER_ON, "environments.tokenSecret=t", SERVICE_TOKEN)
    assert "both in environments.tokenSecret and in environments.settings" in message


# --- the runner's metrics ----------------------------------------------------------------------


def test_the_runner_serves_metrics_that_its_service_monitor_scrapes() -> None:
    objects = rendered(*RUNNER_ON, "serviceMonitor.enabled=true", "agentRunner.metricsPort=9100")
    runner = container(objects, "Job", "clawrl-agent-runner", "agent-runner")
    args = runner["args"]
    assert args[args.index("--metrics-port") + 1] == "9100"
    assert runner["ports"] == [{"name": "metrics", "containerPort": 9100}]
    service = by_kind(objects, "Service", "clawrl-agent-runner")["spec"]
    job = by_kind(objects, "Job", "clawrl-agent-runner")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["selector"].items())
    assert service["ports"] == [{"name": "metrics", "port": 9100, "targetPort": "metrics"}]
    monitor = by_kind(objects, "ServiceMonitor", "clawrl-agent-runner")["spec"]
    assert all(
        by_kind(objects, "Service", "clawrl-agent-runner")["metadata"]["labels"][k] == v
        for k, v in monitor["selector"]["matchLabels"].items()
    )
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [("metrics", "/metrics")]
    # Only the scrapers may connect, and only to the metrics port.
    policy = by_kind(objects, "NetworkPolicy", "clawrl-agent-runner")["spec"]
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": 9100}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    closed = rendered(*RUNNER_ON, "networkPolicy.scrapeFrom=null")
    assert by_kind(closed, "NetworkPolicy", "clawrl-agent-runner")["spec"]["ingress"] == []


def test_the_runner_writes_only_to_its_tmp_volume() -> None:
    """The root filesystem is read-only: the runner's default output (run/agent under the
    image's /app) would fail at start; its files go to the /tmp emptyDir."""
    runner = container(rendered(*RUNNER_ON), "Job", "clawrl-agent-runner", "agent-runner")
    assert runner["securityContext"]["readOnlyRootFilesystem"] is True
    args = runner["args"]
    written = [args[args.index(flag) + 1] for flag in ("--out", "--eval-dir")]
    mounts = [m["mountPath"] for m in runner["volumeMounts"]]
    assert mounts == ["/tmp"]
    assert all(path.startswith("/tmp/") for path in written), written
