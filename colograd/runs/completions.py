"""A sample of what the policy writes: prompts, completions, rewards and advantages, printed, kept as JSONL and,
with `report_to` wandb or trackio, logged to their `completions` table as TRL logs it (a vision-language rollout's
images too, with `log_multimodal`).

Only the first rank logs, from its own rollout: a rank's rollout is already a sample of the global batch,
and gathering every rank's text to one process is the single-controller traffic this design avoids.
"""

import json
import math
import os
from types import ModuleType
from typing import Any

import pandas as pd
from trl.trainer.utils import print_prompt_completions_sample


class CompletionLog:
    """Appends rollouts to `<output_dir>/completions.jsonl`, prints a table of the first completions, and logs the
    step's first rollout as a `completions` table to the trackers of `report_to` that have one (wandb, trackio).

    One JSON object per completion: ``step``, ``prompt``, ``completion``, ``rewards`` (one value per reward
    function, null where it abstained), ``reward`` (the weighted total), ``advantage``, ``extra`` when reward
    functions added columns with TRL's `log_extra`, and ``image_sizes`` when the rollout's images are logged: the
    [width, height] of each image its prompt showed, [] for a text-only row. The images themselves go to the
    trackers' table (an ``image`` column, as TRL's), not into the file.

    Args:
        output_dir: where `completions.jsonl` is written.
        num_to_print: completions printed per step (the first ones, so whole groups show together); None: all.
        unique_prompts: print and log to the trackers each distinct prompt once, with its first completion
            (TRL's `log_unique_prompts`).
        report_to: the run's trackers (`TrainingArguments.report_to`).
    """

    FILE_NAME = "completions.jsonl"

    def __init__(
        self, output_dir: str, num_to_print: int | None, unique_prompts: bool = False, report_to: list[str] = ()
    ) -> None:
        self.path = os.path.join(output_dir, self.FILE_NAME)
        self.num_to_print = num_to_print
        self.unique_prompts = unique_prompts
        self.report_to = list(report_to)
        self._printed_step: int | None = None

    def forget_after(self, step: int) -> None:
        """Drop the rows of steps after `step`: a run resumed from that step's checkpoint logs them again."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        # Rewritten beside the log and renamed over it, so an interruption leaves the old log whole.
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    def record(
        self,
        step: int,
        prompts: list[Any],
        completions: list[Any],
        rewards: dict[str, list[float]],
        total: list[float],
        advantages: list[float],
        extra: dict[str, list] | None = None,
        images: list[list[Any]] | None = None,
    ) -> None:
        """Log one rollout of optimizer step `step`; every list but `prompts` and `images` (one per group) has one
        value per completion, as has each column of `extra` (what reward functions added with `log_extra`; a column
        with another count is left out). `images` holds each prompt's images (PIL; [] for a text-only row), or is
        None to log none. With gradient accumulation a step has several rollouts: all are written, the first
        printed and sent to the trackers."""
        extra = {k: v for k, v in (extra or {}).items() if len(v) == len(completions)}
        group = len(completions) // len(prompts)
        prompt_per_completion = [prompts[i // group] for i in range(len(completions))]
        # A rollout of text-only rows has no image to log: its rows and table stay as a text model's.
        image_per_completion = (
            [images[i // group] for i in range(len(completions))] if images and any(images) else None
        )
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            for i, completion in enumerate(completions):
                row = {
                    "step": step,
                    "prompt": prompt_per_completion[i],
                    "completion": completion,
                    "rewards": {name: _finite(values[i]) for name, values in rewards.items()},
                    "reward": _finite(total[i]),
                    "advantage": _finite(advantages[i]),
                    **({"extra": {column: values[i] for column, values in extra.items()}} if extra else {}),
                }
                if image_per_completion is not None:
                    row["image_sizes"] = [list(image.size) for image in image_per_completion[i]]
                f.write(json.dumps(row) + "\n")
        if self._printed_step == step:
            return
        self._printed_step = step
        rows = first_of_each_prompt(prompt_per_completion) if self.unique_prompts else range(len(completions))
        table = {
            "step": [step] * len(rows),
            "prompt": [prompt_per_completion[i] for i in rows],
            "completion": [completions[i] for i in rows],
            **{name: [values[i] for i in rows] for name, values in rewards.items()},
            **{column: [values[i] for i in rows] for column, values in extra.items()},  # before advantage, as TRL's
            "advantage": [advantages[i] for i in rows],
        }
        for tracker in trackers(self.report_to):
            columns = table
            if image_per_completion is not None:  # TRL's `image` column, last: the tracker's own image objects
                columns = table | {"image": [[tracker.Image(im) for im in image_per_completion[i]] for i in rows]}
            tracker.log({"completions": tracker.Table(dataframe=pd.DataFrame(columns))})
        shown = rows[: self.num_to_print]  # a slice up to None keeps all
        print_prompt_completions_sample(
            [prompt_per_completion[i] for i in shown],
            [completions[i] for i in shown],
            {name: [values[i] for i in shown] for name, values in rewards.items()},
            [advantages[i] for i in shown],
            step,
        )


def first_of_each_prompt(prompts: list[Any]) -> list[int]:
    """Indices of the first completion of each distinct prompt (compared by text: chats are lists of dicts), as
    TRL's `log_unique_prompts` keeps them."""
    first: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        first.setdefault(str(prompt), i)
    return list(first.values())


def trackers(report_to: list[str]) -> list[ModuleType]:
    """The trackers of `report_to` that take tables, as TRL picks them: wandb when its run was started (by the
    Trainer's callback, on the main process), trackio."""
    found = []
    if "wandb" in report_to:
        import wandb  # imported only when asked for: it takes seconds

        if wandb.run is not None:
            found.append(wandb)
    if "trackio" in report_to:
        import trackio

        found.append(trackio)
    return found


def _finite(value: float) -> float | None:
    """JSON has no NaN: a reward function that abstained is written as null."""
    return None if math.isnan(value) else value
