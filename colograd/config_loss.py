"""The surrogate objectives beyond PPO's clipping, with TRL's `GRPOConfig` names, defaults and meanings."""

from dataclasses import dataclass, field

from colograd.errors import ConfigError


@dataclass
class SurrogateOptions:
    """Parameters of loss_type cispo / sapo / vespo, two-sided clipping, the off-policy sequence mask, and how
    several rewards aggregate into advantages."""

    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2): cap the unclipped importance ratio at delta too, so a "
            "negative advantage's loss stays bounded. Above 1 + epsilon_high when set. None: PPO's clipping."
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "loss_type sapo: temperature of the gate for tokens with positive advantage."}
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "loss_type sapo: temperature of the gate for the other tokens."}
    )
    vespo_k_pos: float = field(
        default=2.0, metadata={"help": "loss_type vespo: power k of the Gamma weight, positive advantages."}
    )
    vespo_lambda_pos: float = field(
        default=3.0, metadata={"help": "loss_type vespo: decay λ of the Gamma weight, positive advantages."}
    )
    vespo_k_neg: float = field(
        default=3.0, metadata={"help": "loss_type vespo: power k of the Gamma weight, negative advantages."}
    )
    vespo_lambda_neg: float = field(
        default=2.0, metadata={"help": "loss_type vespo: decay λ of the Gamma weight, negative advantages."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "With several reward functions: sum_then_normalize (weighted sum, then normalised as "
            "scale_rewards says) or normalize_then_sum (GDPO: each function normalised within its group, then the "
            "weighted sum normalised over the rank's batch)."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): leave out of the loss a completion with a negative "
            "advantage whose mean per-token KL between the engine's sampling policy and the current one exceeds "
            "this (e.g. 0.5). None disables."
        },
    )

    def check_surrogate(self) -> None:
        """The values the objectives are defined for."""
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise ConfigError(
                f"delta={self.delta} caps the ratio below the clipping range's top 1 + epsilon_high = "
                f"{1 + self.epsilon_high}; set it above that, or to None."
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: set it above 0.")
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ConfigError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} is unknown; use "
                "sum_then_normalize or normalize_then_sum."
            )
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold <= 0:
            raise ConfigError(f"off_policy_mask_threshold={self.off_policy_mask_threshold}: set it above 0, or None.")
