"""The sync job's settings: what the launcher was given (flags included) reaches the job it
starts; inconsistent settings fail at start-up with a clear message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from clawrl.trainer.weight_sync.launcher import settings_env
from clawrl.trainer.weight_sync.main import parse_args, settings_from
from clawrl.trainer.weight_sync.settings import WeightSyncSettings


def test_the_launchers_settings_reach_the_job_through_its_environment(monkeypatch):
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    monkeypatch.setenv("CLAWRL_GATEWAYS__TOKEN", "s3cret")
    given = settings_from(parse_args([
        "--gateways", "10.0.0.1:30001,10.0.0.2:30001", "--engines", "http://e1:30010",
        "--redis-url", "redis://r:6379/1", "--lease-s", "4", "watch",
    ]))  # fmt: skip
    monkeypatch.delenv("CLAWRL_GATEWAYS__TOKEN")
    for key, value in settings_env(given).items():
        monkeypatch.setenv(key, value)
    job = WeightSyncSettings()
    assert job.gateways.addresses == ["10.0.0.1:30001", "10.0.0.2:30001"]
    assert job.engines.urls == ["http://e1:30010"] and job.redis.url == "redis://r:6379/1"
    assert job.gateways.lease_s == 4 and job.gateways.token.get_secret_value() == "s3cret"
    assert job.sync == given.sync and job.model == given.model


def test_a_lock_shorter_than_the_lease_is_refused(monkeypatch):
    monkeypatch.setenv("CLAWRL_CONFIG", "/nonexistent/clawrl.toml")
    with pytest.raises(ValidationError, match="lock_ttl_s"):
        WeightSyncSettings(gateways={"lease_s": 30}, sync={"lock_ttl_s": 10})
