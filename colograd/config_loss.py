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
            "weighted sum normalised over the whole batch, every rank's)."
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
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ConfigError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r} is unknown; use "
                "sum_then_normalize or normalize_then_sum."
            )


@dataclass
class RegularizerOptions:
    """The entropy terms of the loss, the reference model's updates, and the output layer's precision (TRL's
    names, defaults and meanings)."""

    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "ρ of Beyond the 80/20 Rule: only the top-ρ quantile of tokens by entropy (over every rank's "
            "counted tokens of the micro-step) keeps its policy loss. 1.0 keeps all; 0.0 only the highest; the "
            "paper recommends 0.2."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the entropy bonus: the loss minus entropy_coef × the mean per-token entropy (over the "
            "tokens the policy loss counts), whatever the loss_type. With use_adaptive_entropy, its initial value."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive entropy control: after each optimizer step entropy_coef moves by "
            "entropy_coef_delta, up when the step's mean entropy (all ranks) was at or below entropy_target, down "
            "otherwise; the bonus applies only while the last step's entropy was at or below the target."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy control: entropy_coef's floor."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy control: entropy_coef's cap."})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Adaptive entropy control: entropy_coef's change per optimizer step."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Adaptive entropy control: the target mean per-token entropy in nats (the `entropy` metric "
            "shows it; language models are at 2-10, so set it near what the first steps log)."
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "TR-DPO: every ref_model_sync_steps optimizer steps the reference model becomes "
            "ref_model_mixup_alpha × policy + (1 - ref_model_mixup_alpha) × reference. Needs beta > 0 and a "
            "full (not LoRA) model."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "sync_ref_model: the policy's share α of the new reference."}
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "sync_ref_model: optimizer steps between reference updates (τ)."}
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "The output layer computes the training log-probs and entropies in float32, outside autocast, "
            "for the policy and the reference (ScaleRL). Its weights keep their dtype (see docs/reference.md)."
        },
    )

    def check_regularizers(self) -> None:
        """The values the entropy terms and the reference updates are defined for."""
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            raise ConfigError(
                f"entropy_coef_min={self.entropy_coef_min} is above entropy_coef_max={self.entropy_coef_max}; "
                "set the floor at or below the cap."
            )
        entropy_terms = self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0 or self.use_adaptive_entropy
        if entropy_terms and self.micro_batch_tokens is not None:
            raise ConfigError(
                "top_entropy_quantile / the entropy bonus take their quantile and mean over a micro-step's tokens, "
                "which micro_batch_tokens splits into passes; remove micro_batch_tokens or the entropy option."
            )
        if self.sync_ref_model and self.beta == 0.0:
            raise ConfigError("sync_ref_model with beta=0: there is no reference model to update; set beta > 0.")
