"""Partial rollouts (APRIL): a rollout stops once enough groups have finished, and the unfinished ones go on in the
next (docs/longtail.md).

Off by default: a run that does not set `partial_rollouts` samples exactly as before.
"""

from dataclasses import dataclass, field

from colograd.errors import ConfigError

# Sampling settings whose effect depends on the tokens or text a request itself sampled, which a resumed request
# would not know (it sees them as its prompt): vLLM's presence and frequency penalties, a minimum length, stop
# strings (one cut in two would be missed) and banned multi-token sequences; and a regex constraint.
_NOT_RESUMABLE = ("presence_penalty", "frequency_penalty", "min_tokens", "stop", "bad_words")


@dataclass
class PartialRolloutOptions:
    """Whether a rollout waits for its slowest completions, and what becomes of the ones it does not wait for."""

    partial_rollouts: bool = field(
        default=False,
        metadata={
            "help": "APRIL's partial rollouts: each rank starts more groups than its rollout takes "
            "(partial_rollout_overprovision), stops the engine once a rollout's worth of groups have finished, "
            "and keeps the unfinished completions (tokens, the engine's log-probs, the weight version of each token) "
            "to continue first in the next rollout, as prompt + tokens so far. Tokens sampled under older weights are "
            "corrected by the importance-sampling weights of their stored log-probs (vllm_importance_sampling_"
            "correction, turned on), or left out of the loss (mask_stale_tokens). Metrics: partial_rollouts/* "
            "(docs/longtail.md)."
        },
    )
    partial_rollout_overprovision: float = field(
        default=1.5,
        metadata={
            "help": "How many groups a rollout keeps in flight, as a multiple of the groups it takes: the unfinished "
            "groups carried over from the last rollout come first, then the dataloader's prompts, then prompts drawn "
            "from train_dataset (seeded by the run's micro-step) up to this many."
        },
    )
    partial_rollout_max_staleness: int = field(
        default=2,
        metadata={
            "help": "The most weight versions (optimizer steps) a carried group may be behind: a group whose oldest "
            "token was sampled more optimizer steps ago is dropped at the start of a rollout, its tokens unused. With "
            "one rollout per optimizer step (steps_per_generation = gradient_accumulation_steps, the default), that "
            "many rollouts."
        },
    )
    mask_stale_tokens: bool = field(
        default=False,
        metadata={
            "help": "With partial_rollouts: leave the tokens sampled under older weights out of the loss (they stay "
            "in the context of the tokens after them) instead of correcting them by importance sampling."
        },
    )

    def check_partial_rollouts(self) -> None:
        """The partial-rollout choices, and what they cannot be combined with (a `ConfigError` naming the fix)."""
        if self.mask_stale_tokens and not self.partial_rollouts:
            raise ConfigError(
                "mask_stale_tokens applies to partial_rollouts only; set partial_rollouts: true, or drop it."
            )
        if not self.partial_rollouts:
            return
        if self.dynamic_sampling:
            raise ConfigError(
                "partial_rollouts with dynamic_sampling is not supported yet (a refill round would stop on its own "
                "groups); turn one of them off."
            )
        if self.vllm_tensor_parallel_size > 1:
            raise ConfigError(
                "partial_rollouts needs an engine per rank (the ranks of a tensor-parallel engine would each stop at "
                "their own groups); set vllm_tensor_parallel_size: 1."
            )
        resumed = [k for k in _NOT_RESUMABLE if (self.generation_kwargs or {}).get(k)]
        if self.vllm_structured_outputs_regex is not None:
            resumed.append("vllm_structured_outputs_regex")
        if resumed:
            raise ConfigError(
                f"partial_rollouts cannot resume a completion under {', '.join(resumed)} (it depends on the tokens "
                "the completion sampled, which a resumed request sees as its prompt); drop it, or turn "
                "partial_rollouts off."
            )
        if not self.mask_stale_tokens:
            # The probabilities that sampled the stale tokens are the engine's stored log-probs: the correction reads
            # them.
            self.vllm_importance_sampling_correction = True
