"""TRL 1.16 `GRPOConfig` fields that colograd accepts only at the value that describes what it does.

A TRL recipe ports by copying keys. The fields below exist so that such a recipe parses; each is accepted at the
values listed first in its `_only(...)` (TRL's default, or what colograd always does, such as `use_vllm: true`)
and refused at any other value, at config time, with one line saying why and what to do. The fields TRL has that
colograd implements with TRL's meaning live in `colograd.config.core` and its section modules.

Also here: the `TrainingArguments` keys transformers 5 removed, and the message for a key nobody knows.
"""

import difflib
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from datasets import Dataset

from colograd.errors import ConfigError

_SERVER = "colograd runs its vLLM engine inside each training process (no server); remove it."
_TRANSFORMERS_GENERATION = "colograd always generates with its vLLM engine, not transformers; remove it."


# Help text -> (accepted values, reason). argparse takes a field's metadata as its own arguments, so the refusal
# cannot ride in the metadata; the help text names both, so equal help means an equal refusal.
_REFUSALS: dict[str, tuple[tuple[Any, ...], str]] = {}


def _only(*accepted: Any, why: str) -> Any:
    """A field accepted only at `accepted` (the first is its default); another value is refused with `why`."""
    help_text = f"TRL compatibility: accepted as {' or '.join(repr(a) for a in accepted)}; otherwise refused: {why}"
    _REFUSALS[help_text] = (accepted, why)
    return field(default=accepted[0], metadata={"help": help_text})


@dataclass
class TRLOnlyFields:
    """TRL fields that colograd accepts at the value describing what it does and refuses otherwise."""

    use_vllm: bool = _only(True, why="colograd always generates with its in-process vLLM engine; remove it.")
    vllm_mode: str = _only("colocate", why="colograd's engine is always colocated (in-process); remove it.")
    vllm_server_base_url: str | None = _only(None, why=_SERVER)
    vllm_server_host: str = _only("0.0.0.0", why=_SERVER)
    vllm_server_port: int = _only(8000, why=_SERVER)
    vllm_server_timeout: float = _only(240.0, why=_SERVER)
    vllm_group_port: int = _only(51216, why="colograd writes weights into its engine in memory, no group; remove it.")
    vllm_model_impl: str = _only("vllm", why="colograd's engine runs vLLM's own model implementations; remove it.")
    cache_implementation: str | None = _only(None, why=_TRANSFORMERS_GENERATION)
    use_transformers_continuous_batching: bool = _only(False, why=_TRANSFORMERS_GENERATION)
    transformers_continuous_batching_config: dict | str | None = _only(None, why=_TRANSFORMERS_GENERATION)
    use_transformers_paged: bool = _only(False, why=_TRANSFORMERS_GENERATION)
    ds3_gather_for_generation: bool = _only(
        True,
        why="under ZeRO-3 colograd always gathers the weights into its engine, in buckets; lower sync_bucket_mib "
        "to bound the memory a gather takes.",
    )
    pad_to_multiple_of: int | str | None = _only(
        "auto", None, why="colograd packs sequences without padding (padding_free); remove it."
    )
    log_completions_hub_repo: str | None = _only(
        None, why="completions go to output_dir/completions.jsonl, uploaded with output_dir by push_to_hub."
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "TRL's deprecated name of vllm_importance_sampling_clip_max; sets it."}
    )

    def apply_trl_aliases(self) -> None:
        """Read TRL's deprecated names as the fields they became, as TRL does; say once what runs instead of a
        `NOTED_TRAINING` field that is set, and unset it."""
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        for name, what in NOTED_TRAINING.items():
            if getattr(self, name, False):
                if int(os.environ.get("RANK", "0")) == 0:
                    print(f"colograd: note: {name}: {what}.", file=sys.stderr, flush=True)
                setattr(self, name, False)  # transformers' Trainer would import the kernels, minutes in


# Fields of TRL's GRPOConfig colograd implements with TRL's meaning but a different default, and why.
DIFFERENT_DEFAULTS: dict[str, str] = {
    "vllm_gpu_memory_utilization": "None (TRL: 0.3): the engine's KV cache is sized to the rollout, not to a share "
    "of the GPU, leaving the rest to training; set it to have vLLM fill that share",
    "vllm_importance_sampling_correction": "off (TRL: on): with the engine in the trainer's dtype the two compute "
    "the same probabilities (gap ~1e-6 in fp32), so there is nothing to correct; it turns itself on where they "
    "differ (vllm_dtype), and is opt-in otherwise (docs/throughput.md)",
    "vllm_importance_sampling_mode": "token_truncate (TRL: sequence_mask); it matters only with the correction on",
}
# `TrainingArguments` fields whose default TRL's GRPOConfig changes, where colograd's differs from TRL's, and why.
DIFFERENT_TRAINING_DEFAULTS: dict[str, str] = {
    "bf16": "False (TRL: None, which becomes True): an fp32 trainer and engine compute the same log-probs, so "
    "sampling needs no correction; set bf16: true for speed (the engine follows)",
    "gradient_checkpointing": "False (TRL: True): colograd bounds a pass's activations by splitting micro-steps "
    "into token-bounded passes (micro_batch_tokens) and computing log-probs in chunks, instead of recomputing "
    "every forward; set it for sequences whose single pass does not fit",
    "logging_steps": "1 (TRL: 10): a GRPO step is a whole rollout and update, and its reward, length and phase "
    "times are read step by step",
    "remove_unused_columns": "True here as in TrainingArguments, but always set to False at construction, which "
    "is TRL's default: the reward functions read the dataset's other columns",
}


# TRL 1.16's `GRPOTrainer.__init__` parameters, in its order (colograd's take the same order, then its own
# `recipe` and `tool_call_parser`), and how colograd takes each.
TRAINER_PARAMETERS: dict[str, str] = {
    "model": "a model (a `PeftModel` too), or a hub id or local folder, loaded with `model_init_kwargs`",
    "reward_funcs": "functions (sync or async), sequence-classification reward models (or their hub id or "
    "folder), built-in names, dotted paths; None where an environment's `get_reward` gives the reward",
    "args": "colograd's `GRPOConfig`; None: its defaults, with `output_dir` `<model name>-GRPO`",
    "train_dataset": "a `Dataset` or `IterableDataset` with a `prompt` column; None where one environment_factory "
    "gives the prompts (`reset()`), with `max_steps`",
    "eval_dataset": "one in-memory `Dataset`, evaluated every `eval_steps` (a dict of datasets is refused)",
    "processing_class": "the tokenizer (a vision-language model: its processor); None: loaded from the model's name",
    "reward_processing_classes": "the tokenizer of each reward model in `reward_funcs` (None: loaded from its name)",
    "callbacks": "extra `TrainerCallback`s",
    "optimizers": "an optimizer and a scheduler instead of the Trainer's",
    "quantization_config": "refused (see below)",
    "peft_config": "a PEFT config (LoRA): the model is wrapped with it, as TRL does; `lora_sync` picks how the "
    "engine gets the weights",
    "tools": "functions the model may call (docs/agents.md)",
    "rollout_func": "replaces generation (docs/agents.md)",
    "environment_factory": "makes one environment per completion, or a dict of factories (docs/agents.md)",
}
QUANTIZED = (
    "colograd writes the trained weights into its engine at full precision, which a 4- or 8-bit quantized base "
    "cannot give; train a LoRA adapter (peft_config) over a bf16 base instead"
)
# Parameters accepted only as None; any other value is refused with the reason given.
REFUSED_PARAMETERS: dict[str, str] = {"quantization_config": f"{QUANTIZED}; remove it."}


def check_refused_parameters(**given: Any) -> None:
    """Raise `ConfigError` naming the first parameter of `REFUSED_PARAMETERS` given a value other than None."""
    for name, value in given.items():
        if value is not None:
            raise ConfigError(f"{name}: {REFUSED_PARAMETERS[name]}")


def environment_dataset(train_dataset: Any, environment_factory: Any, args: Any) -> Any:
    """`train_dataset` as TRL 1.16 takes it: required, unless one `environment_factory` gives the prompts (its
    `reset()` returns each rollout's prompt); then, as in TRL, one rollout's rows of an empty user message, drawn
    again every epoch until `max_steps`.

    Raises:
        ConfigError: no dataset without an environment, with several environments (rows route them), or without
            `max_steps`.
    """
    if train_dataset is not None:
        return train_dataset
    if environment_factory is None:
        raise ConfigError("train_dataset is None; pass a Dataset with a 'prompt' column (or an environment_factory).")
    if isinstance(environment_factory, dict):
        raise ConfigError(
            "train_dataset is None with several environments: pass a train_dataset whose 'environment' column "
            "routes each row, or a single environment factory."
        )
    if args.max_steps <= 0:
        raise ConfigError(
            "train_dataset is None (the environment gives the prompts): set max_steps, the run's length."
        )
    rows = args.rollout_prompts
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def refused_fields() -> dict[str, tuple[tuple[Any, ...], str]]:
    """Each field of `TRLOnlyFields`: the values it accepts, and why any other is refused."""
    return {f.name: _REFUSALS[f.metadata["help"]] for f in fields(TRLOnlyFields) if f.metadata["help"] in _REFUSALS}


# `TrainingArguments` fields TRL's GRPO reads for a speed-up that computes the same loss, which colograd gets its
# own way: accepted, with one note saying what runs instead.
NOTED_TRAINING: dict[str, str] = {
    "use_liger_kernel": "TRL's Liger loss (a fused output layer and GRPO loss, Triton kernels for GPUs, the same "
    "objective as the unfused loss) is not used: colograd's loss computes the log-probs a chunk of tokens at a time "
    "(logps_chunk_tokens), so the full logits never exist, which is what Liger saves",
}


def check_refused(config: Any) -> None:
    """Raise `ConfigError` for the first TRL-only field of `config` set to a value colograd does not accept."""
    for name, (accepted, why) in refused_fields().items():
        value = getattr(config, name)
        if value not in accepted:
            raise ConfigError(f"{name}={value!r}: {why}")


# TrainingArguments keys that transformers 5 removed. Those with an exact replacement are read as it (with a
# notice); the others are refused with what to do instead.
RENAMED_KEYS: dict[str, str] = {
    "warmup_ratio": "warmup_steps",  # a warmup_steps below 1 is a fraction of the training steps
    "evaluation_strategy": "eval_strategy",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "no_cuda": "use_cpu",
    "torch_dtype": "dtype",
    "push_to_hub_token": "hub_token",
    "push_to_hub_model_id": "hub_model_id",
}
# Removed keys that had no effect on the Trainer: read and dropped, with a notice. (transformers 5 also removed
# overwrite_output_dir, which colograd keeps with a meaning: see GRPOConfig.) TRL's own removed keys that recipes in
# circulation still carry (open-r1's Codeforces recipe) are read the same way.
DROPPED_KEYS: dict[str, str] = {
    "vllm_device": "TRL's old key for the vLLM server's device (TRL has since removed it); colograd's engine runs in "
    "each training process, on that process's device",
}
REMOVED_KEYS: dict[str, str] = {
    "logging_dir": "transformers 5 removed it; set the TENSORBOARD_LOGGING_DIR environment variable instead.",
    "save_safetensors": "transformers 5 removed it (checkpoints are always safetensors); remove it.",
    "use_mps_device": "transformers 5 removed it (MPS is used when available); remove it.",
    "use_ipex": "transformers 5 removed it; remove it.",
}


def unknown_key_message(key: str, known: list[str]) -> str:
    """One line for a recipe key or flag no dataclass has: what transformers 5 made of it, or the closest key."""
    if key in REMOVED_KEYS:
        return f"{key}: {REMOVED_KEYS[key]}"
    if key in DROPPED_KEYS:
        return f"{key}: {DROPPED_KEYS[key]}; remove it."
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "see docs/reference.md for the keys colograd knows."
    return f"unknown option {key!r}: {hint}"


def trl_compat_table() -> str:
    """Markdown: how many of TRL's GRPOConfig fields colograd implements and refuses, and each refusal's reason."""
    import trl
    from transformers import TrainingArguments

    base = {f.name for f in fields(TrainingArguments)}
    trl_names = [f.name for f in fields(trl.GRPOConfig) if f.name not in base]
    refused = {name: entry for name, entry in refused_fields().items() if name in trl_names}
    rows = [
        f"Of TRL {trl.__version__}'s {len(trl_names)} `GRPOConfig` fields (those of `TrainingArguments` aside), "
        f"colograd implements {len(trl_names) - len(refused)} with TRL's meaning and accepts {len(refused)} only at "
        "the values below, refusing any other with the reason given.",
        "",
        "| TRL field | Accepted | Any other value is refused because |",
        "|---|---|---|",
    ]
    for name, (accepted, why) in refused.items():
        rows.append(f"| `{name}` | {', '.join(f'`{a!r}`' for a in accepted)} | {why} |")
    rows += ["", "| Field | Default here, and TRL's |", "|---|---|"]
    differing = DIFFERENT_DEFAULTS | DIFFERENT_TRAINING_DEFAULTS
    rows += [f"| `{name}` | {why} |" for name, why in differing.items()]
    rows += [f"| `{name}` | accepted, with a note: {what} |" for name, what in NOTED_TRAINING.items()]
    rows += ["", "| `GRPOTrainer` parameter (TRL's order) | Taken as |", "|---|---|"]
    taken = TRAINER_PARAMETERS | {name: f"refused: {why}" for name, why in REFUSED_PARAMETERS.items()}
    rows += [f"| `{name}` | {how} |" for name, how in taken.items()]
    return "\n".join(rows)


class _FromArgs:
    """A trainer attribute that TRL's GRPOTrainer copies from its config (`self.temperature = args.temperature`),
    read from the config instead, so that it never goes stale; `field` names the config field when it differs."""

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.args, self.field)


class TRLTrainerAttributes:
    """The attributes TRL's tests and helpers read on a GRPOTrainer (`trainer.temperature`, `trainer.use_vllm`, ...),
    with TRL's values."""

    temperature = _FromArgs()
    top_p = _FromArgs()
    top_k = _FromArgs()
    min_p = _FromArgs()
    repetition_penalty = _FromArgs()
    max_completion_length = _FromArgs()
    num_generations = _FromArgs()
    num_generations_eval = _FromArgs()
    num_iterations = _FromArgs()
    beta = _FromArgs()
    loss_type = _FromArgs()
    scale_rewards = _FromArgs()
    importance_sampling_level = _FromArgs()
    mask_truncated_completions = _FromArgs()
    off_policy_mask_threshold = _FromArgs()
    epsilon_low = _FromArgs("epsilon")
    vllm_importance_sampling_correction = _FromArgs()
    vllm_importance_sampling_mode = _FromArgs()
    vllm_importance_sampling_clip_min = _FromArgs()
    vllm_importance_sampling_clip_max = _FromArgs()
    vllm_tensor_parallel_size = _FromArgs()
    vllm_gpu_memory_utilization = _FromArgs()
    chat_template_kwargs = _FromArgs()
    num_completions_to_print = _FromArgs()
    max_tool_calling_iterations = _FromArgs()
    shuffle_dataset = _FromArgs()
    log_unique_prompts = _FromArgs()
    log_multimodal = _FromArgs()
    multi_objective_aggregation = _FromArgs()
    entropy_coef = _FromArgs()
    top_entropy_quantile = _FromArgs()
    use_adaptive_entropy = _FromArgs()
    pad_to_multiple_of = _FromArgs()
    use_transformers_continuous_batching = _FromArgs()
    # What colograd always does: generate with its colocated engine. A dense model has no router loss; the trainer
    # sets these two for a Mixture-of-Experts model (`colograd.forward.router`).
    use_vllm = True
    vllm_mode = "colocate"
    aux_loss_enabled = False
    router_aux_loss_coef = 0.0

    @property
    def epsilon_high(self) -> float:
        """TRL's upper clip: `epsilon_high`, else `epsilon`."""
        return self.args.epsilon_high if self.args.epsilon_high is not None else self.args.epsilon
