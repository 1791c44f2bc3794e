"""The dashboards against live data: the local stack with Prometheus (`make run`'s), real
traffic through the gateway and the loop turning on it (judged, trained, synced), then every
panel's PromQL evaluated through Prometheus's HTTP API. Each query must parse; the serving and
engine queries must return data while those services are busy, and every learning panel while
the trainer steps and new versions are synced (a panel that shows nothing for a busy service is
a bug). The chart's alerts are evaluated on the same Prometheus: silent while the loop turns,
and the trainer's firing once the trainer is stopped (SIGSTOP) while turns keep coming."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import yaml
from openai import OpenAI

from tests.conftest import REPO, wait_until
from tests.e2e.local_stack import local_stack
from tests.e2e.test_learning import trainer_step
from tests.helm.conftest import CHART, CLUSTER_VALUES, helm
from tests.helm.dashboards import annotation_queries, dashboards, queries, rows

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

BUSY = ("serving", "engines")  # the services the local stack runs and this test loads
LEARNING = "learning"  # every panel (one of its queries at least) shows the loop turning
PER_TENANT = "Tenants"  # the learning row that stays empty in shared mode (the stack's)
STEPS = 2  # trainer steps (each one a version and a sync) the traffic below makes
# The dashboards' variables as the local stack's scrape labels answer them
# (deploy/prometheus/prometheus.yml: release `clawrl` in namespace `local`), every pod.
VARIABLES = {"$namespace": "local", "$release": "clawrl", "$pod": ".*", "$tenant": ".*"}
STALL_WINDOW = "20s"  # ClawrlTrainerStalled's window, short enough for this test
# What stopping the trainer must fire (every other alert stays silent).
TRAINER_STOPPED = {"ClawrlTargetDown", "ClawrlTrainerStalled"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, int]]:
    run_dir = tmp_path_factory.mktemp("stack")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # A reward on (nearly) every turn (the e2e learning test's): the 24 turns below make 2
    # steps of 4 and more (a reward of exactly 0, half the tokens preferred, is not trained).
    # combine with the judge engine as teacher: every service and engine has work to show.
    args = ("--method", "combine", "--teacher", "judge", "--batch-size", "4",
            "--reward-fn", "tests.e2e.learning_reward:preferred_half")  # fmt: skip
    with local_stack(
        run_dir, ("prometheus", "/-/ready"), *args, env=env, ready_timeout_s=420
    ) as ports:
        yield ports


def instant(port: int, expr: str) -> dict:
    """Prometheus's answer to an instant query (status, data or error)."""
    reply = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=10)
    return reply.json()


def scrapes(port: int, job: str) -> float:
    """How many times Prometheus has scraped a job's target so far (0 before the first)."""
    result = instant(port, f'count_over_time(up{{job="{job}"}}[10m])')["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def traffic(gateway: int, sessions: int = 8) -> None:
    """Multi-turn sessions, streamed and not, closed and left open, as an agent would send."""
    client = OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="local", max_retries=0)

    def session(i: int) -> None:
        messages = [{"role": "user", "content": f"Count to {i}."}]
        for turn in range(3):
            last = turn == 2
            headers = {"X-Session-Id": f"dash-{i}", **({"X-Session-Done": "true"} if last else {})}
            if i % 2:
                chunks = client.chat.completions.create(
                    model="smollm2-tiny", messages=messages, max_tokens=8, stream=True,
                    extra_headers=headers,
                )  # fmt: skip
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                reply = client.chat.completions.create(
                    model="smollm2-tiny", messages=messages, max_tokens=8, extra_headers=headers
                )
                text = reply.choices[0].message.content
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Again, {turn}."}]  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(session, range(sessions)))


def total(prom: int, expr: str) -> float:
    result = instant(prom, expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def synced(prom: int) -> float:
    return total(prom, 'sum(clawrl_weight_sync_syncs_total{outcome="ok"})')


def scoped(expr: str, window: str) -> str:
    """A dashboard query as Grafana sends it for the local stack."""
    expr = expr.replace("$__rate_interval", window)
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def chart_alerts() -> dict[str, str]:
    """The chart's alerts (name -> PromQL) rendered for release `clawrl` in namespace `local`."""
    result = helm("template", "clawrl", str(CHART), "--namespace", "local",
                  "-f", str(CLUSTER_VALUES), "--set", "prometheusRule.enabled=true",
                  "--set", f"prometheusRule.trainerStalledWindow={STALL_WINDOW}",
                  "--show-only", "templates/prometheusrule.yaml")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rule = yaml.safe_load(result.stdout)
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def firing(prom: int, alerts: dict[str, str]) -> set[str]:
    """The alerts whose expression returns series now (their `for` aside)."""
    fired = set()
    for name, expr in alerts.items():
        answer = instant(prom, expr)
        assert answer["status"] == "success", f"{name}: {answer.get('error')}: {expr}"
        if answer["data"]["result"]:
            fired.add(name)
    return fired


def listener(port: int) -> psutil.Process:
    """The process listening on a local TCP port."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise LookupError(f"nothing listens on port {port}")


def test_every_panel_query_evaluates_and_busy_panels_have_data(stack: dict[str, int]) -> None:
    prom = stack["prometheus"]
    jobs = ("gateway", "policy-engine", "judge-engine", "trainer", "weight-sync")
    # A scrape before the traffic and one after it, so rates over the window are not empty.
    wait_until(lambda: all(scrapes(prom, job) >= 1 for job in jobs), 30, "first scrapes")
    before = scrapes(prom, "gateway")
    started = time.monotonic()
    traffic(stack["gateway"])
    wait_until(lambda: scrapes(prom, "gateway") >= before + 2, 30, "scrapes after traffic")
    # The loop turns on that traffic: steps, and a sync Prometheus has seen.
    wait_until(lambda: trainer_step(stack["trainer-metrics"]) >= STEPS, 300, f"{STEPS} steps")
    wait_until(lambda: synced(prom) >= 1, 300, "a sync scraped")
    trained = scrapes(prom, "trainer")
    wait_until(lambda: scrapes(prom, "trainer") >= trained + 1, 30, "a scrape after the steps")
    time.sleep(1)  # the other jobs' scrapes of the same round
    # Grafana's $__rate_interval, as wide as the traffic took (a loaded host may take minutes).
    window = f"{int(time.monotonic() - started) + 30}s"

    failures = []
    for name, board in dashboards().items():
        panels: dict[str, bool] = {}  # learning: panel title -> has data
        shared_only = {title for title, row in rows(board).items() if row == PER_TENANT}
        for title, expr in queries(board):
            answer = instant(prom, scoped(expr, window))
            if answer["status"] != "success":
                failures.append(f"{name}/{title}: {answer.get('error')}: {expr}")
                continue
            values = [float(series["value"][1]) for series in answer["data"]["result"]]
            has_data = any(math.isfinite(v) for v in values)
            if name == LEARNING and title not in shared_only:
                # A panel's other query may be empty by design (no sample dropped, no pause in
                # a LoRA sync); the panel as a whole must show something.
                panels[title] = panels.get(title, False) or has_data
            elif name in BUSY and not has_data:
                failures.append(f"{name}/{title}: no data ({values}): {expr}")
        failures += [f"{name}/{title}: no data in any query" for title, ok in panels.items()
                     if not ok]  # fmt: skip
        # The sync above is marked on every dashboard.
        for title, expr in annotation_queries(board):
            widened = scoped(expr, window).replace("1m", window)  # [1m], offset 1m
            answer = instant(prom, widened)
            if answer["status"] != "success":
                failures.append(f"{name}/annotation {title}: {answer.get('error')}: {expr}")
            elif title == "Weight syncs" and not answer["data"]["result"]:
                failures.append(f"{name}/annotation {title}: no sync marked: {expr}")
    assert not failures, "\n".join(failures)

    # The alerts: silent while the loop turns (a stall may rightly show for a moment: samples
    # short of a batch wait for the next turns). Their `for` is not applied here, so one scrape
    # that timed out on a loaded host shows as a target down until the next: wait that out.
    alerts = chart_alerts()
    seen_running: list[set[str]] = []
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not seen_running.append(firing(prom, alerts) - {"ClawrlTrainerStalled"})
                   and not seen_running[-1], 30, "the alerts silent")  # fmt: skip
    assert not seen_running[-1], seen_running
    # The trainer stops (SIGSTOP: its /metrics stops answering) while turns keep coming: the
    # judges publish samples nobody trains on.
    trainer = listener(stack["trainer-metrics"])
    published = total(prom, "sum(clawrl_judge_samples_total)")
    trainer.suspend()
    try:
        down = 'up{job="trainer"} == 0'
        wait_until(lambda: bool(instant(prom, down)["data"]["result"]), 30, "trainer down")
        traffic(stack["gateway"], sessions=2)
        wait_until(lambda: total(prom, "sum(clawrl_judge_samples_total)") > published, 120,
                   "samples published while the trainer is stopped")  # fmt: skip
        seen: list[set[str]] = []  # what fired at each evaluation
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: seen.append(firing(prom, alerts)) or seen[-1] == TRAINER_STOPPED,
                       90, "the trainer's alerts")  # fmt: skip
        assert seen[-1] == TRAINER_STOPPED
    finally:
        trainer.resume()
