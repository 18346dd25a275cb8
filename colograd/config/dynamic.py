"""Dynamic sampling (DAPO): groups that teach nothing are dropped and the rollout refilled (docs/longtail.md).

The names follow the issue threads that asked TRL for it (trl#3708) and its peers' meanings: verl's
`algorithm.filter_groups`, OpenRLHF's `dynamic_filtering`, ms-swift's `dynamic_sample` / `max_resample_times`.
Off by default: a run that does not set `dynamic_sampling` samples exactly as before.
"""

from dataclasses import dataclass, field

from colograd.errors import ConfigError

DYNAMIC_SAMPLING_FALLBACKS = ("fill", "error")


@dataclass
class DynamicSamplingOptions:
    """Which groups a rollout keeps, and how it refills the ones it drops."""

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: a group whose completions all got the same total (weighted) reward has "
            "zero advantage and no gradient; such groups are dropped and the rollout refilled with groups of other "
            "prompts (drawn from train_dataset, seeded by the step) until every rank has a rollout's worth of "
            "informative groups (its prompts per rollout), or dynamic_sampling_max_rounds refills have run. Every "
            "rank runs the same rounds. Metrics: dynamic_sampling/kept_fraction, /rounds, /discarded_groups, "
            "/filled_groups, /sampled_reward_mean (docs/longtail.md)."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={
            "help": "The most refill rounds a rollout runs after its first sampling (ms-swift's max_resample_times, "
            "default 3); then dynamic_sampling_fallback decides."
        },
    )
    dynamic_sampling_std_eps: float = field(
        default=1e-6,
        metadata={
            "help": "A group is uniform (dropped) when the standard deviation of its completions' total rewards is at "
            "most this (with multi_objective_aggregation: normalize_then_sum, of each reward function's); 0 drops "
            "only exact ties."
        },
    )
    dynamic_sampling_oversample: float = field(
        default=1.5,
        metadata={
            "help": "A refill round samples, on every rank, the prompts its missing groups are expected to take (by "
            "the share of informative groups found so far in the rollout; as many again as sampled when none was) "
            "times this, for the rank missing most, so that every rank samples alike; at most 8 × the batch's groups. "
            "Above 1 it saves rounds, each of which is an engine call."
        },
    )
    dynamic_sampling_fallback: str = field(
        default="fill",
        metadata={
            "help": "When the rounds run out with too few informative groups: 'fill' trains the informative ones and "
            "completes the batch with the least uniform of the others (they add no gradient, as without dynamic "
            "sampling); 'error' stops training with a message (the last checkpoint resumes)."
        },
    )

    def check_dynamic_sampling(self) -> None:
        """The dynamic-sampling choices (a `ConfigError` naming the field and the fix)."""
        if self.dynamic_sampling_fallback not in DYNAMIC_SAMPLING_FALLBACKS:
            raise ConfigError(
                f"dynamic_sampling_fallback={self.dynamic_sampling_fallback!r} is unknown; use 'fill' or 'error'."
            )
