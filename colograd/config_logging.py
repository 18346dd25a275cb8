"""Logging options beyond the basic ones, with TRL's `GRPOConfig` names and meanings."""

from dataclasses import dataclass, field


@dataclass
class LoggingOptions:
    """What the completion log shows."""

    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "With log_completions, the printed sample and the wandb / trackio completions table show each "
            "distinct prompt once (with its first completion) rather than every completion; completions.jsonl "
            "keeps them all."
        },
    )
