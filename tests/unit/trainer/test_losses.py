"""Advantages and losses against values worked out by hand, and the direction of their gradients."""

import math

import pytest
import torch

from clawrl.trainer.losses import (
    ADVANTAGE_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    AdvantageConfig,
    AdvantageInputs,
    LossConfig,
    TokenTerms,
    aggregate,
    compute_advantages,
    entropy_from_logits,
    group_normalized,
    kl_penalty,
    micro_batch_weight,
    off_policy_figures,
    policy_objective,
    ppo_clip_loss,
    token_logprobs,
    topk_reverse_kl,
    truncated_is_weights,
)

T = torch.tensor


def inputs(**overrides) -> AdvantageInputs:
    base = dict(
        reward=T([2.0, -1.0]),
        old_logp=T([[-1.5, -1.0, 0.0], [-0.5, -0.5, 0.0]]),
        teacher_logp=T([[-1.0, -2.0, 0.0], [float("nan"), 3.0, 0.0]]),
        has_teacher=T([True, False]),
        mask=T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]),
    )
    return AdvantageInputs(**{**base, **overrides})


# --- advantages ----------------------------------------------------------------------------------


def test_grpo_broadcasts_the_reward_to_trained_tokens() -> None:
    adv = compute_advantages(inputs(), AdvantageConfig(estimator="grpo"))
    assert adv.tolist() == [[2.0, 2.0, 0.0], [-1.0, -1.0, 0.0]]


def test_grpo_group_normalisation() -> None:
    # group 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5); group 1 alone keeps its -1
    # (a session's lone turn keeps its verdict); group 2, all alike, has no relative signal.
    out = group_normalized(T([1.0, 0.0, -1.0, 1.0, 1.0]), T([0, 0, 1, 2, 2]))
    half = 0.5 / math.sqrt(0.5)
    assert out.tolist() == pytest.approx([half, -half, -1.0, 0.0, 0.0], 1e-5)
    cfg = AdvantageConfig(estimator="grpo", normalize_groups=True)
    adv = compute_advantages(inputs(group_index=T([7, 7])), cfg)
    assert adv[0, 0].item() == pytest.approx(1.5 / math.sqrt(4.5), 1e-5)  # rewards 2, -1
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(inputs(), cfg)


def test_grpo_by_batch_uses_the_batch_mean_as_baseline() -> None:
    """One sample per prompt (live traffic): each session is its own group, so normalising by
    session leaves every reward as it is (groups of one keep theirs); by batch, the one right
    answer among wrong ones stands out."""
    rewards = dict(reward=T([-1.0, -1.0, 1.0, -1.0]), old_logp=torch.zeros(4, 2),
                   teacher_logp=torch.zeros(4, 2), has_teacher=T([False] * 4),
                   mask=torch.ones(4, 2), group_index=T([0, 1, 2, 3]))  # fmt: skip
    by_session = AdvantageConfig(estimator="grpo", normalize_groups=True)
    by_session_adv = compute_advantages(AdvantageInputs(**rewards), by_session)
    assert by_session_adv[:, 0].tolist() == [-1.0, -1.0, 1.0, -1.0]
    by_batch = AdvantageConfig(estimator="grpo", normalize_groups=True, group_by="batch")
    adv = compute_advantages(AdvantageInputs(**{**rewards, "group_index": None}), by_batch)
    # Rewards -1, -1, 1, -1: mean -0.5, unbiased std 1.
    assert adv[:, 0].tolist() == pytest.approx([-0.5, -0.5, 1.5, -0.5], rel=1e-5)
    # A batch of equal rewards carries no signal: no sample is pushed either way.
    same = {**rewards, "reward": T([-1.0] * 4), "group_index": None}
    assert compute_advantages(AdvantageInputs(**same), by_batch).abs().max() == 0


def test_opd_is_teacher_minus_old_and_exactly_zero_without_teacher() -> None:
    adv = compute_advantages(inputs(), AdvantageConfig(estimator="on_policy_distillation"))
    assert adv[0].tolist() == [0.5, -1.0, 0.0]
    assert adv[1].tolist() == [0.0, 0.0, 0.0]  # the nan and the 3.0 never leak in
    assert not torch.isnan(adv).any()


def test_opd_clip_bounds_each_tokens_gap() -> None:
    """Gaps 0.5 and -1.0 (see above) clipped at 0.75: 0.5 and -0.75; no teacher still 0."""
    cfg = AdvantageConfig(estimator="on_policy_distillation", opd_clip=0.75)
    adv = compute_advantages(inputs(), cfg)
    assert adv.tolist() == [[0.5, -0.75, 0.0], [0.0, 0.0, 0.0]]
    both = compute_advantages(inputs(), AdvantageConfig(estimator="combine", opd_clip=0.75))
    assert both[0].tolist() == [2.5, 1.25, 0.0]


def test_combine_weighs_both_terms_and_drops_distillation_without_teacher() -> None:
    cfg = AdvantageConfig(estimator="combine", w_rl=1.0, w_opd=0.5)
    adv = compute_advantages(inputs(), cfg)
    assert adv[0].tolist() == [2.0 + 0.25, 2.0 - 0.5, 0.0]
    assert adv[1].tolist() == [-1.0, -1.0, 0.0]  # reward only, exactly


def test_unknown_estimator_is_a_clear_error() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "on_policy_distillation", "combine", "step_wise"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        compute_advantages(inputs(), AdvantageConfig(estimator="gae"))


# --- aggregation ---------------------------------------------------------------------------------


def test_token_mean_and_seq_mean() -> None:
    loss = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 5.0, 5.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(loss, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean"])
def test_micro_batch_weights_reproduce_the_whole_batch(mode) -> None:
    torch.manual_seed(0)
    loss = torch.randn(5, 4)
    mask = (torch.rand(5, 4) > 0.3).float()
    mask[2] = 0.0
    whole = aggregate(loss, mask, mode)
    parts = [[0, 1], [2, 3], [4]]
    summed = sum(
        micro_batch_weight(mask[p], mask, mode) * aggregate(loss[p], mask[p], mode) for p in parts
    )
    assert summed.item() == pytest.approx(whole.item(), 1e-6)


# --- PPO clip ------------------------------------------------------------------------------------


def test_ppo_clip_values() -> None:
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, +1, -1 (eps 0.2 / 0.28)
    ratio = T([[1.5, 1.5, 0.5, 0.5]])
    adv = T([[1.0, -1.0, 1.0, -1.0]])
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    loss, metrics = ppo_clip_loss(ratio.log(), old, adv, mask, LossConfig())
    assert loss[0].tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8], 1e-6)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


def test_dual_clip_bounds_negative_advantages() -> None:
    ratio = T([[5.0, 5.0]])
    adv = T([[-1.0, 1.0]])
    loss, metrics = ppo_clip_loss(
        ratio.log(), torch.zeros(1, 2), adv, torch.ones(1, 2), LossConfig(dual_clip_c=3.0)
    )
    assert loss[0].tolist() == pytest.approx([3.0, -1.28], 1e-6)
    assert metrics["dual_clip_frac"].item() == pytest.approx(0.5)


# --- KL, entropy, distillation, TIS --------------------------------------------------------------


def test_kl_estimators() -> None:
    logp, ref = T([-1.0]), T([-2.0])  # log r = 1
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1.0), 1e-6)
    assert kl_penalty(T([-1.0]), T([-1.0]), "k3").item() == 0.0
    # far-off tokens: clamped and finite both ways
    far = kl_penalty(T([0.0, -100.0]), T([-100.0, 0.0]), "k3")
    assert far.tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_entropy_and_token_logprobs() -> None:
    assert entropy_from_logits(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    logits = T([[[0.0, math.log(3.0)]]])
    assert token_logprobs(logits, T([[1]])).item() == pytest.approx(math.log(0.75), 1e-6)


def test_topk_reverse_kl_with_tail_bin() -> None:
    # K = 1: student puts 0.5 on the teacher's top token, teacher 0.8; tails 0.5 and 0.2.
    rkl = topk_reverse_kl(T([[[math.log(0.5)]]]), T([[[math.log(0.8)]]]))
    expected = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert rkl.item() == pytest.approx(expected, 1e-5)
    same = T([[[math.log(0.3), math.log(0.2)]]])
    assert topk_reverse_kl(same, same).item() == pytest.approx(0.0, abs=1e-7)


def test_truncated_is_weights() -> None:
    weights = truncated_is_weights(T([-1.0, -2.0]), T([-2.0, -1.0]), cap=2.0)
    assert weights.tolist() == pytest.approx([2.0, math.exp(-1.0)], 1e-6)


# --- the objective -------------------------------------------------------------------------------


def test_objective_requires_what_its_terms_need() -> None:
    terms = TokenTerms(logp=torch.zeros(1, 2), old_logp=torch.zeros(1, 2),
                       advantages=torch.ones(1, 2), mask=torch.ones(1, 2))  # fmt: skip
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_objective(terms, LossConfig())  # TIS is the default
    with pytest.raises(ValueError, match="ref_logp"):
        policy_objective(terms, LossConfig(kl_coef=0.1, off_policy_correction="none"))
    with pytest.raises(ValueError, match="top-K"):
        policy_objective(terms, LossConfig(distill_coef=1.0, off_policy_correction="none"))
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_objective(terms, LossConfig(policy_loss="gspo"))
    with pytest.raises(ValueError, match="unknown off-policy correction 'mis'"):
        policy_objective(terms, LossConfig(off_policy_correction="mis"))
    assert set(POLICY_LOSSES) == {"ppo", "reinforce"}
    assert set(OFF_POLICY_CORRECTIONS) == {"tis", "none"}


def test_objective_sums_its_terms() -> None:
    # ratio 1, A = 1: pg = -1; k1 KL = 0.5; entropy 2; distill: as in the tail-bin test.
    mask = torch.ones(1, 1)
    terms = TokenTerms(
        logp=T([[-1.0]]), old_logp=T([[-1.0]]), advantages=T([[1.0]]), mask=mask,
        entropy=T([[2.0]]), ref_logp=T([[-1.5]]), rollout_logp=T([[-1.0]]),
        student_topk_logp=T([[[math.log(0.5)]]]), teacher_topk_logp=T([[[math.log(0.8)]]]),
        has_teacher=T([True]),
    )  # fmt: skip
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, distill_coef=2.0, tis_cap=2)
    loss, metrics = policy_objective(terms, cfg)
    rkl = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert loss.item() == pytest.approx(-1.0 + 0.05 - 0.02 + 2.0 * rkl, 1e-5)
    assert metrics["kl_ref"].item() == pytest.approx(0.5)
    assert metrics["tis_weight_mean"].item() == pytest.approx(1.0)


def test_distillation_is_zero_for_samples_without_teacher() -> None:
    terms = TokenTerms(
        logp=torch.zeros(1, 1), old_logp=torch.zeros(1, 1), advantages=torch.zeros(1, 1),
        mask=torch.ones(1, 1), student_topk_logp=T([[[math.log(0.5)]]]),
        teacher_topk_logp=T([[[float("nan")]]]), has_teacher=T([False]),
    )  # fmt: skip
    loss, metrics = policy_objective(
        terms, LossConfig(distill_coef=1.0, off_policy_correction="none")
    )
    assert metrics["distill_rkl"].item() == 0.0
    assert loss.item() == 0.0


# --- gradient direction --------------------------------------------------------------------------


def step_logp(advantage: float, old_ratio: float = 1.0, cfg: LossConfig | None = None):
    """One SGD step on a single token's logits; returns (logp before, logp after, grad norm).
    `old_ratio` sets pi / pi_old at the start (pi_old = pi / old_ratio)."""
    logits = torch.tensor([[[0.3, -0.2, 0.1, 0.0]]], requires_grad=True)
    ids = T([[2]])
    logp = token_logprobs(logits, ids)
    old = (logp - math.log(old_ratio)).detach()
    terms = TokenTerms(logp=logp, old_logp=old, advantages=T([[advantage]]), mask=torch.ones(1, 1))
    loss, _ = policy_objective(terms, cfg or LossConfig(off_policy_correction="none"))
    loss.backward()
    with torch.no_grad():
        after = token_logprobs(logits - 0.5 * logits.grad, ids)
    return logp.item(), after.item(), logits.grad.norm().item()


def test_positive_advantage_raises_and_negative_lowers_log_probs() -> None:
    before, after, _ = step_logp(+1.0)
    assert after > before
    before, after, _ = step_logp(-1.0)
    assert after < before


def test_clipping_stops_the_update_past_the_bound() -> None:
    # already 1.3 > 1 + 0.28 times more likely with a positive advantage: no further push
    assert step_logp(+1.0, old_ratio=1.3)[2] == 0.0
    # already 0.7 < 1 - 0.2 with a negative advantage: no further push down
    assert step_logp(-1.0, old_ratio=0.7)[2] == 0.0
    # inside the range the gradient is alive
    assert step_logp(+1.0, old_ratio=1.1)[2] > 0.0
    # dual clip: a negative advantage on a token far above its old probability stops too
    dual = LossConfig(dual_clip_c=3.0, off_policy_correction="none")
    assert step_logp(-1.0, old_ratio=4.0, cfg=dual)[2] == 0.0
    assert step_logp(-1.0, old_ratio=4.0)[2] > 0.0


# --- off-policy correction -----------------------------------------------------------------------


def stale_batch() -> TokenTerms:
    """Two samples, one token each, advantage 1, at the step's start (logp == old_logp).
    Sample 0 is on-policy (rollout_logp == old_logp). Sample 1 is stale: the engine that drew it
    gave its token probability 0.2, the current weights 0.3, so pi_old / pi_b = 1.5."""
    old = T([[math.log(0.5)], [math.log(0.3)]])
    logp = old.clone().requires_grad_(True)
    return TokenTerms(
        logp=logp, old_logp=old, advantages=T([[1.0], [1.0]]), mask=torch.ones(2, 1),
        rollout_logp=T([[math.log(0.5)], [math.log(0.2)]]),
    )  # fmt: skip


def test_a_stale_sample_is_weighted_by_its_behaviour_ratio_and_an_on_policy_one_is_not() -> None:
    terms = stale_batch()
    loss, metrics = policy_objective(terms, LossConfig())  # the default: TIS, cap 2
    # token-mean over 2 tokens of -A * ratio(1) * w: w = 1 (on-policy) and 1.5 (stale)
    assert loss.item() == pytest.approx(-(1.0 + 1.5) / 2, 1e-6)
    loss.backward()
    # d loss / d logp = -A * w / 2 per token: the stale token's gradient is 1.5 times larger
    assert terms.logp.grad[:, 0].tolist() == pytest.approx([-0.5, -0.75], 1e-6)
    assert metrics["tis_weight_mean"].item() == pytest.approx(1.25, 1e-6)
    # PPO's own ratio is 1 at the step's start: its clip does not act
    assert metrics["clip_frac"].item() == 0.0
    assert metrics["ppo_ratio_mean"].item() == pytest.approx(1.0)


def test_the_behaviour_weight_is_truncated_at_the_cap() -> None:
    terms = stale_batch()
    # cap 1.2: the stale token's weight 1.5 is truncated to 1.2
    loss, _ = policy_objective(terms, LossConfig(tis_cap=1.2))
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2, 1e-6)


def test_without_correction_a_stale_sample_trains_as_if_on_policy() -> None:
    terms = stale_batch()
    loss, metrics = policy_objective(terms, LossConfig(off_policy_correction="none"))
    assert loss.item() == pytest.approx(-1.0, 1e-6)
    assert metrics["tis_weight_mean"].item() == 1.0


def test_off_policy_figures() -> None:
    # ratios 1 (on-policy), 1.5 and 2.5 (stale), one masked token with ratio 10
    old = T([[math.log(0.5), math.log(0.3)], [math.log(0.5), math.log(0.5)]])
    rollout = T([[math.log(0.5), math.log(0.2)], [math.log(0.2), math.log(0.05)]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    figures = off_policy_figures(old, rollout, mask, cap=2.0)
    assert figures["ratio_mean"] == pytest.approx((1.0 + 1.5 + 2.5) / 3, 1e-5)
    assert figures["ratio_max"] == pytest.approx(2.5, 1e-5)
    assert figures["tis_clip_frac"] == pytest.approx(1 / 3)
