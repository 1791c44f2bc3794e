"""The trainer's settings: the skeleton's names reach the pure functions' configs, the
environment overrides, and a misspelt key or an impossible value fails at start-up."""

import pytest
from pydantic import ValidationError

from clawrl.trainer.settings import TrainerSettings


def test_skeleton_names_reach_the_loss_and_advantage_configs(monkeypatch) -> None:
    monkeypatch.setenv("CLAWRL_PPO__CLIP_EPS_HIGH", "0.3")
    monkeypatch.setenv("CLAWRL_ADVANTAGE__ESTIMATOR", "combine")
    settings = TrainerSettings(ppo={"clip_eps": 0.1, "dual_clip_c": 3.0}, combine={"w_opd": 0.5})
    loss = settings.ppo.loss_config()
    assert (loss.eps_clip, loss.eps_clip_high, loss.dual_clip_c) == (0.1, 0.3, 3.0)
    assert (loss.kl_coef, loss.entropy_coef, loss.aggregation) == (0.0, 0.0, "token-mean")
    advantage = settings.advantage_config()
    assert (advantage.estimator, advantage.w_rl, advantage.w_opd) == ("combine", 1.0, 0.5)
    monkeypatch.setenv("CLAWRL_ADVANTAGE__NORMALIZE_GROUPS", "true")
    monkeypatch.setenv("CLAWRL_ADVANTAGE__GROUP_BY", "batch")
    advantage = TrainerSettings().advantage_config()
    assert (advantage.normalize_groups, advantage.group_by) == (True, "batch")


def test_stale_samples_are_corrected_by_default() -> None:
    loss = TrainerSettings().ppo.loss_config()
    assert (loss.off_policy_correction, loss.tis_cap) == ("tis", 2.0)
    off = TrainerSettings(ppo={"off_policy_correction": "none"}).ppo.loss_config()
    assert off.off_policy_correction == "none"
    with pytest.raises(ValidationError, match="tis_cap"):
        TrainerSettings(ppo={"tis_cap": 0.5})  # a cap below 1 would shrink on-policy tokens


def test_bad_values_fail_at_start() -> None:
    with pytest.raises(ValidationError, match="clip_epsilon"):
        TrainerSettings(ppo={"clip_epsilon": 0.2})  # misspelt
    with pytest.raises(ValidationError, match="estimator"):
        TrainerSettings(advantage={"estimator": "gae"})
    with pytest.raises(ValidationError, match="group_by"):
        TrainerSettings(advantage={"group_by": "prompt"})
    with pytest.raises(ValidationError, match="dual_clip_c"):
        TrainerSettings(ppo={"dual_clip_c": 0.5})  # must be > 1
    with pytest.raises(ValidationError, match="rollout_batch_size"):
        TrainerSettings(rollout={"rollout_batch_size": 0})


def test_weight_transport_nccl_needs_megatron_and_the_sync_targets(monkeypatch) -> None:
    assert TrainerSettings().weight_sync.transport == "disk"
    with pytest.raises(ValidationError, match=r"set train\.backend=megatron"):
        TrainerSettings(weight_sync={"transport": "nccl"})
    megatron = {"train": {"backend": "megatron"}, "weight_sync": {"transport": "nccl"}}
    with pytest.raises(ValidationError, match="at least one URL"):
        TrainerSettings(**megatron, engines={"urls": []})
    with pytest.raises(ValidationError, match="at least one address"):
        TrainerSettings(**megatron, gateways={"addresses": []})
    with pytest.raises(ValidationError, match="lock_ttl_s"):
        TrainerSettings(**megatron, gateways={"lease_s": 120})
    # The weight-sync job's own sections and names reach the in-process sync.
    monkeypatch.setenv("CLAWRL_ENGINES__URLS", '["http://e0:30010", "http://e1:30010"]')
    monkeypatch.setenv("CLAWRL_WEIGHT_SYNC__ENGINE_TP", "2")
    settings = TrainerSettings(**megatron, gateways={"addresses": ["g0:30001"]})
    job = settings.sync_job_settings()
    assert job.engines.urls == ["http://e0:30010", "http://e1:30010"]
    assert job.gateways.addresses == ["g0:30001"]
    assert job.redis.versions_stream == settings.redis.versions_stream
    assert settings.weight_sync.engine_tp == 2
