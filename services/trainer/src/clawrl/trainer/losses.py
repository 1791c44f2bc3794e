"""Advantage estimators and policy losses: pure functions of tensors, one registry of each.

Shapes: B samples, R response positions (right-padded), K teacher top-K entries. Every per-token
tensor is aligned with the response ids; `mask` [B, R] is 1.0 where a token is trained.

Log-probs and temperature: the engines record the RAW distribution (softmax of the logits,
before temperature and top-p), so every log-prob here (rollout, old, new, reference, teacher) is
of the raw distribution too. The sampling temperature only decided which tokens were drawn; it
does not enter the ratio, the KL or the distillation term. Raising a token's logit raises its
probability under every temperature, so training the raw policy moves the sampling policy the
same way.

A new estimator or policy loss is one function and one line in its registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean"]
KLEstimator = Literal["k1", "k2", "k3"]


# --- aggregation ---------------------------------------------------------------------------------


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """values, mask: [...] (same shape) -> scalar mean over mask, 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(loss: Tensor, mask: Tensor, mode: Aggregation) -> Tensor:
    """loss, mask: [B, R] -> scalar. token-mean: every trained token weighs the same;
    seq-mean: mean over samples (with a trained token) of each sample's token mean."""
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "seq-mean":
        tokens = mask.sum(dim=-1)
        per_seq = (loss * mask).sum(dim=-1) / tokens.clamp(min=1.0)
        has_tokens = (tokens > 0).to(loss.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"unknown aggregation {mode!r} (token-mean, seq-mean)")


def micro_batch_weight(micro_mask: Tensor, batch_mask: Tensor, mode: Aggregation) -> float:
    """micro_mask: [b, R], batch_mask: [B, R] -> the weight of a micro-batch's aggregated loss so
    that the accumulated gradients equal those of the whole batch aggregated at once."""
    if mode == "token-mean":
        return float(micro_mask.sum() / batch_mask.sum().clamp(min=1.0))
    micro_seqs = (micro_mask.sum(dim=-1) > 0).sum()
    return float(micro_seqs / (batch_mask.sum(dim=-1) > 0).sum().clamp(min=1))


# --- advantages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What the estimators read. reward, has_teacher: [B]; old_logp, teacher_logp, mask: [B, R];
    group_index: [B] (samples with the same value form one GRPO group) or None; step_group: [B]
    (samples of the same task and turn index share it: step_wise's buckets) or None."""

    reward: Tensor
    old_logp: Tensor
    teacher_logp: Tensor
    has_teacher: Tensor
    mask: Tensor
    group_index: Tensor | None = None
    step_group: Tensor | None = None


@dataclass(frozen=True)
class AdvantageConfig:
    """estimator: a key of ADVANTAGE_ESTIMATORS; w_rl / w_opd weigh combine's two terms;
    normalize_groups: GRPO group normalisation (off: each turn is its own group); group_by:
    what a group is, the samples of one session ("session", the batch's group_index) or the
    whole batch ("batch": each reward against the batch's mean, the baseline left when every
    prompt is sampled once, as live traffic is); opd_clip: the bound on each token's
    teacher_logp - old_logp (None: unclipped); step_normalize: step_wise's normalisation within
    (task, turn index) buckets (off: each turn's own score)."""

    estimator: str = "grpo"
    w_rl: float = 1.0
    w_opd: float = 1.0
    normalize_groups: bool = False
    group_by: str = "session"
    opd_clip: float | None = None
    step_normalize: bool = True
    eps: float = 1e-6


def group_normalized(reward: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """reward, group_index: [B] -> [B]: (r - group mean) / (group std + eps). A group of one
    sample keeps its reward: live traffic rarely asks a session's prompt twice, and zeroing the
    lone turn of a session would throw its verdict away (AReaL keeps it too)."""
    out = reward.clone()
    for group in torch.unique(group_index):
        members = group_index == group
        values = reward[members]
        if values.numel() > 1:
            out[members] = (values - values.mean()) / (values.std(unbiased=True) + eps)
    return out


def grpo_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    """-> [B, R]: the scalar reward (optionally group-normalised) on every trained token."""
    reward = inputs.reward
    if cfg.normalize_groups:
        if cfg.group_by == "batch":
            groups = torch.zeros_like(reward, dtype=torch.long)
        elif inputs.group_index is None:
            raise ValueError("normalize_groups by session needs a group_index")
        else:
            groups = inputs.group_index
        reward = group_normalized(reward, groups, cfg.eps)
    return reward[:, None] * inputs.mask


def opd_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    """-> [B, R]: teacher_logp - old_logp per token, clipped to +-opd_clip when set (OpenClaw-RL's
    top-K OPD clips it at 2: one token the teacher finds nearly impossible must not outweigh
    the rest of the response), exactly 0 for samples without a teacher."""
    gap = inputs.teacher_logp - inputs.old_logp
    if cfg.opd_clip is not None:
        gap = gap.clamp(-cfg.opd_clip, cfg.opd_clip)
    # where(), not a product: a sample without a teacher may carry garbage (even nan) there.
    return torch.where(inputs.has_teacher[:, None] & (inputs.mask > 0), gap, 0.0) * inputs.mask


def combine_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    """-> [B, R]: w_rl * reward + w_opd * (teacher_logp - old_logp) (OpenClaw-RL's combine)."""
    return cfg.w_rl * grpo_advantages(inputs, cfg) + cfg.w_opd * opd_advantages(inputs, cfg)


CONSTANT_VAR = 1e-12  # a bucket whose variance is at most this is constant (slime's threshold)


def step_normalized(score: Tensor, bucket: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """score, bucket: [B] -> (value [B], kept [B] bool): OpenClaw-RL's step_wise normalisation
    (slime's RolloutManager._post_process_step_wise_rewards, matched exactly): within each
    bucket (there: the same task group and step index) of n > 1 turns, (s - mean) / (std +
    eps) with the population std, sqrt(max(E[s^2] - mean^2, 0)); a bucket of one keeps its raw
    score; a constant bucket (n > 1, variance <= 1e-12) is dropped (kept False: its turns are
    not trained), unless every bucket is constant, when the first bucket met in the batch is
    kept so that a step is never empty. Statistics in float64, as slime's Python floats."""
    values = score.double()
    out = values.clone()
    kept = torch.ones_like(score, dtype=torch.bool)
    buckets = list(dict.fromkeys(bucket.tolist()))  # in order of first appearance
    constant = []
    for key in buckets:
        members = bucket == key
        group = values[members]
        if group.numel() < 2:
            continue
        mean = group.sum() / group.numel()
        var = ((group * group).sum() / group.numel() - mean * mean).clamp(min=0.0)
        if var <= CONSTANT_VAR:
            constant.append(key)
        out[members] = (group - mean) / (var.sqrt() + eps)
    if len(constant) == len(buckets) and buckets:
        constant = constant[1:]
    for key in constant:
        kept[bucket == key] = False
    return (out * kept).to(score.dtype), kept


def step_wise_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    """-> [B, R]: each turn is its own sample, its advantage its own step score (the judge's
    reward: (2 * outcome - 1) + prm_step_coef * step score for an episode's turn), normalised
    within its (task, turn index) bucket when step_normalize (`step_normalized`), on every
    trained token; no further normalisation (OpenClaw-RL's step_wise estimator). A dropped
    bucket's turns get 0 here; the trainer also takes them out of the loss mask."""
    reward = inputs.reward
    if cfg.step_normalize:
        if inputs.step_group is None:
            raise ValueError("step_wise normalisation needs a step_group")
        reward, _ = step_normalized(reward, inputs.step_group, cfg.eps)
    return reward[:, None] * inputs.mask


AdvantageFn = Callable[[AdvantageInputs, AdvantageConfig], Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "on_policy_distillation": opd_advantages,
    "combine": combine_advantages,
    "step_wise": step_wise_advantages,
}


def compute_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Tensor:
    """-> [B, R] advantages from the configured estimator (detached: they are targets)."""
    try:
        estimator = ADVANTAGE_ESTIMATORS[cfg.estimator]
    except KeyError:
        known = ", ".join(ADVANTAGE_ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {cfg.estimator!r} ({known})") from None
    return estimator(inputs, cfg).detach()


# --- log-probs, KL, entropy, distillation --------------------------------------------------------


def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """logits: [..., V], ids: [...] -> [...] float32 log softmax(logits)[id] (temperature 1)."""
    logits = logits.float()
    picked = logits.gather(-1, ids[..., None].long())[..., 0]
    return picked - torch.logsumexp(logits, dim=-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """logp, ref_logp: [B, R] -> [B, R] per-token estimate of KL(policy || reference) from the
    sampled tokens (Schulman, "Approximating KL divergence", 2020): k1 = log r, k2 = (log r)^2/2,
    k3 = exp(-log r) + log r - 1 with log r = logp - ref_logp (clamped: low-variance and finite)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)  # exp() must not overflow for far-off tokens
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2, k3)")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """logits: [..., V] -> [...]: entropy of softmax(logits) in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _log1mexp(log_mass: Tensor, eps: float) -> Tensor:
    """log(1 - exp(log_mass)) for the probability left outside a top-K set, floored at eps."""
    return torch.log((1.0 - log_mass.exp()).clamp(min=eps))


def topk_reverse_kl(student_topk_logp: Tensor, teacher_topk_logp: Tensor, eps: float = 1e-6):
    """student_topk_logp, teacher_topk_logp: [B, R, K] (both at the teacher's top-K ids) ->
    [B, R]: KL(student || teacher) over K + 1 bins, the K teacher tokens plus one tail bin that
    holds each distribution's remaining mass."""
    s_tail = _log1mexp(torch.logsumexp(student_topk_logp, dim=-1), eps)
    t_tail = _log1mexp(torch.logsumexp(teacher_topk_logp, dim=-1), eps)
    s = torch.cat([student_topk_logp, s_tail[..., None]], dim=-1)
    t = torch.cat([teacher_topk_logp, t_tail[..., None]], dim=-1)
    return (s.exp() * (s - t)).sum(dim=-1)


def behaviour_ratio(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """old_logp, rollout_logp: [B, R] -> [B, R] detached pi_old / pi_rollout: how much likelier
    each sampled token is under the trainer's weights than under the engine that sampled it."""
    return (old_logp - rollout_logp).clamp(-20.0, 20.0).exp().detach()


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """old_logp, rollout_logp: [B, R] -> [B, R] detached weights min(pi_old / pi_rollout, cap):
    truncated importance sampling (Yao et al. 2025, see "off-policy correction" below)."""
    return behaviour_ratio(old_logp, rollout_logp).clamp(max=cap)


# --- policy losses -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    """The step's objective. eps_clip/eps_clip_high: PPO's asymmetric clip range; dual_clip_c:
    dual-clip bound (> 1) for negative advantages or None; kl_coef 0 means no reference model;
    distill_coef weighs the top-K reverse KL; off_policy_correction: a key of
    OFF_POLICY_CORRECTIONS (the weight of each token for having been drawn by an older policy);
    tis_cap: its cap C."""

    policy_loss: str = "ppo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    distill_coef: float = 0.0
    off_policy_correction: str = "tis"
    tis_cap: float = 2.0
    aggregation: Aggregation = "token-mean"


def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """logp, old_logp, advantages, mask: [B, R] -> (per-token loss [B, R], metrics).
    PPO clip (Schulman et al. 2017) with the asymmetric range of DAPO (clip-higher), and the
    dual clip of Ye et al. 2020 (arXiv:1912.09729): for A < 0 the loss is at most -c * A."""
    ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipped_out = (clipped > unclipped).float()
    dual = torch.zeros_like(loss)
    if cfg.dual_clip_c is not None:
        bound = -advantages * cfg.dual_clip_c
        dual = ((advantages < 0) & (loss > bound)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    metrics = {
        "clip_frac": masked_mean(clipped_out, mask).detach(),
        "dual_clip_frac": masked_mean(dual, mask).detach(),
        "ppo_ratio_mean": masked_mean(ratio, mask).detach(),
    }
    return loss, metrics


def reinforce_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """logp, old_logp, advantages, mask: [B, R] -> (per-token loss [B, R], metrics): the
    unclipped importance-weighted policy gradient -A * pi / pi_old."""
    ratio = (logp - old_logp).clamp(-20.0, 20.0).exp()
    return -advantages * ratio, {"ppo_ratio_mean": masked_mean(ratio, mask).detach()}


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, dict]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_clip_loss,
    "reinforce": reinforce_loss,
}


# --- off-policy correction -----------------------------------------------------------------------
#
# A sample was drawn by the behaviour policy pi_b (the engine, up to max_staleness versions old:
# its log-probs are `rollout_logp`), while the trainer takes ONE optimizer step per batch from its
# current weights pi_old (`old_logp`, recomputed right before the step). PPO's ratio pi / pi_old
# is therefore 1 at the step and its clip never acts: without a correction a stale sample is
# trained as if pi_old had drawn it. Both published corrections re-weight each token by
# w = pi_old / pi_b:
# - decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298, after Hilton et al. 2021,
#   arXiv:2110.00641): loss = -w * min(r A, clip(r, 1 - eps, 1 + eps) A) with r = pi / pi_old
#   (the "proximal" policy), and tokens whose w exceeds a cap dropped;
# - verl's rollout correction (`RolloutCorrectionConfig.decoupled_token_is`: token-level TIS
#   against a recomputed pi_old; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
#   You Off-Policy RL Training"; Liu et al. 2025, "When Speed Kills Stability"): the same clipped
#   loss times min(w, C), C = 2 by default.
# With one step per batch the two are the same objective except above the cap. We take TIS:
# a token the current policy now likes far more than the sampler did still counts, at weight C,
# instead of vanishing (dropping exactly those tokens biases against where the policy is going),
# and C bounds the variance a very stale sample can add. The same w also absorbs the numeric gap
# between engine and trainer kernels. Temperature never enters w: engines record raw log-probs,
# like the trainer (see the module docstring).


def no_correction(old_logp: Tensor, rollout_logp: Tensor | None, cfg: LossConfig) -> Tensor:
    """-> [B, R] ones: every sample trained as if the trainer's current weights had drawn it."""
    return torch.ones_like(old_logp)


def tis_correction(old_logp: Tensor, rollout_logp: Tensor | None, cfg: LossConfig) -> Tensor:
    """-> [B, R] min(pi_old / pi_b, tis_cap), detached."""
    if rollout_logp is None:
        raise ValueError("off_policy_correction 'tis' needs rollout_logp")
    return truncated_is_weights(old_logp, rollout_logp, cfg.tis_cap)


OffPolicyFn = Callable[[Tensor, Tensor | None, LossConfig], Tensor]
OFF_POLICY_CORRECTIONS: dict[str, OffPolicyFn] = {
    "tis": tis_correction,
    "none": no_correction,
}


def off_policy_figures(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float
) -> dict[str, float]:
    """old_logp, rollout_logp, mask: [B, R] -> the behaviour ratio pi_old / pi_b over trained
    tokens (mean, max) and the fraction of them whose TIS weight the cap truncated."""
    ratio = behaviour_ratio(old_logp, rollout_logp)
    trained = mask > 0
    return {
        "ratio_mean": float(masked_mean(ratio, mask)),
        "ratio_max": float(ratio[trained].max()) if trained.any() else 1.0,
        "tis_clip_frac": float(masked_mean((ratio > cap).float(), mask)),
    }


@dataclass(frozen=True)
class TokenTerms:
    """What a backend computes for one micro-batch, all [B, R] unless noted: logp (with grad),
    old_logp, advantages, mask; optional entropy (with grad), ref_logp, rollout_logp (for TIS);
    student/teacher top-K log-probs [B, R, K] and has_teacher [B] for distillation."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    entropy: Tensor | None = None
    ref_logp: Tensor | None = None
    rollout_logp: Tensor | None = None
    student_topk_logp: Tensor | None = None
    teacher_topk_logp: Tensor | None = None
    has_teacher: Tensor | None = None


def policy_objective(terms: TokenTerms, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """-> (scalar loss to minimise, detached metrics): policy loss x off-policy weights
    + kl_coef * KL - entropy_coef * entropy + distill_coef * top-K reverse KL, each aggregated
    over `mask`."""
    try:
        policy_loss = POLICY_LOSSES[cfg.policy_loss]
    except KeyError:
        known = ", ".join(POLICY_LOSSES)
        raise ValueError(f"unknown policy loss {cfg.policy_loss!r} ({known})") from None
    mask = terms.mask
    try:
        correction = OFF_POLICY_CORRECTIONS[cfg.off_policy_correction]
    except KeyError:
        known = ", ".join(OFF_POLICY_CORRECTIONS)
        raise ValueError(
            f"unknown off-policy correction {cfg.off_policy_correction!r} ({known})"
        ) from None
    pg, metrics = policy_loss(terms.logp, terms.old_logp, terms.advantages, mask, cfg)
    weights = correction(terms.old_logp, terms.rollout_logp, cfg)
    pg = pg * weights
    metrics["tis_weight_mean"] = masked_mean(weights, mask).detach()
    pg_loss = aggregate(pg, mask, cfg.aggregation)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["approx_kl_old"] = masked_mean(terms.old_logp - terms.logp, mask).detach()
    if cfg.kl_coef:
        if terms.ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the frozen reference model)")
        kl = aggregate(
            kl_penalty(terms.logp, terms.ref_logp, cfg.kl_estimator), mask, cfg.aggregation
        )
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = kl.detach()
    if terms.entropy is not None:
        entropy = aggregate(terms.entropy, mask, cfg.aggregation)
        loss = loss - cfg.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    if cfg.distill_coef:
        if terms.student_topk_logp is None or terms.teacher_topk_logp is None:
            raise ValueError("distill_coef > 0 needs student and teacher top-K log-probs")
        has_teacher = terms.has_teacher
        distill_mask = mask if has_teacher is None else mask * has_teacher[:, None].to(mask.dtype)
        rkl = topk_reverse_kl(terms.student_topk_logp, terms.teacher_topk_logp)
        rkl = torch.where(distill_mask > 0, rkl, 0.0)  # no teacher: garbage must not leak in
        distill = aggregate(rkl, distill_mask, cfg.aggregation)
        loss = loss + cfg.distill_coef * distill
        metrics["distill_rkl"] = distill.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
