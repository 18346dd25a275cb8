"""The policy a run trains, made ready before the Trainer wraps it: loaded from its name when given one, wrapped in a
new adapter with a PEFT config, dropout off, a vision-language model's image encoder frozen, a recipe's chat template,
and a pad token."""

from typing import Any

from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from colograd.config.core import GRPOConfig
from colograd.config.loading import disable_dropout, model_init_kwargs, tokenizer_kwargs, wrap_with_peft
from colograd.engine.sync import WeightPlan, is_sharded
from colograd.vision.core import freeze_vision_tower, load_pretrained, text_tokenizer


def prepare_policy(
    model: PreTrainedModel | str, processing_class: Any, args: GRPOConfig, peft_config: Any = None
) -> tuple[PreTrainedModel, Any]:
    """The model and its processing class as training takes them.

    Args:
        model: a model, or a hub id / local path to load one from (`model_init_kwargs` apply).
        processing_class: its tokenizer or processor; loaded from the model's path when None.
        args: the run's config (`disable_dropout`, `freeze_vision_tower`, the loading options).
        peft_config: a PEFT config: the model is wrapped with a new adapter (`wrap_with_peft`), as TRL does.

    Returns:
        The model (a `PeftModel` with `peft_config`) and the processing class, whose tokenizer has a pad token (its
        end-of-sequence token where it had none).
    """
    if isinstance(model, str):
        model = load_pretrained(model, AutoModelForCausalLM, **model_init_kwargs(args))
    if processing_class is None:
        processing_class = load_pretrained(model, AutoTokenizer, **tokenizer_kwargs(args))
    if peft_config is not None:
        model = wrap_with_peft(model, peft_config, args)
    if args.disable_dropout:
        disable_dropout(model)
    if args.freeze_vision_tower:
        freeze_vision_tower(model)
    tokenizer = text_tokenizer(use_chat_template(processing_class, args.chat_template))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, processing_class


def use_chat_template(processing_class: Any, template: str | None) -> Any:
    """`processing_class` with `template` (open-r1's `chat_template`) as its chat template, and its tokenizer's,
    where one is given: prompts are rendered with it, and the saved tokenizer keeps it."""
    if template is not None:
        processing_class.chat_template = template
        text_tokenizer(processing_class).chat_template = template
    return processing_class


def weight_plan(model: nn.Module, bucket_mib: float, lora_rank: int | None) -> WeightPlan:
    """How `model`'s weights go into the engine at each sync (`WeightPlan`): the adapter alone where the engine applies
    it (`lora_rank`), else every weight; gathered (sharded) or built (merged LoRA) weights take memory, so those go
    `bucket_mib` at a time."""
    builds = is_sharded(model) or (isinstance(model, PeftModel) and lora_rank is None)
    return WeightPlan(model, int(bucket_mib * 2**20) if builds else None, adapter_only=lora_rank is not None)
