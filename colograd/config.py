"""Configuration: `GRPOConfig` (training, generation, engine, loss) and `ScriptArguments` (data, rewards).

Field names follow TRL's `GRPOConfig` wherever the meaning is the same, so a TRL recipe ports by copying
keys. Each field is documented once, in its `help` metadata; that text is what `--help` prints.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from colograd.config_data import PromptOptions
from colograd.config_generation import GenerationOptions
from colograd.config_loading import LoadingOptions
from colograd.config_logging import LoggingOptions
from colograd.config_loss import RegularizerOptions, SurrogateOptions
from colograd.config_ranges import check_ranges
from colograd.errors import ConfigError
from colograd.trl_compat import TRLOnlyFields, check_refused

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class GRPOConfig(
    TrainingArguments,
    GenerationOptions,
    LoadingOptions,
    LoggingOptions,
    SurrogateOptions,
    RegularizerOptions,
    TRLOnlyFields,
):
    # Generation
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps one rollout feeds: each rank generates for per_device_train_batch_size × this many "
            "completions at once, then trains on them a slice per micro-step. None: gradient_accumulation_steps "
            "(one rollout per optimizer step). Exclusive with generation_batch_size."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per rollout over all ranks; sets steps_per_generation to this divided by "
            "per_device_train_batch_size × number of processes. Exclusive with steps_per_generation."
        },
    )
    num_generations: int = field(
        default=8, metadata={"help": "Completions sampled per prompt (the group size G). At least 2."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompts longer than this many tokens keep their last tokens. None (TRL 1.16 has no such field "
            "and truncates nothing): prompts are kept whole, the engine's context is the model's own, and a prompt "
            "that leaves no room in it for a whole completion is refused before start-up (or dropped, with "
            "drop_invalid_prompts)."
        },
    )
    max_completion_length: int = field(default=512, metadata={"help": "Most tokens sampled per completion."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also applied to training log-probs)."}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling: keep the smallest token set with this mass."}
    )
    top_k: int = field(default=0, metadata={"help": "Sample among the k likeliest tokens; 0 disables."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "vLLM repetition penalty; 1.0 disables."})

    # Agents: tools and environments (see docs/agents.md)
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Most model turns that may call tools per completion; None: no limit (TRL's meaning)."},
    )
    tool_timeout: float = field(
        default=60.0,
        metadata={"help": "Seconds a turn's tool calls may take; past it the model reads a timeout error."},
    )

    # The colocated engine
    vllm_gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "Fraction of GPU memory the engine may take (weights + KV cache; vLLM fills it with KV cache). "
            "None: the KV cache is sized to the rollout instead (vllm_max_num_seqs sequences of a prompt and a "
            "completion, with margin), leaving the rest to training. GPU only."
        },
    )
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "KV-cache size in GiB of each engine. None: sized to the rollout (vllm_max_num_seqs sequences of "
            "a prompt and a completion, with margin; a prompt is max_prompt_length, else the longest of 256 sampled "
            "from the dataset; at most 0.3 of a GPU, or 1 GiB of a machine without one)."
        },
    )
    vllm_dtype: str | None = field(
        default=None,
        metadata={
            "help": "The engine's dtype when it should differ from the trainer's compute dtype: 'bfloat16' or "
            "'float16' (e.g. an fp32 trainer with an adapter-only LoRA sync on a GPU, whose LoRA kernels take "
            "16-bit only). The engine then samples from a rounded policy, so the importance-sampling correction is "
            "turned on and old log-probs come from the trainer. None: the trainer's (exact parity)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Engine context length. None: max_prompt_length + max_completion_length, or without "
            "max_prompt_length the model's own context (max_position_embeddings)."
        },
    )
    vllm_enforce_eager: bool = field(
        default=False, metadata={"help": "Disable CUDA graphs / compilation in the engine (faster start-up)."}
    )
    vllm_enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Let the engine reuse the KV cache of shared prompt prefixes."}
    )
    vllm_max_num_seqs: int | None = field(
        default=None,
        metadata={
            "help": "Most sequences the engine decodes at once. None: a whole rollout of this rank's TP group "
            "(prompts × num_generations), so one rollout runs as one batch."
        },
    )
    vllm_max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "Most tokens per engine forward pass (bounds chunked prefill). None: vLLM's default."},
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Split each engine over this many consecutive ranks (tensor parallel). The ranks of a group "
            "pool their prompts, generate together and each keep their own completions. Must divide the number "
            "of processes."
        },
    )

    vllm_cpu_repack_weights: bool = field(
        default=True,
        metadata={
            "help": "Without a GPU: let vLLM repack linear weights for oneDNN (its default: faster generation). Off, "
            "the engine computes with plain weights that a sync copies into directly: a faster sync, a slower "
            "rollout (figures in docs/weight-sync.md)."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Release the engine's GPU memory (KV cache, weights) during the update. GPU only."},
    )
    sync_bucket_mib: float = field(
        default=512,
        metadata={
            "help": "With sharded weights (ZeRO-3, FSDP2) or a merged LoRA, gather or build and sync them in buckets "
            "of about this many MiB."
        },
    )

    lora_sync: str = field(
        default="merged",
        metadata={
            "help": "How a PEFT LoRA model reaches the engine: 'merged' (base + B·A written into its weights) or "
            "'adapter' (only the adapter tensors move; the engine applies them with vLLM's LoRA support)."
        },
    )

    # Optimization
    learning_rate: float = field(default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW)."})

    # Loss
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
    loss_type: str = field(
        default="dapo",
        metadata={"help": f"How per-token losses are averaged: one of {', '.join(LOSS_TYPES)} (TRL's meanings)."},
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clipping bound of the importance ratio: 1 - epsilon."}
    )
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound: 1 + epsilon_high. None: same as epsilon."}
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Divide advantages by the reward std of the group, of the whole batch (all ranks), or none."
        },
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
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave completions cut at max_completion_length out of the loss."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weighs them all 1."}
    )

    # Training forward
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Train on packed sequences: each micro-batch's prompt + completion tokens are laid end to end "
            "with no padding, position ids restarting per sequence so attention stays within each one. False: "
            "padded rows."
        },
    )
    share_prompts: str = field(
        default="auto",
        metadata={
            "help": "With padding_free, completions of the same prompt compute it once in the forward pass instead "
            "of once each: the prompt, then each completion attending to it and to itself only (a 4D attention "
            "mask). Same log-probs and gradients, fewer tokens: GRPO's num_generations completions share a prompt. "
            "A prompt copy takes completions while that costs less than a new copy (long completions attend across "
            "a wider row), and within packed_row_tokens when set. Used where the model's attention is sdpa with "
            "full attention in every layer and no ALiBi; other models compute each sequence whole. auto: on a CPU "
            "whenever it saves tokens; on a GPU where it saves 20% of a pass's tokens (or any, where the pass's "
            "unshared rows would need a mask anyway: a masked attention kernel is slower than the maskless one), "
            "and not where SDPA would take its math kernel. true: whenever it saves tokens. false: never."
        },
    )
    packed_row_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed row: whole sequences are packed, longest first, into rows of at most "
            "this many tokens (a longer sequence gets a row of its own). Attention cost grows with its square. "
            "None: the micro-batch's longest sequence, so rows are never wider than padded ones would be (but for "
            "a shared prompt's copy with its completions, see share_prompts)."
        },
    )
    micro_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens (prompt + completion, padding excluded; a prompt shared by completions counts once "
            "per copy, see share_prompts) in one forward + backward pass: a micro-step's completions are split, "
            "whole, into passes of at most this many, whose gradients add up to the micro-step's. Bounds activation "
            "memory at long lengths. None: on a GPU (with padding_free), a budget from the memory free at the first "
            "pass and the model's activation bytes per token (logged once; none with DeepSpeed or the entropy "
            "terms); elsewhere one pass per micro-step. Not with DeepSpeed."
        },
    )
    logps_chunk_tokens: int = field(
        default=1024,
        metadata={
            "help": "Completion tokens whose log-probs are computed at once from the output layer: the "
            "[tokens × vocabulary] logits exist one chunk at a time (recomputed in the backward pass)."
        },
    )

    # Output
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an output_dir that holds another run's checkpoints or model: its checkpoints and "
            "completions.jsonl are removed at start, its model replaced at the end. Without it, a run that does not "
            "resume is refused there (see docs/runs.md)."
        },
    )

    # Logging
    logging_steps: float = field(default=1, metadata={"help": "Log metrics every this many optimizer steps."})
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

    def __post_init__(self) -> None:
        check_ranges(self)  # first: transformers' own checks and the derived fields assume numbers in range
        # The reward functions read the dataset's extra columns, so the Trainer must not drop them.
        self.remove_unused_columns = False
        if not torch.cuda.is_available():
            # Without this, transformers treats a multi-process launch on CPU as single-process training.
            self.use_cpu = True
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._derive_generation_batch()
        self.validate()

    def _derive_generation_batch(self) -> None:
        """Fill in whichever of steps_per_generation / generation_batch_size was left out (TRL's rule)."""
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError("steps_per_generation and generation_batch_size are both set; set only one of them.")
        if self.generation_batch_size is not None:
            if self.generation_batch_size % global_batch:
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} is not a multiple of "
                    f"per_device_train_batch_size × processes = {global_batch}; set it to a multiple of it."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        self.generation_batch_size = global_batch * self.steps_per_generation

    def validate(self) -> None:
        """Check the fields against each other; raise `ConfigError` naming the field and the fix."""
        self.apply_trl_aliases()
        check_refused(self)
        self.check_generation()
        self.check_loading()
        self.check_surrogate()
        self.check_regularizers()
        if self.per_device_train_batch_size % self.num_generations:
            raise ConfigError(
                f"per_device_train_batch_size={self.per_device_train_batch_size} is not a multiple of "
                f"num_generations={self.num_generations}: each rank generates whole groups; set it to a "
                f"multiple such as {self.num_generations * max(1, self.prompts_per_device)}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}.")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(
                f"scale_rewards={self.scale_rewards!r} is unknown; use one of {', '.join(SCALE_REWARDS)}."
            )
        if self.lora_sync not in ("merged", "adapter"):
            raise ConfigError(f"lora_sync={self.lora_sync!r} is unknown; use 'merged' or 'adapter'.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"importance_sampling_level={self.importance_sampling_level!r} is unknown; use one of "
                f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}."
            )
        # YAML gives booleans, the command line strings: both become True, False or "auto".
        share = {"auto": "auto", "true": True, "false": False}.get(str(self.share_prompts).lower())
        if share is None:
            raise ConfigError(f"share_prompts={self.share_prompts!r} is unknown; use auto, true or false.")
        self.share_prompts = share
        if self.vllm_importance_sampling_mode not in IS_CORRECTION_MODES:
            raise ConfigError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is unknown; use one of "
                f"{', '.join(IS_CORRECTION_MODES)}."
            )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ConfigError(
                f"vllm_importance_sampling_clip_min={low} is not below vllm_importance_sampling_clip_max={high}; "
                "lower the first or raise the second."
            )
        self.check_engine_memory()
        if self.world_size % self.vllm_tensor_parallel_size:
            raise ConfigError(
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} does not divide the {self.world_size} "
                "processes; set it to a divisor of the number of processes (1 gives every rank its own engine)."
            )

    def check_engine_memory(self) -> None:
        """The engine's memory and dtype fields; a differing engine dtype turns the sampling correction on."""
        if self.vllm_dtype not in (None, "bfloat16", "float16"):
            raise ConfigError(f"vllm_dtype={self.vllm_dtype!r} is unknown; use 'bfloat16', 'float16' or None.")
        if self.engine_dtype_differs:
            # π_engine differs from π_trainer by the rounding of every layer: correct for it, as TRL does for an
            # engine that does not compute exactly what the trainer does.
            self.vllm_importance_sampling_correction = True

    @property
    def engine_dtype_differs(self) -> bool:
        """Whether `vllm_dtype` makes the engine compute in another dtype than the trainer's mixed precision."""
        trainer = {"bf16": "bfloat16", "fp16": "float16"}.get(self.mixed_precision)
        return self.vllm_dtype is not None and self.vllm_dtype != trainer

    def check_lengths(self, model_config: Any) -> None:
        """Check that a prompt and a completion fit the model's context and the engine's, before start-up."""
        need = (self.max_prompt_length or 0) + self.max_completion_length
        what = "max_prompt_length + max_completion_length" if self.max_prompt_length else "max_completion_length"
        if self.vllm_max_model_length is not None and need > self.vllm_max_model_length:
            raise ConfigError(
                f"{what} = {need} tokens exceeds vllm_max_model_length={self.vllm_max_model_length}; lower them or "
                "raise vllm_max_model_length."
            )
        context = getattr(model_config, "max_position_embeddings", None)
        if context is not None and need > context:
            raise ConfigError(
                f"{what} = {need} tokens exceeds the model's context of {context} (max_position_embeddings); "
                "lower max_prompt_length or max_completion_length."
            )

    @property
    def prompts_per_device(self) -> int:
        """Prompts each rank takes per micro-step: per_device_train_batch_size counts completions."""
        return self.per_device_train_batch_size // self.num_generations

    @property
    def engine_logps_are_old_logps(self) -> bool:
        """Whether the engine's log-probs of its samples can stand in for the sampling policy's, saving a forward
        pass: each rollout is trained on once, sampling is unfiltered (the engine's probabilities are then the
        full softmax at the temperature, as the trainer's), and no correction needs the trainer's own."""
        unfiltered = self.top_p == 1.0 and self.top_k <= 0 and self.repetition_penalty == 1.0
        unfiltered = unfiltered and not (self.min_p or self.generation_kwargs or self.vllm_structured_outputs_regex)
        return self.num_iterations == 1 and unfiltered and not self.vllm_importance_sampling_correction

    @property
    def needs_engine_logps(self) -> bool:
        """Whether the loss reads the engine's log-probs of every sampled token: the importance-sampling correction,
        the off-policy mask, or old log-probs taken from the engine. Otherwise asking vLLM for them would only slow
        its decoding (per-token work in its output path), so a rollout asks for one group's, for the sampling-gap
        metric."""
        engine_as_old = self.reuses_rollouts_across_updates and self.engine_logps_are_old_logps
        return self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None or engine_as_old

    @property
    def reuses_rollouts_across_updates(self) -> bool:
        """Whether some micro-steps train on a rollout sampled before the last optimizer step.

        Then the loss needs the sampling policy's log-probs, stored with the rollout; otherwise every micro-step
        of a rollout falls in the optimizer step that generated it and the current log-probs serve (ratio 1).
        """
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) != 0

    @property
    def place_model_on_device(self) -> bool | None:
        """False on a CPU, else the Trainer decides (transformers' hook for this).

        Under a launcher the CPU device is indexed (`cpu:0`), and torch's `Module.to("cpu:0")` copies every
        parameter of a model already in memory: for a moment two models, and the process keeps the pages after.
        The model computes where it is, so there is nothing to move.
        """
        return False if self.device.type == "cpu" else None


@dataclass
class ScriptArguments(PromptOptions):
    """What `colograd/train.py` trains on: the data and the reward functions."""

    dataset_name: str = field(
        default="colograd:letters",
        metadata={
            "help": "A hub dataset id, a local .json/.jsonl/.csv/.parquet file, a local folder of them, or a "
            "built-in ('colograd:letters'). Rows need a 'prompt' (text or chat messages)."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "The hub dataset's configuration (subset) name."}
    )
    dataset_train_split: str = field(
        default="train",
        metadata={"help": "The split to train on (a file loads as 'train'; a folder's files name its splits)."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["letters"],
        metadata={
            "help": "Reward functions: built-in names (see colograd.rewards.BUILTIN_REWARDS), dotted paths to "
            "functions (my_pkg.rewards.length), or a sequence-classification reward model (a local folder or hub id)."
        },
    )
    drop_invalid_prompts: bool = field(
        default=False,
        metadata={
            "help": "Drop dataset rows whose prompt is invalid (empty, malformed messages, nothing after "
            "tokenizing), and print how many, instead of stopping with an error that names the first."
        },
    )
