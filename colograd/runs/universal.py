"""A DeepSpeed checkpoint resumed on another number of ranks: DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's shard of the weights and the optimizer state (`global_stepN/zero_pp_rank_R_*`),
and only as many ranks as saved it can load it. DeepSpeed's universal checkpoint holds each parameter's state whole
(`global_stepN_universal/zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt`), and any number of ranks loads it with
`checkpoint.load_universal` set; DeepSpeed's `ds_to_universal` converts the one into the other, for ZeRO stages 1 to 3.

A run resumed on another number of ranks (`colograd.runs.checkpoints.resharded`) has its checkpoint converted once,
by the main process while the others wait: into a folder beside the checkpoint's own (`global_stepN_universal`, with
DeepSpeed's `latest_universal` naming it), whose files the checkpoint's record does not list, so the checkpoint stays
finished and loads as before on its own number of ranks. A conversion cut short leaves only its staging folder,
removed by the next; a finished one is used again. Saves after the resume are ordinary ZeRO checkpoints.

DeepSpeed's universal load for ZeRO-3 (0.19) gives every parameter group the same `step` tensor, which each group's
update then increments: Adam's step count, and so its bias correction, would run ahead by the number of groups
(2 with weight decay: every step counted twice). `SeparateSteps` gives each group its own once the load is done.
"""

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from colograd.config.core import ConfigError

LATEST = "latest"  # DeepSpeed's file naming a checkpoint's tag (its `global_stepN` folder)
LATEST_UNIVERSAL = "latest_universal"  # ... and the universal folder it loads with `checkpoint.load_universal`
_STAGING = "universal.partial"  # where a conversion writes before its folder is moved into place


def universal_tag(checkpoint: str) -> str:
    """The folder name of `checkpoint`'s universal form: its ZeRO tag's, with `_universal`."""
    try:
        with open(os.path.join(checkpoint, LATEST)) as f:
            return f"{f.read().strip()}_universal"
    except OSError:
        raise ConfigError(
            f"{checkpoint} has no DeepSpeed `{LATEST}` file naming its ZeRO state; resume it on the number of ranks "
            "that saved it, or start afresh in another output_dir."
        ) from None


def is_converted(checkpoint: str) -> bool:
    """Whether `checkpoint` holds its finished universal form."""
    tag = universal_tag(checkpoint)
    try:
        with open(os.path.join(checkpoint, LATEST_UNIVERSAL)) as f:
            named = f.read().strip()
    except OSError:
        return False
    return named == tag and os.path.isdir(os.path.join(checkpoint, tag, "zero"))


def convert(checkpoint: str, saved: int, workers: int = 2) -> str:
    """Convert `checkpoint` (saved on `saved` ranks) into DeepSpeed's universal checkpoint beside it, unless done
    before; returns the universal folder. Run by one process (DeepSpeed's converter, in a process of its own).

    Raises:
        ConfigError: the conversion failed, naming its last line and the way out (relaunch on `saved` ranks).
    """
    tag = universal_tag(checkpoint)
    target = os.path.join(checkpoint, tag)
    if is_converted(checkpoint):
        return target
    staging = os.path.join(checkpoint, _STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    converter = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", os.path.join(checkpoint, tag.removesuffix("_universal")),
        "--output_folder", os.path.join(staging, tag),
        "--num_extract_workers", str(workers), "--num_merge_workers", str(max(1, workers // 2)),
        "--inject_missing_state",  # ZeRO-1/2 checkpoints of a transformers model carry no universal-format version
    ]  # fmt: skip
    done = subprocess.run(converter, capture_output=True, text=True)
    if done.returncode != 0:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), f"exit {done.returncode}")
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(
            f"{checkpoint} could not be converted to DeepSpeed's universal checkpoint, which a run on another number "
            f"of ranks loads ({last.strip()}); relaunch on {saved} rank{'s' * (saved != 1)}, as it was saved."
        )
    shutil.rmtree(target, ignore_errors=True)  # a folder of that name without `latest_universal`: not finished
    os.rename(os.path.join(staging, tag), target)
    _write_text(os.path.join(checkpoint, LATEST_UNIVERSAL), tag)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def load_universal(deepspeed_config: dict) -> None:
    """Set DeepSpeed's config (accelerate's plugin's, before the engine is made) to load the universal form."""
    deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True


class SeparateSteps(TrainerCallback):
    """Once the checkpoint is loaded (the Trainer's `on_train_begin` comes after it): `separate_steps`."""

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        separate_steps(optimizer)


def separate_steps(optimizer: Any) -> int:
    """Give each parameter's optimizer state a `step` tensor of its own, where a load left one shared; returns how
    many were shared. `optimizer`: a torch optimizer, or a wrapper of one (accelerate's, DeepSpeed's ZeRO)."""
    shared = 0
    for inner in _torch_optimizers(optimizer):
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(step))
    return shared


def _torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers in a chain of wrappers, each holding the next as `optimizer`."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
