"""Generation options beyond the basic sampling ones, with TRL's `GRPOConfig` names and meanings."""

import difflib
from dataclasses import dataclass, field
from typing import Any

from colograd.errors import ConfigError, keyword_arguments


@dataclass
class GenerationOptions:
    """Sampling filters and the keyword arguments passed on to the engine and to the chat template."""

    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Drop tokens whose probability is below min_p × that of the likeliest token (0 to 1; typical "
            "0.01-0.2). None disables."
        },
    )
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'Further keyword arguments of the engine\'s vllm.SamplingParams (e.g. {"stop": ["</answer>"]}). '
            "Keys that have a config field (temperature, top_p, ...) are set there; n, logprobs and seed are the "
            "trainer's."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions sampled per prompt when evaluating (eval_strategy). None: num_generations."},
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={
            "help": "Constrain every completion to match this regular expression (vLLM's structured outputs). "
            "None: unconstrained."
        },
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for the tokenizer's apply_chat_template on conversational prompts (e.g. "
            '{"enable_thinking": false}).'
        },
    )

    def check_generation(self) -> None:
        """Parse JSON given on the command line; check the ranges and the SamplingParams keys."""
        for name in ("generation_kwargs", "chat_template_kwargs"):
            setattr(self, name, keyword_arguments(name, getattr(self, name)))
        if self.generation_kwargs:
            _check_sampling_keys(self.generation_kwargs)


# Set by the trainer for every request: n (the group), logprobs (the sampling policy's log-probs), seed (the
# ranks of a tensor-parallel group must sample alike).
_TRAINER_OWNED = ("n", "logprobs", "seed")
# Sampling parameters the config has a field for; training reads some of them too (the temperature), so they are
# set there, once.
_CONFIG_FIELDS = {
    "max_tokens": "max_completion_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def _check_sampling_keys(kwargs: dict[str, Any]) -> None:
    """Refuse keys that vllm.SamplingParams does not have, or that the trainer sets itself."""
    from vllm import SamplingParams  # imported only when needed: importing vllm takes seconds

    known = set(SamplingParams.__struct_fields__)
    for key in kwargs:
        if key in _TRAINER_OWNED:
            raise ConfigError(f"generation_kwargs: {key!r} is set by the trainer; remove it.")
        if key in _CONFIG_FIELDS:
            raise ConfigError(f"generation_kwargs: set {key!r} with the field {_CONFIG_FIELDS[key]} instead.")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see vllm.SamplingParams for its fields."
            raise ConfigError(f"generation_kwargs: vllm.SamplingParams has no {key!r}; {hint}")
