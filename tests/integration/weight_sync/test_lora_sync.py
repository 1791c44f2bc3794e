"""LoRA weight syncs against two real gateway replicas, a CPU engine serving adapters and real
Redis: no pause at all (the gate never holds a request, none fails), every recorded turn names
the adapter whose log-probs its tokens have, a failed load on one engine switches no gateway,
and an engine that restarts gets the served adapter back from the launcher before it serves
policy traffic (meanwhile the gateway answers 503, never the base model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from clawrl.common.records import Turn, decode_entry
from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until
from tests.integration.engine.lora_adapters import ALL_PROJECTIONS, make_adapter

from .conftest import MODEL, start_replicas, tiny_dir
from .test_weight_sync_job import Load, results, run_sync

pytestmark = pytest.mark.integration

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", *ALL_PROJECTIONS)


def tiny_adapter(target: Path, seed: int, rank: int = 4) -> Path:
    return make_adapter(tiny_dir(), target, rank=rank, alpha=2 * rank, seed=seed, scale=0.5)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "policy-v1": tiny_adapter(root / "v1", seed=1),
        "policy-v2": tiny_adapter(root / "v2", seed=2),
        "policy-v3": tiny_adapter(root / "v3", seed=3),
        "rank-16": tiny_adapter(root / "r16", seed=4, rank=16),
    }


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    """This module's served key and turns stream (the gateways read them at start)."""
    tag = uuid.uuid4().hex[:8]
    return {"served": f"test:{tag}:serving", "turns": f"test:{tag}:turns"}


@pytest.fixture(scope="module")
def lora_engine(engine_factory) -> str:
    return engine_factory(MODEL, *LORA_FLAGS, "--weight-version", "0", "--random-seed", "0")


@pytest.fixture(scope="module")
def lora_replicas(lora_engine, redis_url, log_dir, keys):
    env = {
        "CLAWRL_CONTROL__SERVED_KEY": keys["served"],
        "CLAWRL_REDIS__TURNS_STREAM": keys["turns"],
    }
    started = start_replicas(("lora-a", "lora-b"), lora_engine, redis_url, log_dir, env)
    yield started
    for replica in started:
        replica.child.stop()


@pytest.fixture
def lora_env(sync_env, keys) -> dict[str, str]:
    return {**sync_env, "CLAWRL_SYNC__SERVED_KEY": keys["served"]}


def loaded(engine: str) -> dict[str, str]:
    """The adapters an engine holds, as SGLang lists them on /v1/models."""
    cards = httpx.get(f"{engine}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["root"] for card in cards if card.get("parent") is not None}


def teacher_logprobs(engine: str, turn: Turn, adapter: str | None) -> list[float]:
    """The log-probs `adapter` (None: the base model) gives the turn's response tokens."""
    body = {
        "input_ids": [*turn.prompt_ids, *turn.response_ids],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": len(turn.prompt_ids),
    }
    if adapter:
        body["lora_path"] = adapter
    reply = httpx.post(f"{engine}/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in entries] == list(turn.response_ids)
    return [entry[0] for entry in entries]


class MainTurns(Load):
    """Clients sending main turns (each a session of its own, done with it) to every replica
    until stopped; status, latency and fingerprint of each kept."""

    def _loop(self, replica):
        while not self.stop.is_set():
            started = time.monotonic()
            reply = httpx.post(
                f"{replica.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                      "temperature": 1.0},
                headers={"X-Session-Id": f"lora-{uuid.uuid4().hex[:10]}",
                         "X-Session-Done": "true"},
                timeout=60,
            )  # fmt: skip
            body = reply.json()
            fingerprint = body.get("system_fingerprint", str(body))
            self.answers.append((reply.status_code, time.monotonic() - started, fingerprint))


def recorded_turns(redis_url: str, stream: str) -> list[Turn]:
    client = redis.Redis.from_url(redis_url)
    return [decode_entry(fields, Turn) for _, fields in client.xrange(stream)]


def sync_adapter(env, replicas, engines, version: int, path: Path):
    return run_sync(env, replicas, engines, "run", "--version", str(version), "--path", str(path),
                    "--adapter", f"policy-v{version}")  # fmt: skip


def test_lora_syncs_pause_nothing_and_each_turn_records_its_adapter(
    lora_replicas, lora_engine, adapters, lora_env, keys, redis_url
):
    for replica in lora_replicas:
        assert replica.chat("warm up").status_code == 200
    with MainTurns(lora_replicas) as load:
        load.wait_answer("clawrl-policy-v0")  # base-model turns first
        first = sync_adapter(lora_env, lora_replicas, [lora_engine], 1, adapters["policy-v1"])
        load.wait_answer("clawrl-policy-v1")
        second = sync_adapter(lora_env, lora_replicas, [lora_engine], 2, adapters["policy-v2"])
        load.wait_answer("clawrl-policy-v2")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert "(adapter policy-v2): ok; no pause" in second.stderr
    # No pause at all: nobody paused a gateway, no request was held, none failed.
    for replica in lora_replicas:
        assert replica.metric("clawrl_gateway_pauses_total") == 0
        assert replica.metric("clawrl_gateway_hold_duration_seconds_count") == 0
        status = replica.status()
        assert (status.paused, status.policy_version, status.adapter) == (False, 2, "policy-v2")
    assert load.answers and all(code == 200 for code, _, _ in load.answers)
    fingerprints = [fingerprint for _, _, fingerprint in load.answers]
    assert {"clawrl-policy-v0", "clawrl-policy-v1", "clawrl-policy-v2"} <= set(fingerprints)
    assert fingerprints[-1] == "clawrl-policy-v2"
    one, two = results(redis_url, lora_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert (one.outcome, one.adapter, one.pause_s, one.unloaded) == ("ok", "policy-v1", 0.0, 0)
    # The second sync unloaded policy-v1 once no request used it: the engine holds v2 alone.
    assert (two.outcome, two.adapter, two.pause_s, two.unloaded) == ("ok", "policy-v2", 0.0, 1)
    assert 0 < two.load_s and 0 < two.switch_s < 1
    assert loaded(lora_engine) == {"policy-v2": str(adapters["policy-v2"])}
    served = redis.Redis.from_url(redis_url).hgetall(keys["served"])
    assert served[b"adapter"] == b"policy-v2" and served[b"version"] == b"2"

    # Every turn names the weights of all its tokens, and their log-probs are that adapter's.
    turns = recorded_turns(redis_url, keys["turns"])
    by_adapter: dict[str, list[Turn]] = {}
    for turn in turns:
        by_adapter.setdefault(turn.weight_version, []).append(turn)
    assert {"0", "policy-v1", "policy-v2"} <= set(by_adapter), set(by_adapter)
    client = httpx.Client(base_url=lora_engine, timeout=60)
    reply = client.post(
        "/load_lora_adapter",
        json={"lora_name": "policy-v1", "lora_path": str(adapters["policy-v1"])},
    )
    assert reply.status_code == 200, reply.text  # fmt: skip
    try:
        for adapter, group in by_adapter.items():
            version = int(adapter.removeprefix("policy-v")) if adapter != "0" else 0
            wrong = "policy-v1" if adapter != "policy-v1" else "policy-v2"
            for turn in group[:3]:
                assert (turn.policy_version, turn.admitted_policy_version) == (version, version)
                own = teacher_logprobs(lora_engine, turn, adapter if version else None)
                assert list(turn.response_logprobs) == pytest.approx(own, abs=2e-3)
                other = teacher_logprobs(lora_engine, turn, wrong)
                assert max(abs(a - b) for a, b in zip(own, other, strict=True)) > 0.05
    finally:
        client.post("/unload_lora_adapter", json={"lora_name": "policy-v1"})
        client.close()


def test_a_failed_load_on_one_engine_switches_no_gateway(
    lora_replicas, lora_engine, engine_factory, adapters, lora_env, redis_url
):
    # A second replica whose rank limit refuses the adapter (as SGLang refuses one above
    # --max-lora-rank): the first loads it, the second does not.
    small = engine_factory(MODEL, "--enable-lora", "--max-lora-rank", "8",
                           "--lora-target-modules", *ALL_PROJECTIONS)  # fmt: skip
    before = [(r.status().policy_version, r.status().adapter) for r in lora_replicas]
    held_before = loaded(lora_engine)
    with MainTurns(lora_replicas, clients_per_replica=1) as load:
        done = sync_adapter(lora_env, lora_replicas, [lora_engine, small], 16, adapters["rank-16"])
    assert done.returncode == 1, done.stderr
    [result] = results(redis_url, lora_env["CLAWRL_SYNC__RESULTS_STREAM"])
    assert result.outcome == "failed" and small in result.reason
    assert "unloaded it from 1 engine(s)" in result.reason
    # Every gateway still routes to the old version, the engine that loaded it unloaded it.
    assert [(r.status().policy_version, r.status().adapter) for r in lora_replicas] == before
    assert loaded(lora_engine) == held_before and "policy-v16" not in loaded(small)
    assert load.answers and all(code == 200 for code, _, _ in load.answers)
    assert {fingerprint for _, _, fingerprint in load.answers} == {f"clawrl-policy-v{before[0][0]}"}


def start_engine(port: int, log_dir: Path, name: str) -> ChildProcess:
    child = ChildProcess(
        name,
        [str(VENV_BIN / "clawrl-engine"), "--host", "127.0.0.1", "--port", str(port),
         "--model", MODEL, *LORA_FLAGS],
        log_dir,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 300, name,
               child.proc)  # fmt: skip
    return child


def test_a_restarted_engine_gets_the_served_adapter_back_before_serving_policy_traffic(
    adapters, sync_env, redis_url, log_dir
):
    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    child = start_engine(port, log_dir, f"engine-restarted-{port}")
    env = {"CLAWRL_CONTROL__SERVED_KEY": sync_env["CLAWRL_SYNC__SERVED_KEY"]}
    [replica] = start_replicas(("lora-restart",), engine, redis_url, log_dir, env)
    launcher = None
    try:
        done = sync_adapter(sync_env, [replica], [engine], 3, adapters["policy-v3"])
        assert done.returncode == 0, done.stderr
        assert replica.chat("hi").json()["system_fingerprint"] == "clawrl-policy-v3"
        child.stop()
        child = start_engine(port, log_dir, f"engine-restarted-{port}-again")
        assert loaded(engine) == {}
        # Before the adapter is back: 503 with Retry-After, never a base-model reply. (A
        # pooled connection to the dead engine may fail first: engine_unavailable, also 503.)
        refused = replica.chat("hi")
        if refused.json()["error"]["code"] == "engine_unavailable":
            refused = replica.chat("hi")
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "adapter_unavailable"
        assert replica.metric('clawrl_gateway_engine_errors_total{kind="adapter_not_loaded"}') == 1
        launcher = subprocess.Popen(
            [sys.executable, "-m", "clawrl.trainer.weight_sync.main", "--gateways",
             replica.control, "--engines", engine, "watch"],
            env={**os.environ, **sync_env, "CLAWRL_LAUNCHER__RECONCILE_INTERVAL_S": "0.5"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_until(lambda: "policy-v3" in loaded(engine), 60, "adapter reloaded", launcher)
        assert loaded(engine) == {"policy-v3": str(adapters["policy-v3"])}
        served = replica.chat("hi")
        assert (
            served.status_code == 200 and served.json()["system_fingerprint"] == "clawrl-policy-v3"
        )
        # The replica that restarts reads the served adapter from Redis.
        replica.child.stop()
        [replica] = start_replicas(("lora-restart-again",), engine, redis_url, log_dir, env)
        status = replica.status()
        assert (status.policy_version, status.adapter) == (3, "policy-v3")
    finally:
        if launcher is not None:
            launcher.terminate()
            _, stderr = launcher.communicate(timeout=30)
            print(stderr[-3000:], file=sys.stderr)
        replica.child.stop()
        child.stop()
    assert (
        f"lacked the served adapter policy-v3 (restarted?): loaded it from {adapters['policy-v3']}"
        in stderr
    )
