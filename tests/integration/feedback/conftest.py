"""Feedback fixtures: a real `clawrl-gateway` with two API keys (two callers) in front of the CPU
engine (smollm2-tiny), on the session's real Redis, with its own key prefixes and two stream
shards (so a turn's keys, and the judge's markers and audit stream, are named per shard as on a
Redis Cluster); judges run in the test's process on the gateway's turn streams."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from redis.asyncio import Redis

from clawrl.common.records import session_of
from clawrl.common.shards import Shards
from tests.conftest import VENV_BIN, ChildProcess, free_port, wait_until
from tests.integration.gateway.helpers import GatewayHandle

TINY = "smollm2-tiny"
ALICE, BOB = "sk-alice", "sk-bob"
SHARDS = Shards(2)


def in_shard(base: str, turn_id: str) -> str:
    """The name of `base` (a stream or key prefix) in the shard of the turn's session."""
    return SHARDS.name(base, SHARDS.of(session_of(turn_id)))


@dataclass(frozen=True)
class Names:
    """The Redis names the gateway and the judge that publishes its samples share."""

    gateway_prefix: str
    turns: str
    feedback_prefix: str
    judge_prefix: str
    audit: str


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")


@pytest.fixture(scope="module")
def names() -> Names:
    tag = f"fb{uuid.uuid4().hex[:6]}"
    return Names(f"{tag}:gw", f"{tag}:turns", f"{tag}:feedback", f"{tag}:judge", f"{tag}:audit")


@pytest.fixture(scope="module")
def gateway(log_dir, redis_url, engine_factory, names: Names) -> Iterator[GatewayHandle]:
    engine = engine_factory(TINY)
    port, grpc_port = free_port(), free_port()
    env = {
        "CLAWRL_CONFIG": "/nonexistent/clawrl.toml",
        "CLAWRL_MODEL__PATH": TINY,
        "CLAWRL_SERVING__API_KEYS": f'["{ALICE}", "{BOB}"]',
        "CLAWRL_SESSIONS__KEY_PREFIX": names.gateway_prefix,
        "CLAWRL_SESSIONS__SPOOL_DIR": str(log_dir / f"spool-{names.gateway_prefix}"),
        "CLAWRL_REDIS__TURNS_STREAM": names.turns,
        "CLAWRL_REDIS__STREAM_SHARDS": str(SHARDS.count),
        "CLAWRL_CONTROL__SERVED_KEY": f"{names.gateway_prefix}:serving",
        "CLAWRL_FEEDBACK__KEY_PREFIX": names.feedback_prefix,
        "CLAWRL_FEEDBACK__JUDGE_KEY_PREFIX": names.judge_prefix,
        "CLAWRL_FEEDBACK__AUDIT_STREAM": names.audit,
    }
    argv = [str(VENV_BIN / "clawrl-gateway"), "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port), "--engine-url", engine,
            "--redis-url", redis_url]  # fmt: skip
    child = ChildProcess("gateway-feedback", argv, log_dir, env=env)
    handle = GatewayHandle("feedback", f"http://127.0.0.1:{port}", grpc_port, names.turns,
                           redis_url, child)  # fmt: skip
    try:
        wait_until(
            lambda: httpx.get(f"{handle.url}/healthz", timeout=1).status_code == 200,
            300,
            child.name,
            child.proc,
        )
    except Exception:
        print(child.log_tail(), file=sys.stderr)
        child.stop()
        raise
    yield handle
    child.stop()


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()
