"""The GRPO math as pure functions: rewards to advantages, importance ratios, KL, and the clipped loss.

Shapes: N completions (= prompts × G, grouped consecutively), T completion tokens (padded), F reward functions.
Definitions follow TRL's `GRPOTrainer` so the same inputs give the same numbers.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from trl.trainer.utils import nanstd

from colograd.runs.ranks import gather_rows

# Every rank's values of a 1-D tensor, concatenated (NaN where a rank had fewer); identity on one rank.
Gather = Callable[[torch.Tensor], torch.Tensor]


def weighted_rewards(rewards_NF: torch.Tensor, weights_F: torch.Tensor) -> torch.Tensor:
    """Each completion's total reward: the weighted sum of its functions' rewards.

    Args:
        rewards_NF: one column per reward function; NaN where a function abstained (returned None).
        weights_F: one weight per function.

    Returns:
        rewards_N: an abstaining function counts 0; NaN only where every function abstained (unscorable).
    """
    rewards_N = (rewards_NF * weights_F).nansum(dim=1)
    return rewards_N.masked_fill(rewards_NF.isnan().all(dim=1), float("nan"))


def group_advantages(
    rewards_N: torch.Tensor, num_generations: int, scale_rewards: str = "group", gather: Gather | None = None
) -> torch.Tensor:
    """Advantages normalised within each group of `num_generations` consecutive completions.

    Args:
        rewards_N: total reward of each completion, groups contiguous; NaN for an unscorable completion.
        num_generations: the group size G; N must be a multiple of it.
        scale_rewards: "group" divides by the group's std, "batch" by the std of the whole batch (every rank's
            rewards, as TRL's), "none" does not scale.
        gather: every rank's rewards from this rank's (only "batch" calls it); None: this rank is the batch.

    Returns:
        advantages_N: reward minus its group's mean, scaled as asked. A group whose rewards are all equal gets
        zero advantage (the 1e-4 keeps the division finite, as in TRL). Unscorable completions are left out of
        the means and stds and get advantage 0.
    """
    grouped_GxK = rewards_N.view(-1, num_generations)
    mean_N = torch.nanmean(grouped_GxK, dim=1).repeat_interleave(num_generations)
    advantages_N = rewards_N - mean_N
    if scale_rewards == "group":
        advantages_N = advantages_N / (nanstd(grouped_GxK, dim=1).repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards == "batch":
        advantages_N = advantages_N / (nanstd(gather(rewards_N) if gather else rewards_N) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return torch.nan_to_num(advantages_N, nan=0.0)


def normalize_then_sum(
    rewards_NF: torch.Tensor, weights_F: torch.Tensor, num_generations: int, gather: Gather | None = None
) -> torch.Tensor:
    """GDPO's aggregation (TRL's `multi_objective_aggregation: normalize_then_sum`): each function's rewards are
    normalised within their group, then weighted and summed, and the sums normalised over the batch (every rank's,
    as TRL's).

    Args:
        rewards_NF: one column per reward function, groups contiguous; NaN where a function abstained.
        weights_F: one weight per function.
        gather: every rank's summed rewards from this rank's; None: this rank is the batch.

    Returns:
        advantages_N: 0 for a completion no function scored.
    """
    grouped_GKF = rewards_NF.view(-1, num_generations, rewards_NF.size(1))
    mean_G1F = torch.nanmean(grouped_GKF, dim=1, keepdim=True)
    std_G1F = nanstd(grouped_GKF, dim=1, keepdim=True)
    normalised_NF = ((grouped_GKF - mean_G1F) / (std_G1F + 1e-4)).view_as(rewards_NF)
    rewards_N = (normalised_NF * weights_F).nansum(dim=1)
    rewards_N = rewards_N.masked_fill(rewards_NF.isnan().all(dim=1), float("nan"))
    batch_M = gather(rewards_N) if gather else rewards_N
    std = nanstd(batch_M) if batch_M.numel() > 1 else torch.zeros(())
    return torch.nan_to_num((rewards_N - torch.nanmean(batch_M)) / (std + 1e-4), nan=0.0)


def spanned_advantages(
    advantages: Callable[[torch.Tensor, Gather | None], torch.Tensor],
    rewards_NF: torch.Tensor,
    gather: Gather,
    rank: int,
) -> torch.Tensor:
    """This rank's advantages where groups span ranks, as TRL computes them: every rank's rewards gathered in rank
    order (the rollout's completions over all ranks, each prompt's G consecutive), `advantages` computed on them as
    one process holding the whole rollout would, and this rank's slice kept.

    Args:
        advantages: `advantages(rewards_NF, gather)`, e.g. `group_advantages` of the weighted rewards; called with
            the whole rollout's rewards and no gather (they are the batch).
        rewards_NF: this rank's rewards, [N, F]; every rank holds the same N.
        gather: every rank's values of a 1-D tensor, in rank order (`colograd.runs.ranks.across_ranks`).
        rank: this rank's index.

    Returns:
        advantages_N: this rank's slice of the whole rollout's advantages.
    """
    n = rewards_NF.size(0)
    every_MF = gather_rows(rewards_NF, gather)
    return advantages(every_MF, None)[rank * n : (rank + 1) * n]


def log_importance_weights(
    logps_NT: torch.Tensor, old_logps_NT: torch.Tensor, mask_NT: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log(π_θ / π_old) per token ([N, T]), or per completion ([N, 1]) as the mean over its tokens (GSPO)."""
    log_ratio_NT = logps_NT - old_logps_NT
    if level == "token":
        return log_ratio_NT
    if level == "sequence":
        mask_NT = mask_NT.to(log_ratio_NT.dtype)
        return ((log_ratio_NT * mask_NT).sum(-1) / mask_NT.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"unknown importance_sampling_level {level!r}")


def kl_k3(logps_NT: torch.Tensor, ref_logps_NT: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) by Schulman's k3 estimator: exp(r) - r - 1 with r = log π_ref - log π_θ.

    Non-negative, and zero exactly where the two log-probs agree. Shape [N, T].
    """
    delta_NT = ref_logps_NT - logps_NT
    return torch.exp(delta_NT) - delta_NT - 1


def clipped_fractions(
    ratio: torch.Tensor, advantages_N: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> dict[str, torch.Tensor]:
    """Where clipping removed the gradient: the ratio left its trust region in the direction the advantage pushes.

    Args:
        ratio: importance ratios, [N, T] (token level) or [N, 1] (sequence level).

    Returns:
        Boolean masks shaped like `ratio` under TRL's metric names: `low`, `high`, `region` (either).
    """
    adv_N1 = advantages_N.unsqueeze(1)
    low = (ratio < 1 - epsilon_low) & (adv_N1 < 0)
    high = (ratio > 1 + epsilon_high) & (adv_N1 > 0)
    return {"low": low, "high": high, "region": low | high}


def engine_old_logps(engine_logps_NT: torch.Tensor, trainer_logps: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The engine's log-probs of its samples standing in for the sampling policy's (`engine_logps_are_old_logps`).
    Where the engine could not score a token (NaN: the sampler tap missed an agent's turns, which cannot be sampled
    again), the trainer's own at the same weights (`trainer_logps`, called only then): a NaN old log-prob would make
    the loss NaN."""
    unscored_NT = engine_logps_NT.isnan()
    if not unscored_NT.any():
        return engine_logps_NT
    return torch.where(unscored_NT, trainer_logps().to(engine_logps_NT.dtype), engine_logps_NT)


def importance_sampling(args: Any) -> tuple[str, float | None, float | None]:
    """`sampling_correction`'s mode and clips, as the config sets them (`vllm_importance_sampling_*`)."""
    return (
        args.vllm_importance_sampling_mode,
        args.vllm_importance_sampling_clip_min,
        args.vllm_importance_sampling_clip_max,
    )


def sampling_correction(
    trainer_logps_NT: torch.Tensor,
    engine_logps_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Truncated importance-sampling weights π_trainer / π_engine of the sampled tokens (TRL's modes).

    Both log-probs are of the policy that sampled; they differ only by numerics (kernels, precision).

    Args:
        mode: "token_*" gives one ratio per token ([N, T]); "sequence_*" one per completion ([N, 1]), the product
            of its tokens' ratios. "*_truncate" clamps it to [clip_min, clip_max]; "*_mask" sets it to 0 outside.

    Returns:
        The detached weights each token's loss is multiplied by.
    """
    diff_NT = torch.nan_to_num((trainer_logps_NT - engine_logps_NT) * mask_NT, nan=0.0)
    if mode.startswith("sequence"):
        diff_NT = diff_NT.sum(-1, keepdim=True)
    elif not mode.startswith("token"):
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")
    ratio = torch.exp(diff_NT).detach()
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("mask"):
        low = clip_min if clip_min is not None else -float("inf")
        high = clip_max if clip_max is not None else float("inf")
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")


class Surrogate(NamedTuple):
    """Parameters of the surrogate objectives besides PPO's clipping (TRL's `GRPOConfig` names and defaults)."""

    delta: float | None = None  # two-sided clipping: the ratio's upper bound where the advantage is negative
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None


def objective(args: Any) -> dict[str, Any]:
    """The keyword arguments of `policy_loss` a run's config sets (a `GRPOConfig`: TRL's names)."""
    return {
        "loss_type": args.loss_type,
        "epsilon_low": args.epsilon,
        "epsilon_high": args.epsilon_high,
        "importance_sampling_level": args.importance_sampling_level,
        "beta": args.beta,
        "use_bias_correction_kl": args.use_bias_correction_kl,
        "max_completion_length": args.max_completion_length,
        "surrogate": Surrogate(*(getattr(args, name) for name in Surrogate._fields)),
    }


def clipped_surrogate(
    ratio: torch.Tensor, adv_N1: torch.Tensor, epsilon_low: float, epsilon_high: float, delta: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective, negated; with `delta`, the unclipped ratio is also capped at `delta`
    (INTELLECT-2's two-sided clipping), so a large ratio cannot blow up a negative advantage's loss.

    Returns:
        The per-token loss, and the ratio after the `delta` cap (TRL's clipping metrics read it).
    """
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * adv_N1, clipped * adv_N1), ratio


def cispo_surrogate(
    ratio: torch.Tensor, logps_NT: torch.Tensor, adv_N1: torch.Tensor, epsilon_high: float
) -> torch.Tensor:
    """CISPO (MiniMax-M1): REINFORCE on the log-probs, weighted by the detached ratio capped at `epsilon_high`."""
    return -torch.clamp(ratio, max=epsilon_high).detach() * adv_N1 * logps_NT


def sapo_surrogate(ratio: torch.Tensor, adv_N1: torch.Tensor, temperature_pos: float, temperature_neg: float):
    """SAPO: a sigmoid gate 4σ(τ(r - 1))/τ in place of hard clipping, with τ by the advantage's sign."""
    tau = torch.where(adv_N1 > 0, temperature_pos, temperature_neg)
    return -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv_N1


@torch.no_grad()
def vespo_weights(
    log_ratio_NT: torch.Tensor,
    adv_N1: torch.Tensor,
    mask_NT: torch.Tensor,
    sampling_weights: torch.Tensor | None,
    surrogate: Surrogate,
) -> torch.Tensor:
    """VESPO's Gamma weights φ(w) = e^λ w^k e^(-λw) of the sequence ratio w (k, λ by the advantage's sign): [N, 1].

    w is the product of the tokens' ratios (clamped in log space as TRL does), times the sampling correction's
    ratios when there is one. φ(1) = 1; the weights scale the gradient and carry none.
    """
    floor = math.log(1e-8)
    log_w_N1 = (torch.clamp(log_ratio_NT, -20.0, 20.0) * mask_NT).sum(-1, keepdim=True)
    if sampling_weights is not None:
        log_w_N1 = log_w_N1 + torch.clamp(torch.log(sampling_weights), floor, 20.0).sum(-1, keepdim=True)
    log_w_N1 = torch.clamp(log_w_N1, floor, 20.0)
    positive = adv_N1 >= 0
    k = torch.where(positive, surrogate.vespo_k_pos, surrogate.vespo_k_neg)
    lam = torch.where(positive, surrogate.vespo_lambda_pos, surrogate.vespo_lambda_neg).clamp(min=1e-4)
    phi_N1 = torch.exp(lam + k * log_w_N1 - lam * torch.exp(log_w_N1))
    return phi_N1.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(
    adv_N1: torch.Tensor,
    logps_NT: torch.Tensor,
    sampling_logps_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: drop (0) a completion with a negative advantage whose mean
    per-token KL(π_sampling ‖ π_θ) estimate exceeds `threshold`; keep (1) the rest. [N, 1]."""
    kl_NT = torch.nan_to_num(sampling_logps_NT - logps_NT.detach(), nan=0.0)  # a token the engine could not score
    mean_kl_N1 = (kl_NT * mask_NT).sum(-1, keepdim=True) / mask_NT.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv_N1 >= 0) | (mean_kl_N1 <= threshold)).to(mask_NT.dtype)


class PolicyLoss(NamedTuple):
    """The loss and the detached terms its metrics are read from."""

    loss: torch.Tensor  # scalar, carries gradients
    ratio: torch.Tensor  # importance ratios: [N, T], or [N, 1] at sequence level
    kl_NT: torch.Tensor | None  # the per-token KL term as added to the loss (None when beta is 0)


def policy_loss(
    logps_NT: torch.Tensor,
    old_logps_NT: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_NT: torch.Tensor,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_sampling_level: str = "token",
    ref_logps_NT: torch.Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    surrogate: Surrogate | None = None,
    sampling_logps_NT: torch.Tensor | None = None,
    entropy_mask_NT: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped surrogate loss of PPO/GRPO plus `beta` × KL, averaged the way `loss_type` says (TRL's).

    Args:
        logps_NT: log-probs of the sampled tokens under the model being trained (carries gradients).
        old_logps_NT: the same under the policy that sampled them (no gradient).
        advantages_N: one advantage per completion, shared by its tokens.
        mask_NT: 1 for completion tokens that count, 0 for padding.
        loss_type: the clipped objective averaged as "grpo" (mean per sequence, then over sequences), "bnpo"
            (mean over the batch's tokens), "dr_grpo" (sum over tokens / (N × max_completion_length)), "dapo"
            (sum / `num_items`) or "luspo" (sum per sequence, mean over sequences); or another objective:
            "cispo" and "vespo" (averaged as dapo), "sapo" (as grpo). See the `*_surrogate` functions.
        epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high].
        importance_sampling_level: "token" or "sequence" (GSPO), see `log_importance_weights`.
        ref_logps_NT: log-probs under the reference model; needed when `beta` > 0.
        beta: weight of the per-token k3 KL added to each token's loss.
        use_bias_correction_kl: multiply the KL by the importance ratio (it is 1 in value on-policy, but not
            in gradient), as TRL does by default.
        max_completion_length: the constant denominator of "dr_grpo".
        num_items: the token count "dapo" divides by (the global count per rank, so ranks weigh tokens equally).
        sampling_weights: importance-sampling corrections ([N, T] or [N, 1], see `sampling_correction`) that
            multiply the policy term of each token, before the KL is added (TRL's order); vespo folds them into
            its sequence ratio instead.
        surrogate: the other objectives' parameters, and `delta` / the off-policy mask threshold; None: TRL's
            defaults.
        sampling_logps_NT: the sampling policy's log-probs the off-policy mask compares with (the engine's);
            None: `old_logps_NT`.
        entropy_mask_NT: the high-entropy tokens (`colograd.grpo.entropy.high_entropy_mask`): only they keep their
            policy term (the KL term stays on every token, as in TRL).

    Returns:
        The loss, with the ratios and KL it was built from (detached, for metrics).
    """
    mask_NT = mask_NT.to(logps_NT.dtype)
    ratio = torch.exp(log_importance_weights(logps_NT, old_logps_NT, mask_NT, importance_sampling_level))
    adv_N1 = advantages_N.unsqueeze(1)
    surrogate = surrogate or Surrogate()
    kl_ratio = ratio  # the KL's bias correction uses the ratio before any cap
    if loss_type == "cispo":
        per_token_NT = cispo_surrogate(ratio, logps_NT, adv_N1, epsilon_high)
    elif loss_type == "sapo":
        per_token_NT = sapo_surrogate(ratio, adv_N1, surrogate.sapo_temperature_pos, surrogate.sapo_temperature_neg)
    elif loss_type == "vespo":
        phi_N1 = vespo_weights(logps_NT - old_logps_NT, adv_N1, mask_NT, sampling_weights, surrogate)
        per_token_NT = -phi_N1 * adv_N1 * logps_NT
    else:
        per_token_NT, ratio = clipped_surrogate(ratio, adv_N1, epsilon_low, epsilon_high, surrogate.delta)
    if surrogate.off_policy_mask_threshold is not None:
        sampling_logps_NT = old_logps_NT if sampling_logps_NT is None else sampling_logps_NT
        per_token_NT = per_token_NT * off_policy_mask(
            adv_N1, logps_NT, sampling_logps_NT, mask_NT, surrogate.off_policy_mask_threshold
        )
    if entropy_mask_NT is not None:
        per_token_NT = per_token_NT * entropy_mask_NT
    if sampling_weights is not None and loss_type != "vespo":
        per_token_NT = per_token_NT * sampling_weights
    kl_NT = None
    if beta != 0.0:
        if ref_logps_NT is None:
            raise ValueError("beta > 0 needs ref_logps_NT")
        kl_NT = kl_k3(logps_NT, ref_logps_NT)
        if use_bias_correction_kl:
            kl_NT = kl_NT * kl_ratio
        per_token_NT = per_token_NT + beta * kl_NT
        kl_NT = kl_NT.detach()
    loss = reduce_loss(per_token_NT * mask_NT, mask_NT, loss_type, max_completion_length, num_items)
    return PolicyLoss(loss, ratio.detach(), kl_NT)


def masked_mean(x: torch.Tensor, mask_NT: torch.Tensor) -> float:
    """Mean of `x` over the counted tokens ([N, T]), or over completions for one value each ([N, 1])."""
    if x.size(1) == 1:
        return x.float().mean().item()
    return ((x * mask_NT).sum() / mask_NT.sum().clamp(min=1.0)).item()


def sampling_gap_metrics(
    logps_NT: torch.Tensor, engine_logps_NT: torch.Tensor, sampled_NT: torch.Tensor
) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's for the same weights: ~0 when
    the sync is exact. Over every token the engine sampled and scored (`sampled_NT`, 1 where the model sampled), in
    the loss or not; completions whose log-probs were not asked for (NaN, see `Engine.generate`) are left out. Empty
    when the slice holds no completion the engine scored."""
    scored_NT = sampled_NT.bool() & ~engine_logps_NT.isnan()
    if not scored_NT.any():
        return {}
    diff = (logps_NT - engine_logps_NT).abs()[scored_NT]
    return {
        "sampling/sampling_logp_difference/mean": diff.mean().item(),
        "sampling/sampling_logp_difference/max": diff.max().item(),
    }


def importance_ratio_metrics(weights: torch.Tensor, mask_NT: torch.Tensor) -> dict[str, float]:
    """The min, mean and max of the importance-sampling weights over the counted tokens ([N, T] weights) or
    completions ([N, 1]); empty when none is counted."""
    counted = weights.flatten() if weights.size(1) == 1 else weights[mask_NT.bool()]
    if not counted.numel():
        return {}
    return {
        "sampling/importance_sampling_ratio/min": counted.min().item(),
        "sampling/importance_sampling_ratio/mean": counted.mean().item(),
        "sampling/importance_sampling_ratio/max": counted.max().item(),
    }


def loss_metrics(
    out: PolicyLoss,
    advantages_N: torch.Tensor,
    mask_NT: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> dict[str, float]:
    """TRL's per-micro-step loss metrics, each a mean over the counted tokens: `clip_ratio/{low,high,region}_mean`
    and `kl` (when beta > 0)."""
    mask_NT = mask_NT.float()
    clipped = clipped_fractions(out.ratio, advantages_N, epsilon_low, epsilon_high)
    metrics = {f"clip_ratio/{name}_mean": masked_mean(where.float(), mask_NT) for name, where in clipped.items()}
    if out.kl_NT is not None:
        metrics["kl"] = masked_mean(out.kl_NT, mask_NT)
    return metrics


def reduce_loss(
    masked_NT: torch.Tensor,
    mask_NT: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Average masked per-token losses [N, T] into a scalar as `loss_type` says (see `policy_loss`)."""
    if loss_type in ("grpo", "sapo"):
        return (masked_NT.sum(-1) / mask_NT.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":  # each sequence weighs by its length
        return masked_NT.sum(-1).mean()
    if loss_type == "bnpo":
        return masked_NT.sum() / mask_NT.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        return masked_NT.sum() / (masked_NT.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items is None:
            raise ValueError("dapo needs num_items")
        return masked_NT.sum() / torch.as_tensor(num_items, dtype=masked_NT.dtype).clamp(min=1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")
