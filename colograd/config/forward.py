"""The training forward pass: packing, shared prompts, token budgets and the output layer's precision."""

from dataclasses import dataclass, field

from colograd.errors import ConfigError


@dataclass
class ForwardOptions:
    """How a micro-step's sequences are laid out and split for the policy's (and reference's) forward and backward
    passes, and how its log-probs are computed."""

    freeze_vision_tower: bool = field(
        default=False,
        metadata={
            "help": "A vision-language model's image encoder (a LLaVA's vision_tower, a Qwen-VL's visual) is not "
            "trained: its parameters get no gradient and no optimizer state; the projector and the language model "
            "still train. Refused for a text model. (colograd's own field: TRL has none.)"
        },
    )
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
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "The output layer computes the training log-probs and entropies in float32, outside autocast, "
            "for the policy and the reference (ScaleRL). Its weights keep their dtype (see docs/reference.md)."
        },
    )

    def check_forward(self) -> None:
        """Read share_prompts as True, False or "auto"."""
        # YAML gives booleans, the command line strings: both become True, False or "auto".
        share = {"auto": "auto", "true": True, "false": False}.get(str(self.share_prompts).lower())
        if share is None:
            raise ConfigError(f"share_prompts={self.share_prompts!r} is unknown; use auto, true or false.")
        self.share_prompts = share
