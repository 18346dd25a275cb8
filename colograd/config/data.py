"""Data and rewards: what `colograd/train.py` trains on (TRL's script arguments, open-r1's prompt column and system
prompt, with their names and meanings)."""

from dataclasses import dataclass, field

from colograd.config.open_r1 import OpenR1ScriptFields
from colograd.config.ranges import check_ranges


@dataclass
class ScriptArguments(OpenR1ScriptFields):
    """The dataset, its splits and prompt column, and the reward functions (open-r1's reward parameters are its
    base's fields)."""

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
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "The split evaluated on every eval_steps when eval_strategy is set (TRL's name)."},
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream the training split (datasets' streaming=True): rows are read as training goes, never "
            "all held or downloaded first. Needs max_steps; preflight checks the first rows. The eval split is "
            "read whole."
        },
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
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions (None: 'letters', the built-in dataset's, unless reward_model_name_or_path is "
            "set): built-in names, with their ecosystem's meanings (open-r1's: accuracy, format, "
            "tag_count, reasoning_steps, cosine, repetition_penalty, length, code, binary_code, code_format, "
            "soft_overlong_punishment; TRL's: accuracy_reward, think_format_reward, reasoning_accuracy_reward, "
            "get_soft_overlong_punishment; see docs/porting-trl.md), dotted paths to functions "
            "(my_pkg.rewards.length), or a sequence-classification reward model (a local folder or hub id)."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "TRL's script: a sequence-classification reward model (hub id or local folder), put before "
            "reward_funcs' functions."
        },
    )
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={"help": "TRL's script argument for its DPO script; its GRPO script does not read it. No effect."},
    )
    code_sandbox: str = field(
        default="namespaces",
        metadata={
            "help": "How the code rewards (code, binary_code) run the completions' programs: 'namespaces', the "
            "sandbox (no network, no view of the machine's files, processes or environment; refuses to start where "
            "the namespaces are missing), or 'none': no isolation beyond rlimits and a temporary folder, for "
            "trusted code only (docs/rewards.md)."
        },
    )
    code_output_lines: str = field(
        default="all",
        metadata={
            "help": "How the code rewards compare a program's output with a stdin/stdout case's expected output, line "
            "by line, each stripped: 'all' lines (their counts must agree), or 'shorter': open-r1's comparison, over "
            "the shorter of the two, which a program printing only the first expected line passes (for comparisons "
            "with open-r1's numbers; gameable)."
        },
    )
    code_checker: str = field(
        default="lines",
        metadata={
            "help": "How the code rewards compare a stdin/stdout case's output: 'lines' (with code_output_lines), "
            "'tokens' (whitespace-separated tokens, line breaks free: Codeforces' and CodeContests' default "
            "checker), 'tokens_nocase' (the same, case ignored: YES / yes), or 'float' (tokens, numbers equal within "
            "code_float_tolerance, absolute or relative: testlib's real-number checkers)."
        },
    )
    code_float_tolerance: float = field(
        default=1e-6, metadata={"help": "code_checker 'float': the absolute or relative tolerance of a number."}
    )
    code_cases: str = field(
        default="all",
        metadata={
            "help": "Which of a row's stdin/stdout cases the code rewards run: 'all' (the default), every case that "
            "can change the reward (open-r1's and TRL's code_reward: code is the fraction passed; binary_code stops "
            "once it cannot pass), or 'first_failure', in order until one fails (the rest count as failed and never "
            "run: a judge's verdict; code is then the share passed before the first failure)."
        },
    )
    drop_invalid_prompts: bool = field(
        default=False,
        metadata={
            "help": "Drop dataset rows whose prompt is invalid (empty, malformed messages, nothing after "
            "tokenizing), and print how many, instead of stopping with an error that names the first."
        },
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        self.apply_open_r1()
        if self.reward_funcs is None:
            self.reward_funcs = [] if self.reward_model_name_or_path else ["letters"]
        if self.reward_model_name_or_path:  # first, as TRL's script puts it
            self.reward_funcs = [self.reward_model_name_or_path, *self.reward_funcs]
