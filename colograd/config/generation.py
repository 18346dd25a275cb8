"""Generation: the rollout's size, the prompt and completion lengths, sampling, and tool calls (TRL's names and
meanings)."""

import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from colograd.errors import ConfigError, keyword_arguments


@dataclass
class GenerationOptions:
    """How many completions are sampled per prompt and per rollout, how long they may be, how they are sampled
    (the filters, and the keyword arguments passed on to the engine and to the chat template), and how many tool
    calls a completion may make."""

    num_generations: int = field(
        default=8,
        metadata={
            "help": "Completions sampled per prompt (the group size G). At least 2. The rollout over all ranks, "
            "per_device_train_batch_size × processes × steps_per_generation completions, must be a multiple of it "
            "(TRL's rule); a group may span micro-steps, and ranks (as in TRL)."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions sampled per prompt when evaluating (eval_strategy). None: num_generations."},
    )
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
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Drop tokens whose probability is below min_p × that of the likeliest token (0 to 1; typical "
            "0.01-0.2). None disables."
        },
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "vLLM repetition penalty; 1.0 disables."})
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'Further keyword arguments of the engine\'s vllm.SamplingParams (e.g. {"stop": ["</answer>"]}). '
            "Keys that have a config field (temperature, top_p, ...) are set there; n, logprobs and seed are the "
            "trainer's."
        },
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
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Most model turns that may call tools per completion; None: no limit (TRL's meaning)."},
    )
    tool_timeout: float = field(
        default=60.0,
        metadata={"help": "Seconds a turn's tool calls may take; past it the model reads a timeout error."},
    )

    def check_generation(self) -> None:
        """Parse JSON given on the command line; check the ranges and the SamplingParams keys."""
        for name in ("generation_kwargs", "chat_template_kwargs"):
            setattr(self, name, keyword_arguments(name, getattr(self, name)))
        if self.generation_kwargs:
            _check_sampling_keys(self.generation_kwargs)

    def derive_generation_batch(self) -> None:
        """Fill in whichever of steps_per_generation / generation_batch_size was left out (TRL's rule), then check
        that the rollout over all ranks holds whole groups (`check_rollout_groups`)."""
        global_batch = self.per_device_train_batch_size * self.world_size
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError("steps_per_generation and generation_batch_size are both set; set only one of them.")
        given = "steps_per_generation" if self.steps_per_generation is not None else "gradient_accumulation_steps"
        if self.generation_batch_size is not None:
            if self.generation_batch_size % global_batch:
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} is not a multiple of "
                    f"per_device_train_batch_size × processes = {global_batch}; set it to a multiple of it."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
            given = "generation_batch_size"
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        self.generation_batch_size = global_batch * self.steps_per_generation
        self.rollout_size_given = given  # not a field: which one a fix should name
        self.check_rollout_groups(given)

    def check_rollout_groups(self, given: str) -> None:
        """TRL's rule: the rollout over all ranks, generation_batch_size = per_device_train_batch_size × processes ×
        steps_per_generation completions, must hold whole groups. A rank's rollout (per_device_train_batch_size ×
        steps_per_generation) need not: then groups span ranks (`groups_span_ranks`), as in TRL, and a micro-step's
        slice may hold part of a group either way.

        Args:
            given: the field the user set that fixed steps_per_generation (steps_per_generation,
                generation_batch_size, or gradient_accumulation_steps when it defaulted to it); the fix names it.
        """
        batch, steps, g, world = (
            self.per_device_train_batch_size,
            self.steps_per_generation,
            self.num_generations,
            self.world_size,
        )
        if batch * world * steps % g == 0:
            return
        # The nearest larger value of one field that makes the rollout whole groups (the other kept).
        fixed_steps = _round_up(steps, g // math.gcd(batch * world, g))
        fixed_batch = _round_up(batch, g // math.gcd(world * steps, g))
        if given == "generation_batch_size":  # the rollout's size is given, so only it can change
            fix = f"set generation_batch_size to {batch * world * fixed_steps}"
        else:
            fix = f"set {given} to {fixed_steps}, or per_device_train_batch_size to {fixed_batch}"
        size = f"per_device_train_batch_size={batch} × steps_per_generation={steps}"
        if world == 1:
            size += f" = {batch * steps} completions per rank and rollout"
        else:
            size += f" × {world} processes = {batch * steps * world} completions per rollout"
        raise ConfigError(f"{size} is not a multiple of num_generations={g}; {fix}.")

    def check_spanning_groups(self) -> None:
        """Where groups span ranks (`groups_span_ranks`), refuse what needs each rank to hold whole groups, naming
        the nearest batch that gives each rank whole groups."""
        if not self.groups_span_ranks:
            return
        g = self.num_generations
        needs = [
            ("dynamic_sampling", self.dynamic_sampling, "it keeps or drops a rank's groups whole"),
            ("partial_rollouts", self.partial_rollouts, "it carries a rank's unfinished groups whole"),
            ("vllm_tensor_parallel_size", self.vllm_tensor_parallel_size > 1, "its ranks pool whole groups"),
        ]
        for name, used, why in needs:
            if used:
                raise ConfigError(
                    f"{name} needs each rank's rollout to hold whole groups ({why}), and {self.rank_rollout_size()} "
                    f"completions is not a multiple of num_generations={g}; {self.whole_rank_groups_fix()}, or turn "
                    f"{name} off."
                )

    def rank_rollout_size(self) -> str:
        """A rank's rollout, in the fields that set it (for messages)."""
        batch, steps = self.per_device_train_batch_size, self.steps_per_generation
        if getattr(self, "rollout_size_given", None) == "generation_batch_size":
            given = f"generation_batch_size={self.generation_batch_size}"
            return f"{given} / {self.world_size} processes = {batch * steps}"
        return f"per_device_train_batch_size={batch} × steps_per_generation={steps} = {batch * steps}"

    def whole_rank_groups_fix(self) -> str:
        """The nearest larger setting that gives each rank's rollout whole groups, in the field the user set: a
        generation_batch_size given is the only one that can change (steps_per_generation beside it is refused)."""
        batch, steps, g, world = (
            self.per_device_train_batch_size,
            self.steps_per_generation,
            self.num_generations,
            self.world_size,
        )
        if getattr(self, "rollout_size_given", None) == "generation_batch_size":
            per_rank = _round_up(batch * steps, batch * g // math.gcd(batch, g))  # whole micro-steps, whole groups
            return f"set generation_batch_size to {per_rank * world}"
        fixed_steps = _round_up(steps, g // math.gcd(batch, g))
        fixed_batch = _round_up(batch, g // math.gcd(steps, g))
        return f"set steps_per_generation to {fixed_steps} or per_device_train_batch_size to {fixed_batch}"

    @property
    def groups_span_ranks(self) -> bool:
        """Whether a group's completions may fall on two ranks: a rank's rollout (per_device_train_batch_size ×
        steps_per_generation completions) is not whole groups, though the rollout over all ranks is. Then, as in
        TRL, every rank reads the rollout's prompts, samples its contiguous slice of the sequence of all ranks'
        completions (each prompt's G laid consecutively), and group statistics are taken over every rank's rewards."""
        return self.per_device_train_batch_size * self.steps_per_generation % self.num_generations != 0

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
    def rollout_prompts(self) -> int:
        """Prompts of one rollout over all ranks: generation_batch_size / num_generations."""
        return self.generation_batch_size // self.num_generations

    @property
    def prompts_per_rollout(self) -> int:
        """Prompts each rank reads per rollout: per_device_train_batch_size counts completions, and a rollout feeds
        steps_per_generation micro-steps (a micro-step's slice may end inside a group). Where groups span ranks,
        every rank reads all the rollout's prompts (`rollout_prompts`) and samples its own slice of their
        completions (`colograd.rollout.spans`)."""
        if self.groups_span_ranks:
            return self.rollout_prompts
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations


def _round_up(value: int, step: int) -> int:
    """The smallest multiple of `step` that is at least `value`."""
    return -(-value // step) * step


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
