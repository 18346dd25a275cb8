"""Logging: what the completion log shows and when (TRL's names and meanings). `logging_steps`, a field of
`TrainingArguments` whose default colograd changes, is set in `colograd.config.core`."""

from dataclasses import dataclass, field

from colograd.errors import ConfigError

SAMPLING_GAP_COMPLETIONS = ("one", "all")


@dataclass
class LoggingOptions:
    """The sample of completions printed, written to completions.jsonl and sent to the trackers."""

    log_completions: bool = field(
        default=False,
        metadata={
            "help": "Print a sample of prompts, completions and rewards every log_completions_steps, and append "
            "the first rank's rollout of that step to output_dir/completions.jsonl."
        },
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions printed each time (whole groups first). None prints all."}
    )
    log_completions_steps: int | None = field(
        default=None, metadata={"help": "Log completions every this many optimizer steps. None: every logging step."}
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "With log_completions, the printed sample and the wandb / trackio completions table show each "
            "distinct prompt once (with its first completion) rather than every completion; completions.jsonl "
            "keeps them all."
        },
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "With log_completions and a vision-language rollout, the wandb / trackio completions table "
            "carries each completion's prompt images (an 'image' column, as TRL's) and completions.jsonl their "
            "sizes; false leaves them out, for smaller logs with large images."
        },
    )
    sampling_gap_completions: str = field(
        default="one",
        metadata={
            "help": "Which completions the sampling-gap metric (sampling/sampling_logp_difference/*, the engine's "
            "log-probs against the trainer's) covers. 'one': one per rank, on the steps that log (an image run takes "
            "it from another of its prompts at each such step, so every row is covered in turn); no cost beside it. "
            "'all': every completion of every rollout, read as tensors from vLLM's sampler, so a wrong image or "
            "prompt in any row shows at once; generation ran at 0.84 of bare vLLM's speed against 0.91 with 'one' "
            "(the CPU, docs/benchmarks.md). Set on its own when the loss reads every log-prob already."
        },
    )

    def check_logging(self) -> None:
        """The logging choices (a `ConfigError` naming the field and the values it takes)."""
        if self.sampling_gap_completions not in SAMPLING_GAP_COMPLETIONS:
            raise ConfigError(
                f"sampling_gap_completions={self.sampling_gap_completions!r} is unknown; use 'one' or 'all'."
            )
