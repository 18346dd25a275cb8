"""The GRPO math as pure functions: group advantages and the clipped policy-gradient loss.

Shapes: N completions (= prompts × G, grouped consecutively), T completion tokens (padded).
"""

import torch


def group_advantages(rewards_N: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages normalised within each group of `num_generations` consecutive completions.

    Args:
        rewards_N: total reward of each completion, groups contiguous.
        num_generations: the group size G; N must be a multiple of it.
        scale_rewards: "group" divides by the group's std, "batch" by the std of all N, "none" does not scale.

    Returns:
        advantages_N: reward minus its group's mean, scaled as asked. A group whose rewards are all equal gets
        zero advantage (the 1e-4 keeps the division finite, as in TRL).
    """
    grouped_GxK = rewards_N.view(-1, num_generations)
    mean_N = grouped_GxK.mean(dim=1).repeat_interleave(num_generations)
    advantages_N = rewards_N - mean_N
    if scale_rewards == "group":
        std_N = grouped_GxK.std(dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std_N = rewards_N.std().expand_as(rewards_N)
    elif scale_rewards == "none":
        return advantages_N
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages_N / (std_N + 1e-4)


def policy_loss(
    logps_NT: torch.Tensor,
    old_logps_NT: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_NT: torch.Tensor,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipped surrogate loss of PPO/GRPO, averaged the way `loss_type` says (TRL's definitions).

    Args:
        logps_NT: log-probs of the sampled tokens under the model being trained (carries gradients).
        old_logps_NT: the same under the policy that sampled them (no gradient).
        advantages_N: one advantage per completion, shared by its tokens.
        mask_NT: 1 for completion tokens that count, 0 for padding.
        loss_type: "grpo" (mean per sequence, then over sequences), "bnpo" (mean over the batch's tokens),
            "dr_grpo" (sum over tokens / (N × max_completion_length)), "dapo" (sum / `num_items`).
        max_completion_length: the constant denominator of "dr_grpo".
        num_items: the token count "dapo" divides by (the global count per rank, so ranks weigh tokens equally).

    Returns:
        The scalar loss.
    """
    mask_NT = mask_NT.to(logps_NT.dtype)
    ratio_NT = torch.exp(logps_NT - old_logps_NT)
    clipped_NT = torch.clamp(ratio_NT, 1 - epsilon_low, 1 + epsilon_high)
    adv_N1 = advantages_N.unsqueeze(1)
    per_token_NT = -torch.min(ratio_NT * adv_N1, clipped_NT * adv_N1)
    masked_NT = per_token_NT * mask_NT
    if loss_type == "grpo":
        return (masked_NT.sum(-1) / mask_NT.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked_NT.sum() / mask_NT.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        return masked_NT.sum() / (masked_NT.size(0) * max_completion_length)
    if loss_type == "dapo":
        if num_items is None:
            raise ValueError("dapo needs num_items")
        return masked_NT.sum() / torch.as_tensor(num_items, dtype=masked_NT.dtype).clamp(min=1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")
