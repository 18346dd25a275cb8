"""Model and data loading options, with TRL's `GRPOConfig` names and meanings."""

from dataclasses import dataclass, field
from typing import Any

import torch
from peft import PeftConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel, set_seed

from colograd.config.trl_compat import QUANTIZED
from colograd.errors import ConfigError, keyword_arguments


@dataclass
class LoadingOptions:
    """How the policy is loaded and prepared, and how the training prompts are drawn."""

    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for AutoModelForCausalLM.from_pretrained when the model is given by name "
            '(they override the model arguments, e.g. {"dtype": "bfloat16"}). Its revision also picks the '
            "tokenizer's."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models and tokenizers that ship their own Python code to run it when loaded."},
    )
    disable_dropout: bool = field(
        default=False,
        metadata={
            "help": "Set every dropout probability of the policy to 0 (its Dropout layers, as TRL does, and every "
            "dropout a family applies as a function under a name of its own: attention, hidden, residual, "
            "activation), so that its log-probs are deterministic and equal to the engine's."
        },
    )
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "Shuffle the training prompts (each epoch); False keeps the dataset order."}
    )

    def check_loading(self) -> None:
        """Parse `model_init_kwargs` given as JSON on the command line; refuse a quantized base."""
        self.model_init_kwargs = keyword_arguments("model_init_kwargs", self.model_init_kwargs)
        if "quantization_config" in (self.model_init_kwargs or {}):
            raise ConfigError(f"model_init_kwargs: quantization_config: {QUANTIZED}; remove it.")


def model_init_kwargs(args: LoadingOptions) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained` of the policy: `model_init_kwargs` and `trust_remote_code`."""
    return {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}


def tokenizer_kwargs(args: LoadingOptions) -> dict[str, Any]:
    """Keyword arguments for the tokenizer's `from_pretrained`: the model's revision, as TRL reads it."""
    revision = (args.model_init_kwargs or {}).get("revision")
    return {"trust_remote_code": args.trust_remote_code, **({"revision": revision} if revision else {})}


def model_name(model: PreTrainedModel | str) -> str:
    """The last part of a model's hub id or folder (TRL's default output_dir is `<this>-GRPO`)."""
    name = model if isinstance(model, str) else model.config._name_or_path
    return name.rstrip("/").split("/")[-1] or type(model).__name__


def wrap_with_peft(model: PreTrainedModel, peft_config: Any, args: Any) -> PeftModel:
    """The policy with a new PEFT adapter (TRL's `peft_config`, the command line's `use_peft`), as TRL makes it.

    Args:
        model: the base model; it must not have an adapter already.
        peft_config: a `peft.PeftConfig`, e.g. `LoraConfig(r=16, target_modules="all-linear")`.
        args: the run's config (seed, DeepSpeed, gradient checkpointing).

    Raises:
        ConfigError: not a PEFT config; the model has an adapter already; the adapter does not fit the model
            (e.g. target modules it does not have).
    """
    if not isinstance(peft_config, PeftConfig):
        raise ConfigError(
            f"peft_config is a {type(peft_config).__name__}; give a peft.PeftConfig such as peft.LoraConfig(r=16)."
        )
    if isinstance(model, PeftModel):
        raise ConfigError(
            "peft_config was given with a model that has an adapter already (a PeftModel); pass its base model, or "
            "no peft_config to train the adapter it has."
        )
    set_seed(args.seed)  # PEFT initialises the adapter at random: the same adapter on every rank and every run
    kwargs = {}
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        # ZeRO-3 gathers parameters in buckets of one dtype: adapters stay in the base model's dtype, as in TRL.
        kwargs["autocast_adapter_dtype"] = False
    try:
        model = get_peft_model(model, peft_config, **kwargs)
    except ValueError as err:  # e.g. target modules the model does not have
        raise ConfigError(f"peft_config: {str(err).splitlines()[0]}") from err
    if args.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed layers over a frozen embedding need inputs with grad
    return model


def disable_dropout(model: nn.Module) -> None:
    """`disable_dropout`: every dropout of `model` gets p=0. TRL's `disable_dropout_in_model` zeroes the `nn.Dropout`
    layers only; many architectures apply dropout as a function with a probability a module keeps under a name of its
    own (`attention_dropout`, `hidden_dropout`, `residual_dropout`, `resid_pdrop`, ...) or reads from its config at
    each forward. So every float a module or the model's config (and its sub-configs) holds under a name with
    `dropout` or `pdrop` in it is set to 0 too, whatever the family calls it. (The saved config then says 0.)"""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        _zero_dropout_fields(vars(module))
    for config in _configs(getattr(model, "config", None)):
        _zero_dropout_fields(vars(config))


def compute_dtype(model: nn.Module, mixed_precision: str | None) -> torch.dtype:
    """The dtype the model computes in: autocast's under `mixed_precision` bf16 / fp16, else its weights'."""
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "")
    return autocast or next(model.parameters()).dtype


def dropouts_in_use(model: nn.Module) -> list[str]:
    """Where `model`, in training, applies dropout: each `nn.Dropout` with p > 0 (PEFT's `lora_dropout` among them) and
    each dropout probability above 0 a module holds under a name of its own (those `disable_dropout` zeroes), as
    "module (p)". A config's own fields are not read: families copy onto their modules what they apply, and configs
    carry probabilities of heads a causal LM never runs."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            found.append(f"{name} ({module.p:g})")
        prefix = f"{name}." if name else ""
        found += [f"{prefix}{field} ({value:g})" for field, value in _dropout_fields(vars(module)) if value > 0]
    return found


def _dropout_fields(fields: dict) -> list[tuple[str, float]]:
    return [
        (name, value)
        for name, value in fields.items()
        if isinstance(value, float) and not isinstance(value, bool) and ("dropout" in name or "pdrop" in name)
    ]


def _zero_dropout_fields(fields: dict) -> None:
    for name, _ in _dropout_fields(fields):
        fields[name] = 0.0


def _configs(config: Any) -> list[Any]:
    """`config` and the configs it holds (a vision-language model's text and vision configs), each once."""
    from transformers import PretrainedConfig

    found: list[Any] = []
    stack = [config]
    while stack:
        current = stack.pop()
        if isinstance(current, PretrainedConfig) and all(current is not c for c in found):
            found.append(current)
            stack.extend(v for v in vars(current).values() if isinstance(v, PretrainedConfig))
    return found
