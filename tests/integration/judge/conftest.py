"""Judge fixtures: an async client of the session's real Redis; no clawrl.toml is read."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()
