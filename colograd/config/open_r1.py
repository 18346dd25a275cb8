"""open-r1's recipe fields (huggingface/open-r1 @ 1416fa0c, `src/open_r1/configs.py`), so that its GRPO recipes run
as it ships them.

open-r1 extends TRL's `GRPOConfig` and `ScriptArguments`. Its fields are taken here with its meanings:
- honoured: `chat_template` (the tokenizer's template), `hub_model_revision` (the branch pushes go to:
  transformers' `hub_revision`), `wandb_entity` / `wandb_project` / `wandb_run_group` (set as WANDB_* variables,
  as open-r1 does), and its reward parameters (`colograd.config.data.OpenR1RewardOptions`).
- accepted with one note, where they name something open-r1's own scripts do and colograd does not: `benchmarks`,
  `callbacks`, `push_to_hub_revision`, `overwrite_hub_revision`, and where its code runs (`code_provider` and its
  router URLs: here, the local sandbox).
- refused in one line: `dataset_mixture`.
"""

import os
import sys
from dataclasses import dataclass, field

from colograd.errors import ConfigError


def open_r1_note(message: str) -> None:
    """One line on stderr from the first rank: what an open-r1 key became here."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"colograd: note: {message}", file=sys.stderr, flush=True)


@dataclass
class OpenR1Fields:
    """open-r1's `GRPOConfig` fields beyond TRL's."""

    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "open-r1: a Jinja chat template that replaces the tokenizer's (prompts are rendered with it, and "
            "the saved tokenizer keeps it). None: the tokenizer's own."
        },
    )
    hub_model_revision: str | None = field(
        default=None,
        metadata={
            "help": "open-r1's name for the hub branch pushes go to: sets hub_revision (the branch is created from "
            "main if missing). None or 'main': the default branch."
        },
    )
    wandb_entity: str | None = field(
        default=None, metadata={"help": "open-r1: the wandb entity (team) runs go under; sets WANDB_ENTITY."}
    )
    wandb_project: str | None = field(
        default=None, metadata={"help": "open-r1: the wandb project runs go under; sets WANDB_PROJECT."}
    )
    wandb_run_group: str | None = field(
        default=None, metadata={"help": "open-r1: the wandb group runs go under; sets WANDB_RUN_GROUP."}
    )
    wandb_log_unique_prompts: bool = field(
        default=True, metadata={"help": "open-r1's field, which its GRPO script does not read; accepted, no effect."}
    )
    benchmarks: list[str] = field(
        default_factory=list,
        metadata={
            "help": "open-r1: benchmarks its Slurm scripts run after training. colograd runs none: accepted with a "
            "note; evaluate the saved model with lighteval."
        },
    )
    callbacks: list[str] = field(
        default_factory=list,
        metadata={
            "help": "open-r1: names of its callbacks (push_to_hub_revision). Accepted with a note: colograd pushes "
            "with hub_strategy, to hub_revision; pass TrainerCallback objects to GRPOTrainer(callbacks=...)."
        },
    )
    push_to_hub_revision: bool = field(
        default=False,
        metadata={"help": "open-r1: its callback's switch. Accepted with a note: pushes follow push_to_hub here."},
    )
    overwrite_hub_revision: bool = field(
        default=False, metadata={"help": "open-r1: its callback's switch. Accepted with a note; no effect here."}
    )

    def apply_open_r1(self) -> None:
        """Read open-r1's fields: the hub branch and wandb's variables set, a note for each that does nothing here."""
        if self.hub_model_revision not in (None, "main"):
            if self.hub_revision not in (None, self.hub_model_revision):
                raise ConfigError(
                    f"hub_model_revision={self.hub_model_revision!r} and hub_revision={self.hub_revision!r} name "
                    "two branches; keep one."
                )
            self.hub_revision = self.hub_model_revision
        for name in ("wandb_entity", "wandb_project", "wandb_run_group"):
            value = getattr(self, name)
            if value is not None:
                os.environ[name.upper()] = value  # open-r1's init_wandb_training does the same
        if self.benchmarks:
            open_r1_note(
                f"benchmarks {', '.join(self.benchmarks)}: open-r1's Slurm scripts run them after training; colograd "
                "does not. Evaluate the saved model with lighteval."
            )
        if self.callbacks or self.push_to_hub_revision or self.overwrite_hub_revision:
            named = ", ".join(self.callbacks) or "push_to_hub_revision"
            strategy = getattr(self.hub_strategy, "value", self.hub_strategy)
            open_r1_note(
                f"open-r1's callbacks ({named}) are not run here: with push_to_hub, checkpoints are pushed as "
                f"hub_strategy={strategy!r} says, to the branch {self.hub_revision or 'main'!r}."
            )


def check_dataset_mixture(mixture: object) -> None:
    """open-r1's `dataset_mixture` is refused in one line: colograd trains on one dataset."""
    if mixture is not None:
        raise ConfigError(
            "dataset_mixture: colograd trains on one dataset; concatenate the mixture's datasets (with datasets' "
            "concatenate_datasets / interleave_datasets) into one and give its path as dataset_name."
        )


@dataclass
class OpenR1ScriptFields:
    """open-r1's `GRPOScriptArguments` fields beyond TRL's: its reward functions' parameters, with its defaults,
    and where its code rewards run."""

    cosine_min_value_wrong: float = field(default=0.0, metadata={"help": "open-r1 `cosine`: wrong answer, shortest."})
    cosine_max_value_wrong: float = field(default=-0.5, metadata={"help": "open-r1 `cosine`: wrong answer, longest."})
    cosine_min_value_correct: float = field(
        default=0.5, metadata={"help": "open-r1 `cosine`: correct answer, longest."}
    )
    cosine_max_value_correct: float = field(
        default=1.0, metadata={"help": "open-r1 `cosine`: correct answer, shortest."}
    )
    cosine_max_len: int = field(
        default=1000, metadata={"help": "open-r1 `cosine`: the length (characters) the cosine spans."}
    )
    repetition_n_grams: int = field(default=3, metadata={"help": "open-r1 `repetition_penalty`: words per n-gram."})
    repetition_max_penalty: float = field(
        default=-1.0, metadata={"help": "open-r1 `repetition_penalty`: the penalty of a wholly repeated completion."}
    )
    code_language: str = field(
        default="python",
        metadata={
            "help": "open-r1 `code_format`: the fenced block's language (a row's `language` column overrides it). "
            "`code` and `binary_code` run Python; `cf_code` reads each row's `language` (python or cpp), as open-r1."
        },
    )
    max_completion_len: int = field(
        default=16384, metadata={"help": "open-r1 `soft_overlong_punishment`: the longest completion, in tokens."}
    )
    soft_punish_cache: int = field(
        default=4096,
        metadata={"help": "open-r1 `soft_overlong_punishment`: the tokens before it over which the penalty grows."},
    )
    code_eval_test_batch_size: int = field(
        default=1,
        metadata={
            "help": "open-r1 `cf_code` / `ioi_code`: test cases Piston ran at once. The score does not depend "
            "on it; accepted for that."
        },
    )
    code_eval_scoring_mode: str = field(
        default="weighted_sum",
        metadata={
            "help": "open-r1 `cf_code`: pass_fail (1 when every test passes), partial (the fraction "
            "passed) or weighted_sum (pass_fail + 0.1 × the fraction)."
        },
    )
    code_provider: str | None = field(
        default=None,
        metadata={
            "help": "open-r1: where `code` runs programs (e2b, morph, local). colograd runs them in its local "
            "sandbox (code_sandbox); any value is accepted with a note."
        },
    )
    parallel_code_exec_per_proc: int = field(
        default=2, metadata={"help": "open-r1: parallel executions on e2b per process. No effect here."}
    )
    e2b_router_url: str | None = field(default=None, metadata={"help": "open-r1: e2b's router. No effect here."})
    morph_router_url: str | None = field(default=None, metadata={"help": "open-r1: Morph's router. No effect here."})
    ioi_provider: str = field(
        default="piston",
        metadata={
            "help": "open-r1 `ioi_code`: where open-r1 ran its grader (piston or morph). Accepted; the "
            "grader runs in colograd's sandbox."
        },
    )
    dataset_mixture: dict | None = field(
        default=None, metadata={"help": "open-r1: a mixture of datasets. Refused: give one dataset (dataset_name)."}
    )

    def apply_open_r1(self) -> None:
        """Refuse a dataset mixture; say once where the code rewards run when open-r1's provider keys are set."""
        check_dataset_mixture(self.dataset_mixture)
        if self.code_provider is not None or self.e2b_router_url or self.morph_router_url:
            open_r1_note(
                f"code_provider={self.code_provider or 'e2b'}: colograd runs the code rewards' programs in its local "
                f"sandbox (code_sandbox={self.code_sandbox}), not on a provider; the router URLs are not read."
            )
