"""Model and data loading options, with TRL's `GRPOConfig` names and meanings."""

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from colograd.errors import keyword_arguments


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
            "help": "Set every dropout probability of the policy to 0 (its Dropout layers, as TRL does, and the "
            "attention dropout that models such as Qwen2 apply as a function), so that its log-probs are "
            "deterministic and equal to the engine's."
        },
    )
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "Shuffle the training prompts (each epoch); False keeps the dataset order."}
    )

    def check_loading(self) -> None:
        """Parse `model_init_kwargs` given as JSON on the command line."""
        self.model_init_kwargs = keyword_arguments("model_init_kwargs", self.model_init_kwargs)


def model_init_kwargs(args: LoadingOptions) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained` of the policy: `model_init_kwargs` and `trust_remote_code`."""
    return {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}


def tokenizer_kwargs(args: LoadingOptions) -> dict[str, Any]:
    """Keyword arguments for the tokenizer's `from_pretrained`: the model's revision, as TRL reads it."""
    revision = (args.model_init_kwargs or {}).get("revision")
    return {"trust_remote_code": args.trust_remote_code, **({"revision": revision} if revision else {})}


def disable_dropout(model: nn.Module) -> None:
    """`disable_dropout`: every `nn.Dropout` of `model` gets p=0, as TRL's `disable_dropout_in_model` does, and so
    does the attention dropout many architectures (Qwen2, Llama) apply as a function with the probability their
    attention module keeps in `attention_dropout`, which TRL's leaves on."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
