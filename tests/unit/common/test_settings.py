"""Settings precedence: keyword > environment > clawrl.toml > defaults; unknown sections ignored."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from clawrl.common.settings import ClawrlSettings, ModelSettings, RedisSettings


class DemoSettings(ClawrlSettings):
    model: ModelSettings = ModelSettings()
    redis: RedisSettings = RedisSettings()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "clawrl.toml"
    monkeypatch.setenv("CLAWRL_CONFIG", str(path))
    for key in ("CLAWRL_MODEL__PATH", "CLAWRL_REDIS__URL", "CLAWRL_LOGGING__LEVEL"):
        monkeypatch.delenv(key, raising=False)
    return path


def test_defaults_without_a_file(config: Path) -> None:
    settings = DemoSettings()
    assert settings.model.path == "SmolLM2-135M-Instruct"
    assert settings.redis.turns_stream == "clawrl:turns"
    assert settings.logging.format == "text"


def test_toml_sections_are_read_and_unknown_ones_ignored(config: Path) -> None:
    config.write_text(
        '[model]\npath = "/models/policy"\n\n[redis]\nurl = "redis://r:6379/1"\n\n'
        "[ppo]\nclip_eps = 0.2\n"
    )
    settings = DemoSettings()
    assert settings.model.path == "/models/policy"
    assert settings.redis.url == "redis://r:6379/1"


def test_environment_overrides_toml(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config.write_text('[model]\npath = "/from/toml"\ncontext_length = 4096\n')
    monkeypatch.setenv("CLAWRL_MODEL__PATH", "/from/env")
    settings = DemoSettings()
    assert settings.model.path == "/from/env"
    assert settings.model.context_length == 4096  # the rest of the section still comes from TOML


def test_keyword_overrides_environment(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_LOGGING__LEVEL", "DEBUG")
    assert DemoSettings(logging={"level": "WARNING"}).logging.level == "WARNING"


def test_invalid_values_fail_at_start(config: Path) -> None:
    config.write_text("[model]\ncontext_length = -5\n")
    with pytest.raises(ValidationError, match="context_length"):
        DemoSettings()


def test_a_misspelt_key_is_an_error(config: Path) -> None:
    config.write_text('[model]\npth = "/models/policy"\n')
    with pytest.raises(ValidationError, match="pth"):
        DemoSettings()


def test_overrides_are_validated_and_skip_unset_flags(config: Path) -> None:
    config.write_text('[model]\npath = "/from/toml"\n')
    settings = DemoSettings().with_overrides({"model": {"path": None, "context_length": 4096}})
    assert (settings.model.path, settings.model.context_length) == ("/from/toml", 4096)
    with pytest.raises(ValidationError, match="context_length"):
        DemoSettings().with_overrides({"model": {"context_length": 0}})
