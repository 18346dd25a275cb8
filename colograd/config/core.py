"""Configuration: `GRPOConfig` (training, generation, engine, loss) and `ScriptArguments` (data, rewards).

Field names follow TRL's `GRPOConfig` wherever the meaning is the same, so a TRL recipe ports by copying
keys. Each field is documented once, in its `help` metadata; that text is what `--help` prints. The fields live in
one module per topic (`TOPICS`); `GRPOConfig` mixes them into transformers' `TrainingArguments`, and itself sets
only the `TrainingArguments` fields whose default GRPO changes, and what the run does with its output_dir.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from trl import ModelConfig

from colograd.config.data import ScriptArguments
from colograd.config.dynamic import DynamicSamplingOptions
from colograd.config.engine import EngineOptions
from colograd.config.forward import ForwardOptions
from colograd.config.generation import GenerationOptions
from colograd.config.loading import LoadingOptions
from colograd.config.logging import LoggingOptions
from colograd.config.loss import (
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTION_MODES,
    LOSS_TYPES,
    SCALE_REWARDS,
    LossOptions,
    RegularizerOptions,
)
from colograd.config.open_r1 import OpenR1Fields, OpenR1ScriptFields
from colograd.config.partial import PartialRolloutOptions
from colograd.config.ranges import check_ranges
from colograd.config.trl_compat import TRLOnlyFields, check_refused
from colograd.errors import ConfigError, SaidBefore

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTION_MODES",
    "LOSS_TYPES",
    "COMMON_FIELDS",
    "SCALE_REWARDS",
    "TOPICS",
    "ConfigError",
    "GRPOConfig",
    "ScriptArguments",
]


@dataclass
class GRPOConfig(
    TrainingArguments,
    GenerationOptions,
    DynamicSamplingOptions,
    PartialRolloutOptions,
    EngineOptions,
    LossOptions,
    RegularizerOptions,
    ForwardOptions,
    LoggingOptions,
    LoadingOptions,
    OpenR1Fields,
    TRLOnlyFields,
):
    # TrainingArguments fields with GRPO's defaults (TRL's)
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW)."})
    logging_steps: float = field(default=1, metadata={"help": "Log metrics every this many optimizer steps."})

    # The output directory
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir that holds another run's checkpoints or model: its checkpoints and "
            "completions.jsonl are removed at start, its model replaced at the end. Without it, a run that does not "
            "resume is refused there (see docs/runs.md)."
        },
    )
    auto_resume: bool = field(
        default=True,
        metadata={
            "help": "A run that names no resume_from_checkpoint resumes from the newest finished checkpoint in "
            "output_dir when that checkpoint's record names this run's setup (model, data, rewards, world size, "
            "objective), saying so in one line: a scheduler that relaunches the same command continues the run. "
            "Another run's checkpoints are refused as before. False: such a run never resumes (see "
            "docs/long-runs.md)."
        },
    )
    hang_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds a training process may go without progress (a stage of the step begun or ended); past "
            "it every rank writes its Python stacks to stderr and the run exits with code 124, so that the launch "
            "ends and a scheduler can relaunch it. Collectives wait at least this long plus a minute (ddp_timeout, "
            "raised to that if lower), so the hung rank is the one reported. 0: no limit (see docs/long-runs.md)."
        },
    )

    def __post_init__(self) -> None:
        check_elastic_restarts()  # before transformers forms the process group, which a restarted worker's never does
        check_ranges(self)  # before transformers' own checks and the derived fields, which assume numbers in range
        # The reward functions read the dataset's extra columns, so the Trainer must not drop them.
        self.remove_unused_columns = False
        if not torch.cuda.is_available():
            # Without this, transformers treats a multi-process launch on CPU as single-process training.
            self.use_cpu = True
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.derive_generation_batch()
        self.validate()

    def validate(self) -> None:
        """Check the fields against each other; raise `ConfigError` naming the field and the fix. (Each numeric
        field's range is checked first, in `__post_init__`: `colograd.config.ranges`.)"""
        self.apply_trl_aliases()
        self.apply_open_r1()
        check_refused(self)
        self.check_generation()
        self.check_dynamic_sampling()
        self.check_partial_rollouts()
        self.check_spanning_groups()
        self.check_loading()
        self.check_loss()
        self.check_regularizers()
        self.check_forward()
        self.check_engine()
        self.check_logging()

    @property
    def engine_logps_are_old_logps(self) -> bool:
        """Whether the engine's log-probs of its samples can stand in for the sampling policy's, saving a forward
        pass: each rollout is trained on once, sampling is unfiltered (the engine's probabilities are then the
        full softmax at the temperature, as the trainer's), and no correction needs the trainer's own."""
        return self.num_iterations == 1 and self.samples_unfiltered and not self.vllm_importance_sampling_correction

    @property
    def samples_unfiltered(self) -> bool:
        """Whether the engine samples from the full softmax at the temperature, as the trainer scores: no top-p,
        top-k, min-p, repetition penalty, extra sampling arguments or structured output reshape its distribution."""
        unfiltered = self.top_p == 1.0 and self.top_k <= 0 and self.repetition_penalty == 1.0
        return unfiltered and not (self.min_p or self.generation_kwargs or self.vllm_structured_outputs_regex)

    @property
    def needs_engine_logps(self) -> bool:
        """Whether the engine is asked the log-probs of every sampled token: the loss reads them (the
        importance-sampling correction, the off-policy mask, or old log-probs taken from the engine), or the
        sampling-gap metric covers every completion (`sampling_gap_completions: all`). Otherwise asking vLLM for
        them would only slow its decoding (per-token work in its output path), so a rollout asks for one
        completion's per rank, for the sampling-gap metric."""
        engine_as_old = self.reuses_rollouts_across_updates and self.engine_logps_are_old_logps
        read = self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None or engine_as_old
        return read or self.sampling_gap_completions == "all"  # the metric over every completion

    @property
    def rollout_micro_steps(self) -> int:
        """The micro-steps one rollout trains: its `steps_per_generation` slices, each `num_iterations` times."""
        return self.steps_per_generation * self.num_iterations

    @property
    def reuses_rollouts_across_updates(self) -> bool:
        """Whether some micro-steps train on a rollout sampled before the last optimizer step.

        Then the loss needs the sampling policy's log-probs, stored with the rollout; otherwise every micro-step
        of a rollout falls in the optimizer step that generated it and the current log-probs serve (ratio 1).
        """
        return self.gradient_accumulation_steps % self.rollout_micro_steps != 0

    @property
    def place_model_on_device(self) -> bool | None:
        """False on a CPU, else the Trainer decides (transformers' hook for this).

        Under a launcher the CPU device is indexed (`cpu:0`), and torch's `Module.to("cpu:0")` copies every
        parameter of a model already in memory: for a moment two models, and the process keeps the pages after.
        The model computes where it is, so there is nothing to move.
        """
        return False if self.device.type == "cpu" else None


# The config's fields by topic, in the order `--help` and docs/reference.md show them: each class is one module's
# (TrainingArguments' own fields, and TRL's fields accepted at one value, come last).
TOPICS: tuple[tuple[str, type], ...] = (
    ("Model", ModelConfig),
    ("Data and rewards", ScriptArguments),
    ("Generation", GenerationOptions),
    ("Dynamic sampling (DAPO)", DynamicSamplingOptions),
    ("Partial rollouts (APRIL)", PartialRolloutOptions),
    ("Loss", LossOptions),
    ("Loss: entropy terms and reference updates", RegularizerOptions),
    ("Training forward", ForwardOptions),
    ("Engine", EngineOptions),
    ("Logging", LoggingOptions),
    ("Model and data loading", LoadingOptions),
    ("open-r1's recipe fields", OpenR1Fields),
    ("open-r1's reward parameters", OpenR1ScriptFields),
    ("Training (transformers' TrainingArguments; GRPOConfig's defaults)", GRPOConfig),
    ("TRL fields accepted only at one value (any other is refused)", TRLOnlyFields),
)
# The fields most recipes set, in the order `--help` opens with.
COMMON_FIELDS: tuple[str, ...] = (
    "model_name_or_path",
    "dataset_name",
    "reward_funcs",
    "output_dir",
    "learning_rate",
    "num_generations",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "max_prompt_length",
    "temperature",
    "beta",
    "loss_type",
    "use_peft",
    "bf16",
    "logging_steps",
    "save_steps",
    "report_to",
    "resume_from_checkpoint",
    "push_to_hub",
)


def check_elastic_restarts(env: Mapping[str, str] | None = None) -> None:
    """Refuse a launch whose agent restarts its workers (`TORCHELASTIC_MAX_RESTARTS` > 0, which torchrun sets for
    every worker), before the process group forms: on this torch the restarted ones never form theirs (why:
    `colograd.runs.relaunch`).

    Raises:
        ConfigError: naming the setting and the way that works: the scheduler relaunches the same command;
            `SaidBefore` in a restarted attempt (the agent restarts refused workers too), which the CLI does not
            repeat.
    """
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if restarts.isdigit() and int(restarts) > 0:
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
        # The agent restarts refused workers too: a restart's refusal was said by the first attempt.
        raise (SaidBefore if attempt.isdigit() and int(attempt) > 0 else ConfigError)(
            f"torchrun --max-restarts {restarts} (accelerate launch --max_restarts): the restarted workers never "
            "form their process group on this torch (pytorch issue #167288); launch with no restarts and let the "
            "scheduler relaunch the same command, which resumes the run from its newest checkpoint "
            "(docs/long-runs.md)."
        )
