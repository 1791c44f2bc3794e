"""Two tenants learn apart, end to end: `make run`'s stack in per-tenant mode (gateway, engines,
judge, trainer, weight sync; tiny model, LoRA) with two API keys, driven through the gateway with
the `openai` client. Each key is a tenant; each trains and is served an adapter of its own.

- Serving: every turn of tenant A is served by the shared policy's initial weights (before A has
  a version) or by one of A's own adapters (`tenant-<A>-vN`, as the engine reported it), never by
  B's; and both tenants are served versions of their own, so the routing was exercised.
- Training: the judge rewards alpha's turns +1 and beta's -1 (tests/e2e/tenant_reward.py), so a
  step's mean reward is +-1 exactly when its samples are one tenant's. Every step the trainer
  logged for alpha's adapter has reward +1 and every step of beta's -1: no step of one tenant's
  adapter held a sample of the other's.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from openai import OpenAI

from clawrl.common.records import Sample, Turn, decode_entry
from clawrl.common.tenants import key_tenant
from tests.conftest import REPO, wait_until
from tests.e2e.local_stack import MODEL, local_stack
from tests.e2e.tenant_reward import ALPHA_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = (ALPHA_KEY, "tenant-beta")
TENANTS = tuple(key_tenant(key) for key in KEYS)
# Versions of its own each tenant must be served before the traffic stops: two, so a switch
# from one of its versions to the next happened while the other tenant was being served too.
VERSIONS = 2
SAMPLES_PER_STEP = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[dict[str, int], Path]]:
    run_dir: Path = tmp_path_factory.mktemp("tenants")
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "CLAWRL_LOGGING__FORMAT": "json",  # the trainer's step lines, parsed below
    }
    args = ("--tenants", "per_tenant", "--tenant-batch", str(SAMPLES_PER_STEP),
            *(arg for key in KEYS for arg in ("--api-key", key)),
            "--reward-fn", "tests.e2e.tenant_reward:alpha_pleases", "--baseline", "none",
            "--lora-rank", "8", "--sync-interval", "1", "--context-length", "0",
            "--status-interval", "5")  # fmt: skip
    with local_stack(run_dir, ("sync-metrics", "/metrics"), *args, env=env,
                     ready_timeout_s=600, stop_timeout_s=120) as ports:  # fmt: skip
        yield ports, run_dir


def own_version(turn: Turn, tenant: str) -> int:
    """The version of `tenant`'s adapter that served the turn; 0 for the initial weights."""
    if turn.weight_version == "default":
        return 0
    prefix = f"tenant-{tenant}-v"
    assert turn.weight_version.startswith(prefix), (tenant, turn.weight_version, turn.turn_id)
    return int(turn.weight_version.removeprefix(prefix))


class Tenant(threading.Thread):
    """One API key asking one-turn sessions until stopped."""

    def __init__(self, port: int, key: str, stop: threading.Event) -> None:
        super().__init__()
        self.client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        self.stop = stop
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Tell me something."}],
                    max_tokens=8,
                    extra_headers={"X-Session-Id": uuid.uuid4().hex, "X-Session-Done": "true"},
                )
            except Exception as exc:  # kept and asserted on
                self.failures.append(repr(exc))
                time.sleep(0.5)


def recorded(r: redis.Redis, stream: str, kind) -> list:
    return [decode_entry(fields, kind) for _, fields in r.xrange(stream)]


def newest_served(turns: list[Turn]) -> dict[str, int]:
    """Each tenant's newest own version that served one of its turns."""
    newest = dict.fromkeys(TENANTS, 0)
    for turn in turns:
        newest[turn.tenant] = max(newest[turn.tenant], own_version(turn, turn.tenant))
    return newest


@pytest.fixture(scope="module")
def traffic(stack) -> tuple[dict[str, int], Path]:
    """Both tenants talk until each was served VERSIONS versions of its own adapter."""
    ports, run_dir = stack
    r = redis.Redis(port=ports["redis"])
    stop = threading.Event()
    users = [Tenant(ports["gateway"], key, stop) for key in KEYS]
    started = time.monotonic()
    for user in users:
        user.start()
    try:
        wait_until(
            lambda: min(newest_served(recorded(r, "clawrl:turns", Turn)).values()) >= VERSIONS,
            420,
            f"both tenants served v{VERSIONS} of their own adapters",
        )
    finally:
        stop.set()
        for user in users:
            user.join(timeout=60)
    print(f"two tenants at v{VERSIONS} after {time.monotonic() - started:.0f}s")
    assert [u.failures for u in users] == [[], []]
    return ports, run_dir


def test_a_tenants_requests_are_served_by_its_own_adapter_only(traffic) -> None:
    ports, _ = traffic
    r = redis.Redis(port=ports["redis"])
    turns = recorded(r, "clawrl:turns", Turn)
    assert Counter(t.tenant for t in turns).keys() == set(TENANTS)
    # own_version asserts each turn's weights are the initial ones or its own tenant's adapter.
    served = Counter((t.tenant, own_version(t, t.tenant)) for t in turns)
    # Each tenant was served the initial weights, then versions of its own (syncs collapse to
    # the newest announced, so not every version is served).
    assert all(served[(tenant, 0)] for tenant in TENANTS), served
    assert min(newest_served(turns).values()) >= VERSIONS, served
    for turn in turns:  # the version the gateway routed to is the one the engine reported
        assert turn.policy_version == own_version(turn, turn.tenant), turn
    # The judge's samples keep the turn's tenant and weights.
    wait_until(lambda: r.xlen("clawrl:samples") >= len(turns), 60, "the judge's samples")
    for sample in recorded(r, "clawrl:samples", Sample):
        assert sample.tenant in TENANTS
        expected = f"tenant-{sample.tenant}-v{sample.policy_version}"
        assert sample.weight_version == (expected if sample.policy_version else "default")


def trainer_steps(log: Path) -> list[tuple[str, float, int]]:
    """(adapter, mean reward, samples) of every step in the trainer's JSON log."""
    steps = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("logger", "").startswith("clawrl.trainer") and "adapter" in entry:
            samples = int(entry["msg"].split(": ", 1)[1].split()[0])
            reward = float(entry["msg"].split("reward ", 1)[1].split(",")[0])
            steps.append((entry["adapter"], reward, samples))
    return steps


def test_a_tenants_turns_never_train_the_other_tenants_adapter(traffic) -> None:
    _, run_dir = traffic
    steps = trainer_steps(run_dir / "logs" / "trainer.log")
    by_adapter = Counter(adapter for adapter, _, _ in steps)
    # Each tenant's adapter stepped at least once per version served; no shared-policy steps.
    assert by_adapter.keys() == set(TENANTS), steps
    assert min(by_adapter.values()) >= VERSIONS, steps
    alpha, beta = TENANTS
    expected = {alpha: 1.0, beta: -1.0}
    mixed = [s for s in steps if s[1] != expected[s[0]] or s[2] != SAMPLES_PER_STEP]
    assert not mixed, steps
