"""Dataset options that open-r1's GRPO recipes use, with open-r1's names and meanings."""

from dataclasses import dataclass, field


@dataclass
class PromptOptions:
    """Which column holds the prompts, and a system prompt to put before each."""

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
