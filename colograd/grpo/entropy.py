"""The entropy terms of the GRPO loss, with TRL's meanings: the high-entropy token mask (`top_entropy_quantile`),
the entropy bonus (`entropy_coef`) and its adaptive coefficient (`use_adaptive_entropy`), and the `entropy` metric.

Entropies are those of each completion position's next-token distribution at the sampling temperature, computed
by `colograd.forward.logps` chunk by chunk with the log-probs (no [tokens × vocabulary] matrix for the whole batch).
"""

import json
import math
import os
from collections.abc import Callable

import torch
from accelerate import Accelerator

from colograd.config.core import GRPOConfig
from colograd.grpo.loss import Gather, masked_mean

STATE_FILE = "entropy_ctrl_state.json"  # TRL's name, in each checkpoint folder


def high_entropy_mask(
    entropy_NT: torch.Tensor, mask_NT: torch.Tensor, quantile: float, gather: Gather | None = None
) -> torch.Tensor:
    """The tokens whose entropy is at least the (1 - `quantile`) quantile of every rank's counted tokens (TRL's
    `get_high_entropy_mask`).

    Args:
        entropy_NT: per-token entropies.
        mask_NT: 1 where a token counts in the loss.
        quantile: `top_entropy_quantile` ρ: the share of tokens kept.
        gather: every rank's values of a 1-D tensor (NaN-padded; a collective); None: this rank alone.

    Returns:
        A bool [N, T] mask, False wherever `mask_NT` is 0.
    """
    local = entropy_NT[mask_NT.bool()].float()
    everyone = gather(local) if gather else local
    everyone = everyone[~everyone.isnan()]
    if everyone.numel() == 0:
        return torch.zeros_like(entropy_NT, dtype=torch.bool)
    threshold = torch.quantile(everyone, 1 - quantile)
    return ((entropy_NT * mask_NT.float()) >= threshold) & mask_NT.bool()


def mean_entropy(entropy_NT: torch.Tensor, mask_NT: torch.Tensor) -> torch.Tensor:
    """The mean entropy over the counted tokens: the entropy bonus before its coefficient (carries gradients)."""
    return (entropy_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1.0)


def next_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """Skywork-OR1's update of the entropy coefficient after an optimizer step whose mean entropy was `entropy`:
    up by `delta` (to at most `high`) at or below the target, else down (to at least `low`)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


class EntropyTerms:
    """The entropy options of one run, and the adaptive coefficient's state (saved with each checkpoint, as TRL's).

    Args:
        args: the run's `GRPOConfig`.
        accelerator: the Trainer's (its `sync_gradients` marks the optimizer steps; its reductions span ranks).
        gather: every rank's values of a 1-D tensor (see `colograd.runs.ranks.across_ranks`).
        metrics: the trainer's metric lists, which `regularize` appends to.
    """

    def __init__(
        self,
        args: GRPOConfig,
        accelerator: Accelerator,
        gather: Callable[[torch.Tensor], torch.Tensor],
        metrics: dict[str, list[float]],
    ) -> None:
        self.args, self.accelerator, self.gather, self.metrics = args, accelerator, gather, metrics
        self.coef = args.entropy_coef
        # The bonus stays on under adaptive control even at coefficient 0, so that it can come back (TRL's).
        self.bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
        self.last_entropy = math.inf  # the last optimizer step's mean entropy: no bonus before one is measured
        self._window: torch.Tensor | None = None  # [entropy sum, token count] of this optimizer step's micro-steps

    @property
    def applied_coef(self) -> float:
        """The bonus's coefficient for this optimizer step's micro-steps: the last step's; under adaptive control 0
        while the last step's mean entropy was above the target (TRL's)."""
        if self.args.use_adaptive_entropy and self.last_entropy > self.args.entropy_target:
            return 0.0
        return self.coef

    @property
    def mode(self) -> str:
        """How `colograd.forward.logps` computes entropies: with gradient while a bonus applies, else (detached) for
        the mask and the metric."""
        return "grad" if self.bonus_enabled and self.applied_coef != 0.0 else "detached"

    def mask(self, entropy_NT: torch.Tensor, mask_NT: torch.Tensor) -> torch.Tensor | None:
        """The high-entropy mask, or None when `top_entropy_quantile` keeps every token."""
        if self.args.top_entropy_quantile >= 1.0:
            return None
        return high_entropy_mask(entropy_NT.detach(), mask_NT, self.args.top_entropy_quantile, self.gather)

    def regularize(
        self,
        loss: torch.Tensor,
        entropy_NT: torch.Tensor,
        mask_NT: torch.Tensor,
        entropy_mask_NT: torch.Tensor | None,
        training: bool,
    ) -> torch.Tensor:
        """`loss` minus the entropy bonus over the tokens the policy loss counts; logs the `entropy` metric (over
        the counted tokens), with the bonus `entropy_coef` and `policy_loss` as TRL does, and after each optimizer
        step moves the adaptive coefficient.

        Args:
            loss: the policy loss of one micro-step (scalar).
            entropy_NT: per-token entropies (with gradient when the bonus is on), mask_NT: the counted tokens,
                entropy_mask_NT: the high-entropy ones (`mask`), training: False in evaluation.
        """
        metrics = self.metrics
        metrics["entropy"].append(masked_mean(entropy_NT.detach(), mask_NT.float()))
        if not self.bonus_enabled:
            return loss
        counted_NT = mask_NT if entropy_mask_NT is None else mask_NT * entropy_mask_NT
        bonus = mean_entropy(entropy_NT, counted_NT)
        adaptive = self.args.use_adaptive_entropy
        coef = self.applied_coef  # the last optimizer step's, for every micro-step of this one
        metrics["policy_loss"].append(loss.item())
        step_ends = training and self.accelerator.sync_gradients
        if adaptive and training:
            stats = torch.stack([(entropy_NT * counted_NT).sum(), counted_NT.sum()]).detach().float()
            self._window = stats if self._window is None else self._window + stats
            if step_ends:
                total = self.accelerator.reduce(self._window, reduction="sum")
                self.last_entropy = (total[0] / total[1].clamp(min=1.0)).item()
                args = self.args
                self.coef = next_coef(
                    self.coef, self.last_entropy, args.entropy_target, args.entropy_coef_delta,
                    args.entropy_coef_min, args.entropy_coef_max,
                )  # fmt: skip
                self._window = None
        if step_ends:
            metrics["entropy_coef"].append(self.coef)
        return loss - coef * bonus

    def write_state(self, folder: str) -> None:
        """Write the adaptive coefficient's state into the checkpoint being saved in `folder` (TRL's file), before
        its record says the save finished (`colograd.runs.saving`), so a finished checkpoint always holds it."""
        if self.args.use_adaptive_entropy:
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump({"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}, f)

    def resume(self, checkpoint: str | None) -> None:
        """Take the adaptive coefficient's state from the checkpoint training resumes from, when it has one."""
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint else None
        if self.args.use_adaptive_entropy and path and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            self.coef, self.last_entropy = state["entropy_coef"], state["last_world_entropy"]
