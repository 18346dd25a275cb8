"""Dataset options beyond the training split: TRL's evaluation split and streaming, and open-r1's prompt column
and system prompt, with their names and meanings."""

from dataclasses import dataclass, field


@dataclass
class PromptOptions:
    """Which column holds the prompts, a system prompt to put before each, the split to evaluate on, and whether
    the training split is streamed."""

    dataset_test_split: str = field(
        default="test",
        metadata={"help": "The split evaluated on every eval_steps when eval_strategy is set (TRL's name)."},
    )

    dataset_prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "The column holding the prompts. With another column than 'prompt', or with system_prompt, "
            "each prompt becomes a chat: the system prompt (if any), then the column's text as the user's turn."
        },
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "A system message put before every prompt (which then becomes a chat)."}
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream the training split (datasets' streaming=True): rows are read as training goes, never "
            "all held or downloaded first. Needs max_steps; preflight checks the first rows. The eval split is "
            "read whole."
        },
    )
