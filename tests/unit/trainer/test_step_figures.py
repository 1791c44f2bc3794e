"""A step's figures on a collated batch: the behaviour ratio of stale samples and their
staleness, as the log line and the clawrl_trainer_* gauges report them."""

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

from clawrl.common.records import Sample
from clawrl.trainer.metrics import TrainerMetrics
from clawrl.trainer.samples import collate
from clawrl.trainer.training import batch_figures


def sample(index: int, policy_version: int, rollout_logp: float) -> Sample:
    return Sample(
        sample_id=f"s{index}:0", session_id=f"s{index}", prompt_ids=[1, 2], response_ids=[3],
        old_logprobs=[rollout_logp], loss_mask=[1.0], reward=1.0, policy_version=policy_version,
    )  # fmt: skip


def test_stale_samples_show_in_the_step_figures_and_gauges() -> None:
    # Trainer at version 5; current weights give each token probability 0.3. Sample 0 was drawn
    # at version 5 with the same probability (on-policy), sample 1 at version 2 with 0.1.
    batch = collate([sample(0, 5, math.log(0.3)), sample(1, 2, math.log(0.1))])
    old_logp = torch.full((2, 1), math.log(0.3))
    figures = batch_figures(batch, old_logp, torch.ones(2, 1), policy_version=5, tis_cap=2.0)
    assert figures["ratio_mean"] == pytest.approx((1.0 + 3.0) / 2, 1e-5)
    assert figures["ratio_max"] == pytest.approx(3.0, 1e-5)
    assert figures["tis_clip_frac"] == 0.5
    assert (figures["staleness_mean"], figures["staleness_max"]) == (1.5, 3.0)
    metrics = TrainerMetrics(CollectorRegistry())
    metrics.record_step(figures)
    read = metrics.registry.get_sample_value
    assert read("clawrl_trainer_ratio_max") == pytest.approx(3.0, 1e-5)
    assert read("clawrl_trainer_staleness_max") == 3.0
    assert read("clawrl_trainer_tis_clip_frac") == 0.5
