"""`make run RUN_ARGS="--engine sglang"`: the whole loop with real SGLang as the policy and judge
engines (started by `clawrl-engine --backend sglang`), full fine-tuning. Turns through the
gateway are recorded with SGLang's weight_version, the trainer makes a version, the weight-sync
job loads it into SGLang from disk, and the next turn is served by it."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from openai import OpenAI

from clawrl.common.records import Sample, decode_entry
from tests.conftest import REPO, wait_until
from tests.e2e.local_stack import MODEL, local_stack
from tests.e2e.test_learning import newest_synced, trainer_step
from tests.sglang.conftest import sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.timeout(900)]


def ask(client: OpenAI) -> None:
    """One finished one-turn session: one sample for the judge."""
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me something."}],
        max_tokens=8,
        extra_headers={"X-Session-Id": uuid.uuid4().hex, "X-Session-Done": "true"},
    )


def ask_until(client: OpenAI, done, timeout_s: float, what: str) -> None:
    """Turns one after another until `done()` (the judge masks neutral rewards, so how many
    turns a trainer step needs varies)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s"
        ask(client)


def samples(r: redis.Redis) -> list[Sample]:
    return [decode_entry(f, Sample) for _, f in r.xrange("clawrl:samples")]


def test_the_loop_turns_on_sglang(tmp_path: Path) -> None:
    sglang_python()  # fails with the way to make SGLang's venv when there is none
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ("--engine", "sglang", "--reward-fn", "tests.e2e.learning_reward:preferred_half",
            "--batch-size", "2", "--sync-interval", "1", "--torch-threads", "1")  # fmt: skip
    with local_stack(tmp_path, ("sync-metrics", "/metrics"), *args, env=env,
                     ready_timeout_s=600, stop_timeout_s=120) as ports:  # fmt: skip
        log = (tmp_path / "stack.log").read_text()
        assert "--engine sglang: full fine-tuning" in log
        engine = f"http://127.0.0.1:{ports['policy']}"
        # SGLang itself serves the policy: its own /get_server_info names its server args.
        info = httpx.get(f"{engine}/get_server_info", timeout=10).json()
        assert info["device"] == "cpu" and info["attention_backend"] == "torch_native"
        r = redis.Redis(port=ports["redis"])
        client = OpenAI(base_url=f"http://127.0.0.1:{ports['gateway']}/v1", api_key="local")

        ask_until(client, lambda: trainer_step(ports["trainer-metrics"]) >= 1, 300, "step")
        wait_until(lambda: newest_synced(r) >= 1, 300, "the sync of v1")
        served = httpx.get(f"{engine}/get_model_info", timeout=10).json()
        assert served["weight_version"] == "1"
        assert Path(served["model_path"]).is_relative_to(tmp_path / "checkpoints")

        ask_until(client, lambda: any(s.policy_version for s in samples(r)), 120, "v1 sample")
        recorded = samples(r)
    first = recorded[0]
    assert (first.policy_version, first.weight_version) == (0, "default")
    newer = next(s for s in recorded if s.policy_version)
    assert newer.weight_version == str(newer.policy_version)
    for sample in (first, newer):
        assert len(sample.old_logprobs) == len(sample.response_ids) > 0
