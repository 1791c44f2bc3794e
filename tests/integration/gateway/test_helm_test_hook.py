"""The chart's `helm test` hook (templates/tests/gateway-turn.yaml) run for real: its script, as
rendered, against a real gateway with API keys, the CPU engine and Redis. It passes when the
gateway answers and the turn lands on the turns stream, and fails on a key the gateway refuses.
The turn is a probe (issue 30): recorded as a main turn is, marked `probe`, which the judge masks
(tests/unit/judge/test_judge_masks.py), so `helm test` trains nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.common.shards import Shards
from tests.helm.conftest import render

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hook() -> dict:
    """The hook pod's container, rendered with API keys (the script reads them from a file)."""
    (pod,) = [o for o in render(sets=("gateway.apiKeys={sk-test-1}",)) if o["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    return container


def run_hook(container: dict, gateway, keys_file: Path) -> subprocess.CompletedProcess:
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"GATEWAY_URL": gateway.url, "MODEL": "smollm2-tiny", "API_KEYS_FILE": str(keys_file),
            "TURNS_STREAM": gateway.stream, "CLAWRL_REDIS__URL": gateway.redis_url}  # fmt: skip
    assert container["command"] == ["python", "-c"]
    return subprocess.run([sys.executable, "-c", container["args"][0]], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip


def test_the_hook_sees_the_gateway_answer_and_record_the_turn(hook, secured, tmp_path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("\nsk-test-2\nsk-test-1\n")  # the first key of the Secret's file is used
    result = run_hook(hook, secured, keys)
    assert result.returncode == 0, result.stdout + result.stderr
    turn = result.stdout.split("turn recorded on ", 1)[1].split(": ", 1)[1].strip()
    session = turn.split(":")[0]
    assert session.startswith("helm-test-")
    (recorded,) = secured.turns(session)
    assert recorded.session_id == session and recorded.probe
    assert recorded.response_ids and recorded.prompt_ids  # recorded in full, as a main turn


def test_the_hook_fails_when_the_gateway_refuses_it(hook, secured, tmp_path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("sk-wrong\n")
    result = run_hook(hook, secured, keys)
    assert result.returncode != 0
    assert "401" in result.stderr


def test_the_hook_finds_the_turn_on_its_sessions_shard(gateways, tmp_path) -> None:
    """With redis.streamShards the chart gives the hook the shard count the services get, and
    the hook reads its session's shard of the turns stream (`<stream>:{<tag>}`)."""
    sharded = gateways.ready(gateways.start("sharded", CLAWRL_REDIS__STREAM_SHARDS="3"))
    (pod,) = [o for o in render(sets=("redis.streamShards=3",)) if o["kind"] == "Pod"]
    (container,) = pod["spec"]["containers"]
    result = run_hook(container, sharded, tmp_path / "no-keys")  # keys off: nothing to read
    assert result.returncode == 0, result.stdout + result.stderr
    where, turn = result.stdout.split("turn recorded on ", 1)[1].split(": ", 1)
    session = turn.strip().split(":")[0]
    shards = Shards(3)
    assert where == shards.name(sharded.stream, shards.of(session)) != sharded.stream
