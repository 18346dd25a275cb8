"""The loss: the objective (loss_type and its parameters, clipping, the KL penalty), how rewards become advantages,
the importance-sampling correction, and the regularizers (entropy terms, reference updates), with TRL's names,
defaults and meanings."""

from dataclasses import dataclass, field

import torch

from colograd.errors import ConfigError

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class LossOptions:
    """The objective: its loss_type and parameters, clipping, the KL penalty, the passes over a rollout, how
    rewards aggregate into advantages, and the correction for the engine's sampling policy."""

    loss_type: str = field(
        default="dapo",
        metadata={"help": f"How per-token losses are averaged: one of {', '.join(LOSS_TYPES)} (TRL's meanings)."},
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL penalty to the reference model (the initial policy; with LoRA, the model with "
            "its adapters disabled). 0 loads no reference."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "Multiply the per-token KL by the importance ratio (unbiased reverse-KL gradient, as TRL)."},
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Optimization passes over each rollout (μ in the GRPO paper)."}
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "token: one importance ratio per token; sequence: one per completion, the exponentiated mean "
            "log-ratio of its tokens (GSPO)."
        },
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clipping bound of the importance ratio: 1 - epsilon."}
    )
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound: 1 + epsilon_high. None: same as epsilon."}
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2): cap the unclipped importance ratio at delta too, so a "
            "negative advantage's loss stays bounded. Above 1 + epsilon_high when set. None: PPO's clipping."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Divide advantages by the reward std of the group, of the whole batch (all ranks), or none. TRL's "
            "booleans are read as TRL reads them: true is group, false is none."
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weighs them all 1."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "With several reward functions: sum_then_normalize (weighted sum, then normalised as "
            "scale_rewards says) or normalize_then_sum (GDPO: each function normalised within its group, then the "
            "weighted sum normalised over the whole batch, every rank's)."
        },
    )
    reward_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds one call of a reward function may take; past it the step fails naming the function, "
            "and the last finished checkpoint is kept. 0: no limit."
        },
    )
    reward_sigterm_wait: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a reward function call may still take once SIGTERM came, before the run stops without "
            "saving the unfinished step (within a scheduler's grace, 30 s by default). 0: stop at once."
        },
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave completions cut at max_completion_length out of the loss."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Weight each token's loss by π_trainer / π_engine of its sampled token (the trainer's and the "
            "engine's probabilities under the same weights), bounded as vllm_importance_sampling_mode says: "
            "corrects for numerical differences between the two (TRL's truncated importance sampling)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": f"One of {', '.join(IS_CORRECTION_MODES)}: a ratio per token or per completion (the product "
            "over its tokens); truncate clamps it to [clip_min, clip_max], mask zeroes it outside (TRL's modes)."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the correction ratio. None: no upper bound."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the correction ratio. None: no lower bound."}
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): leave out of the loss a completion with a negative "
            "advantage whose mean per-token KL between the engine's sampling policy and the current one exceeds "
            "this (e.g. 0.5). None disables."
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

    def check_loss(self) -> None:
        """The names the objective knows, and the values it is defined for (TRL's boolean `scale_rewards` read as
        TRL reads it)."""
        booleans = {True: "group", False: "none", "true": "group", "false": "none"}
        key = self.scale_rewards.lower() if isinstance(self.scale_rewards, str) else self.scale_rewards
        self.scale_rewards = booleans.get(key, self.scale_rewards)
        for name, known in (
            ("loss_type", LOSS_TYPES),
            ("scale_rewards", SCALE_REWARDS),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
            ("multi_objective_aggregation", ("sum_then_normalize", "normalize_then_sum")),
            ("vllm_importance_sampling_mode", IS_CORRECTION_MODES),
        ):
            if getattr(self, name) not in known:
                raise ConfigError(f"{name}={getattr(self, name)!r} is unknown; use one of {', '.join(known)}.")
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise ConfigError(
                f"delta={self.delta} caps the ratio below the clipping range's top 1 + epsilon_high = "
                f"{1 + self.epsilon_high}; set it above that, or to None."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(
                f"vllm_importance_sampling_clip_min={low} is not below vllm_importance_sampling_clip_max={high}; "
                "lower the first or raise the second."
            )


@dataclass
class RegularizerOptions:
    """The entropy terms of the loss and the reference model's updates (TRL's names, defaults and meanings)."""

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
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts models: the weight of the router's load-balancing loss added to the GRPO "
            "loss (logged as aux_loss). Unset: the model config's own coefficient (TRL's rule); 0 turns it off. "
            "Refused for a model without router logits."
        },
    )
    routing_replay: str = field(
        default="off",
        metadata={
            "help": "Mixture-of-Experts models: 'rollout' routes each token, in every pass the trainer runs (old "
            "policy, reference, training), to the experts the engine's routers chose for it while sampling "
            "(routing replay of the rollout, R3 in verl's and slime's terms), so that a router near a tie cannot "
            "pick other experts than the ones the tokens were sampled with; the gates' weights are still the "
            "trainer's, so the routers keep their gradient. 'off': the trainer routes each token itself. Logged as "
            "moe/routing_replay/differed (the share of routing choices the trainer would have made otherwise) and "
            "moe/routing_replay/unreplayed (those the engine did not report). Tool calls and environments are "
            "replayed turn by turn, partial rollouts piece by piece (a position keeps the routing its tokens were "
            "sampled from); refused for a dense model and with a rollout_func, and with partial_rollouts on a GPU. "
            "On a CPU the engine then runs eagerly (vllm_enforce_eager), as its routing is read by a Python hook a "
            "compiled forward skips."
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
        if self.routing_replay not in ("off", "rollout"):
            raise ConfigError(f"routing_replay={self.routing_replay!r} is unknown; use 'off' or 'rollout'.")
        if self.routing_replay == "rollout" and getattr(self, "partial_rollouts", False) and torch.cuda.is_available():
            raise ConfigError(
                "routing_replay=rollout with partial_rollouts on a GPU: vLLM's own route, which a GPU engine reports "
                "its routing by, returns a completion's routing only once it finishes, and partial rollouts stop "
                "completions before; set one of them off."
            )
