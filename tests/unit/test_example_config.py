"""deploy/clawrl.example.toml stays true: every service loads it, and what it sets arrives."""

from pathlib import Path

import pytest

from clawrl.engine.settings import EngineSettings
from clawrl.gateway.settings import GatewaySettings
from clawrl.judge.settings import JudgeSettings

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "clawrl.example.toml"


@pytest.fixture(autouse=True)
def use_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_CONFIG", str(EXAMPLE))


def test_the_engine_reads_its_sections() -> None:
    settings = EngineSettings()
    assert settings.engine.max_running_requests == 16
    assert settings.sglang.tp_size == 2
    assert settings.model.path == "SmolLM2-135M-Instruct"


def test_the_gateway_reads_its_sections() -> None:
    settings = GatewaySettings()
    assert settings.serving.engine_url == "http://localhost:30010"
    assert settings.sessions.idle_timeout_s == 600
    assert settings.control.hold_timeout_s == 120
    assert settings.redis.turns_stream == "clawrl:turns"


def test_the_judge_reads_its_sections() -> None:
    settings = JudgeSettings()
    assert settings.judging.mode == "rl" and settings.judging.votes == 3
    assert settings.backend.engine_url == "http://localhost:30011"
    assert settings.workers.max_deliveries == 5 and settings.judge_server.metrics_port == 30021


def test_the_gateway_and_the_judge_read_one_feedback_section() -> None:
    for settings in (GatewaySettings(), JudgeSettings()):
        assert settings.feedback.enabled and settings.feedback.combine == "override"
        assert settings.feedback.weight == 0.5 and settings.feedback.ttl_s == 604800
    judge = JudgeSettings()
    assert judge.feedback.judge_key_prefix == judge.workers.key_prefix
    assert judge.feedback.audit_stream == judge.audit.stream


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_CONTROL__HOLD_TIMEOUT_S", "7.5")
    assert GatewaySettings().control.hold_timeout_s == 7.5


def test_the_trainer_reads_its_sections() -> None:
    from clawrl.trainer.settings import TrainerSettings

    settings = TrainerSettings()
    assert settings.rollout.rollout_batch_size == 16
    assert settings.advantage.estimator == "grpo"
    assert (settings.ppo.clip_eps, settings.ppo.clip_eps_high, settings.ppo.beta2) == (
        0.2,
        0.28,
        0.98,
    )
    assert settings.checkpoint.keep_versions == 5
    assert settings.lora.enabled is False and settings.lora.rank == 16
    assert settings.train.micro_batch_tokens == 2048
    assert settings.weight_sync.transport == "disk"


def test_the_gateway_and_the_trainer_read_one_tenants_section() -> None:
    from clawrl.trainer.settings import TrainerSettings

    for settings in (GatewaySettings(), TrainerSettings()):
        assert settings.tenants.mode == "shared" and settings.tenants.max_adapters == 8
        assert settings.tenants.min_samples_per_step == 4 and settings.tenants.allow == []
