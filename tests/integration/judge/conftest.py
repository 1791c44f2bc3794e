"""Judge fixtures: an async client of the session's real Redis, the tiny model's renderer and
engine; no clawrl.toml is read."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from clawrl.common.chat import ChatRenderer
from clawrl.common.settings import ModelSettings


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    """The tiny model's chat template and tokenizer (the policy's in these tests)."""
    return ChatRenderer.from_settings(ModelSettings(path="smollm2-tiny"))


@pytest.fixture(scope="module")
def tiny_engine(engine_factory) -> str:
    """A CPU engine serving the tiny model (started once per session)."""
    return engine_factory("smollm2-tiny")
