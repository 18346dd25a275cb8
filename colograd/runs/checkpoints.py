"""Checkpoints: which saves finished, which run they belong to, and the one to resume from.

A checkpoint folder is written piece by piece (weights, optimizer, scheduler, each rank's RNG state, the trainer
state), by several processes. colograd brackets the save with a record, `colograd_run.json`: written first as
"not finished" by the main process, and rewritten once every rank's part is on disk, listing each file with its
size and the setup of the run that saved it (`run_setup`). So a checkpoint is finished when its record says so and
every file it lists is there whole; a save cut short (a crash, a killed job, a full disk) never counts as one.
Checkpoints saved before the record existed count as finished when their `trainer_state.json`, which transformers
writes after the rest, is whole.

Resuming checks the checkpoint's recorded setup against the run's (`check_setup`): a checkpoint of another
model, dataset, world size or objective is refused, not continued as if it were this run's. The record names the
setup from the moment the save begins, so even a save cut short tells which run it belongs to
(`colograd.runs.relaunch`).
"""

import hashlib
import json
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Sequence
from typing import Any

from peft import PeftModel
from torch import nn
from transformers import PretrainedConfig, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, has_length

from colograd.config.core import ConfigError
from colograd.models.model_files import check_weight_files, safetensors_header, weight_files

STATE_FILE = "trainer_state.json"
RECORD_FILE = "colograd_run.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# The settings that make a resumed run the same run: what is trained and on which batches (the data position a
# checkpoint stores counts them), and the objective. Optimizer hyperparameters (learning rate, schedule, weight
# decay) are left out: lowering them on resume is ordinary, and the restored optimizer continues either way.
SETUP_FIELDS = (
    "world_size",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "num_generations",
    "num_iterations",
    "max_prompt_length",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "importance_sampling_level",
    "seed",
    "optim",
    "bf16",
)
_DATASET_HEAD = 8  # rows whose prompts identify a dataset, with its length
# How transformers names a checkpoint's weights: whole model, adapter, FSDP's sharded state, DeepSpeed's folder.
_WEIGHT_PREFIXES = ("model", "pytorch_model", "adapter_model", "global_step")
_noted: set[str] = set()  # notes already printed by this process (preflight and `train` both resolve the checkpoint)


# --- finished or not -----------------------------------------------------------------------------------------


def checkpoint_problem(checkpoint: str) -> str | None:
    """What keeps `checkpoint` from being a finished save, or None when it is one. A folder whose files vanish while
    they are read (another process removing it) is no finished save.

    Returns:
        e.g. "optimizer.pt is cut short (1024 of 4096 bytes)", "its save did not finish".
    """
    try:
        return _problem(checkpoint)
    except FileNotFoundError as err:
        return f"it was being removed ({os.path.basename(err.filename or checkpoint)} vanished as it was read)"


def _problem(checkpoint: str) -> str | None:
    try:
        with open(os.path.join(checkpoint, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return f"its {STATE_FILE} is missing or cut short: its save was interrupted"
    try:
        TrainerState(**state)
        if not isinstance(state["global_step"], int) or isinstance(state["global_step"], bool):
            raise TypeError
    except (TypeError, KeyError):  # not a mapping, unknown fields, no optimizer step
        return f"its {STATE_FILE} is not a trainer's state (no whole-number global_step, or unknown fields)"
    record = read_record(checkpoint)
    if record is None:
        return _unrecorded_problem(checkpoint)
    if not isinstance(record, dict):
        return f"its {RECORD_FILE} is unreadable: its save was interrupted"
    if not record.get("finished"):
        return "its save did not finish"
    for name, size in record.get("files", {}).items():
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} is cut short or changed ({os.path.getsize(path)} of {size} bytes)"
    return None


def _unrecorded_problem(checkpoint: str) -> str | None:
    """A checkpoint saved before records existed, whose state file (written last) is whole: every safetensors file
    whole by its header, every PyTorch file a whole zip."""
    for name in sorted(os.listdir(checkpoint)):
        path = os.path.join(checkpoint, name)
        try:
            if name.endswith(".safetensors"):
                safetensors_header(path)
            elif name.endswith((".pt", ".pth", ".bin")) and not zipfile.is_zipfile(path):
                return f"{name} is cut short or not a PyTorch file"
        except ConfigError:
            return f"{name} is cut short or not safetensors"
    return None


def is_complete(checkpoint: str) -> bool:
    """Whether the save of `checkpoint` finished (see `checkpoint_problem`)."""
    return checkpoint_problem(checkpoint) is None


def read_record(checkpoint: str) -> dict | str | None:
    """The checkpoint's record; None when it has none; the string "unreadable" when it cannot be parsed (a crash
    while the record itself was written)."""
    try:
        with open(os.path.join(checkpoint, RECORD_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"


def begin_record(checkpoint: str, setup: dict[str, Any] | None = None) -> None:
    """Mark `checkpoint` as being saved (main process, before any rank writes into it), by a run of `setup`. An
    earlier save of the same step (a resumed run saving it again) is removed first: its files would otherwise be
    listed as this save's, and those written after the record (a callback's) change size."""
    shutil.rmtree(checkpoint, ignore_errors=True)
    os.makedirs(checkpoint)
    _write_json(os.path.join(checkpoint, RECORD_FILE), {"finished": False, "setup": setup})


def finish_record(checkpoint: str, setup: dict[str, Any]) -> None:
    """Mark `checkpoint` finished (main process, once every rank's part is written): its files with their sizes,
    and the run's setup."""
    files = {}
    for folder, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(folder, name)
            if name != RECORD_FILE:
                files[os.path.relpath(path, checkpoint)] = os.path.getsize(path)
    _write_json(os.path.join(checkpoint, RECORD_FILE), {"finished": True, "setup": setup, "files": files})


def _write_json(path: str, value: Any) -> None:
    """Write `value` to `path` whole or not at all: a full disk leaves the previous file, or none."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --- choosing the checkpoint to resume from ------------------------------------------------------------------


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step a finished checkpoint was saved at."""
    return TrainerState.load_from_json(os.path.join(checkpoint, STATE_FILE)).global_step


def checkpoints(output_dir: str) -> list[str]:
    """The `checkpoint-<step>` folders of `output_dir`, finished or not, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(steps)]


def rotate_checkpoints(output_dir: str, limit: int | None, best: str | None = None) -> None:
    """`save_total_limit`: delete checkpoints until `limit` remain (unfinished ones first, then the oldest), never
    the newest nor `best` (load_best_model_at_end's). Called once the newest save is finished, so a save cut short
    never costs the last finished checkpoint.
    """
    folders = checkpoints(output_dir)
    if not limit or limit <= 0 or len(folders) <= limit:
        return
    protected = {os.path.realpath(folders[-1])} | ({os.path.realpath(best)} if best else set())
    remaining = len(folders)
    for folder in sorted(folders, key=is_complete):  # a stable sort: unfinished first, each group oldest first
        if remaining <= max(limit, len(protected)):
            break
        if os.path.realpath(folder) not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest finished `checkpoint-<step>` folder in `output_dir`, or None."""
    return next((c for c in reversed(checkpoints(output_dir)) if is_complete(c)), None)


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder `resume_from_checkpoint` asks for.

    Args:
        resume_from_checkpoint: a checkpoint folder; True (or "true") for the newest finished one in
            `output_dir` (a newer one that did not finish is named in a note on stderr); None or False to start
            afresh.
        output_dir: the run's output folder.

    Raises:
        ConfigError: the folder does not exist or is not a finished save, or `output_dir` holds no finished one.
    """
    if resume_from_checkpoint in (None, False, "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True") and not os.path.isdir(str(resume_from_checkpoint)):
        return _newest_finished(output_dir)
    if not os.path.isdir(resume_from_checkpoint):
        raise ConfigError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} does not exist; give a checkpoint folder."
        )
    problem = checkpoint_problem(resume_from_checkpoint)
    if problem is not None:
        found = last_complete_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
        instead = f"resume from {found}, the newest finished one" if found else "resume from a finished checkpoint"
        raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r} is incomplete ({problem}); {instead}.")
    return resume_from_checkpoint


def _newest_finished(output_dir: str) -> str:
    """`resume_from_checkpoint: true`: the newest finished checkpoint, saying so when a newer one did not finish."""
    folders = checkpoints(output_dir)
    found = last_complete_checkpoint(output_dir)
    newest = folders[-1] if folders else None
    if found is None:
        unfinished = f" ({newest}: {checkpoint_problem(newest)})" if newest else ""
        raise ConfigError(
            f"resume_from_checkpoint: {output_dir!r} holds no finished {PREFIX_CHECKPOINT_DIR}-<step> folder"
            f"{unfinished}; give a checkpoint path, or drop the flag to start afresh."
        )
    if newest != found:
        note(
            f"{newest} is incomplete ({checkpoint_problem(newest)}); resuming from {found}, the newest finished "
            "checkpoint."
        )
    return found


def note(message: str) -> None:
    """One line on stderr, once per process, from the first rank only."""
    if message not in _noted and int(os.environ.get("RANK", "0")) == 0:
        _noted.add(message)
        print(f"colograd: note: {message}", file=sys.stderr, flush=True)


# --- the run a checkpoint belongs to -------------------------------------------------------------------------


def run_setup(
    args: TrainingArguments,
    model: nn.Module,
    model_name: str | None,
    dataset: Any,
    reward_names: Sequence[str],
    reward_weights: Sequence[float],
) -> dict[str, Any]:
    """What makes a run the same run, as recorded in each of its checkpoints: the model (name, architecture,
    adapter), the dataset (its length and first prompts), the rewards and their weights, and `SETUP_FIELDS`.

    Args:
        args: the run's config.
        model: the policy (unwrapped; a `PeftModel` when it trains an adapter).
        model_name: what it was loaded from (a recipe's model_name_or_path, or the config's), None when unknown.
        dataset: the training dataset: a stream is recorded as one, without reading it.
        reward_names: the reward functions' names.
        reward_weights: their weights.

    Returns:
        Plain JSON values, keyed by the names `check_setup` reports.
    """
    adapter = f"LoRA r={model.active_peft_config.r}" if isinstance(model, PeftModel) else "none"
    setup = {
        "model": model_name or None,
        "architecture": architecture(model.config),
        "adapter": adapter,
        "dataset": _dataset_identity(dataset),
        "reward_funcs": list(reward_names),
        "reward_weights": [float(w) for w in reward_weights],
        **config_setup(args),
    }
    return json.loads(json.dumps(setup, default=str))  # enums and the like as the strings a record holds


def architecture(config: PretrainedConfig) -> str:
    """The model as a checkpoint's record names it: type, depth, width and vocabulary."""
    text = config.get_text_config()
    return f"{text.model_type}, {text.num_hidden_layers} layers of {text.hidden_size}, vocabulary {text.vocab_size}"


def _dataset_identity(dataset: Any) -> str | None:
    """The dataset as its length and a hash of its first prompts (in the dataset's own order; the sampler
    shuffles), "a stream" for a stream, None without a dataset."""
    if dataset is None:
        return None
    if not has_length(dataset):
        return "a stream"
    head = [dataset[i]["prompt"] for i in range(min(_DATASET_HEAD, len(dataset)))]
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{len(dataset)} rows, first prompts {digest}"


def config_setup(args: TrainingArguments) -> dict[str, Any]:
    """The part of `run_setup` the config and the launch alone tell: `SETUP_FIELDS`, the `sharding` and DeepSpeed's
    ZeRO stage (None without DeepSpeed, so not compared), as a record holds them."""
    fields = {name: getattr(args, name) for name in SETUP_FIELDS}
    fields |= {"sharding": sharding(args), "zero_stage": zero_stage(args)}
    return json.loads(json.dumps(fields, default=str))


def recorded_setup(checkpoint: str) -> dict[str, Any] | None:
    """The setup a checkpoint's record names; None when it names none (saved before records held one)."""
    record = read_record(checkpoint)
    setup = record.get("setup") if isinstance(record, dict) else None
    return setup if isinstance(setup, dict) else None


def setup_differences(recorded: dict[str, Any], setup: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields whose value in a record differs from `setup`'s, with both values. A value unknown on either side
    (None, or a key an older record lacks) is not compared. A move to another number of ranks that keeps the run's
    batches (`resharded`) is no difference."""
    differ = {
        name: (recorded[name], value)
        for name, value in setup.items()
        if recorded.get(name) is not None and value is not None and recorded[name] != value
    }
    if resharded(recorded, setup) is not None:
        for name in RESHARD_FIELDS:
            differ.pop(name, None)
    return differ


# What may change when a run moves to another number of ranks: the prompts each rank takes, so that all ranks'
# together (`per_device_train_batch_size × world_size`) stay the run's batch and the sampler's order stays its order.
RESHARD_FIELDS = ("world_size", "per_device_train_batch_size")


def sharding(args: TrainingArguments) -> str:
    """How this launch holds the model's training state: "deepspeed", "fsdp" (each rank a shard of it, saved as
    shards), or "none" (DDP or one process: every rank the whole of it, saved once). DeepSpeed from the config
    (the `deepspeed` argument, or accelerate's launcher), FSDP from accelerate's launcher."""
    if getattr(args, "deepspeed_plugin", None) is not None:
        return "deepspeed"
    for name, kind in (("ACCELERATE_USE_DEEPSPEED", "deepspeed"), ("ACCELERATE_USE_FSDP", "fsdp")):
        if os.environ.get(name, "").lower() in ("1", "true", "yes"):
            return kind
    return "none"


def zero_stage(args: TrainingArguments) -> int | None:
    """DeepSpeed's ZeRO stage (0-3) as its config says it, None without DeepSpeed. A checkpoint's optimizer files are
    laid out per stage: resuming under another stage is refused like any other setting that changed."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        return None
    stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
    return int(stage) if isinstance(stage, int | str) and str(stage).isdigit() else None


# The ways of holding the training state whose checkpoints load on another number of ranks: DDP's (saved once,
# whole) as they are, DeepSpeed's once converted to its universal checkpoint (`colograd.runs.universal`).
RESHARDABLE = ("none", "deepspeed")


def resharded(recorded: dict[str, Any], setup: dict[str, Any]) -> tuple[int, int] | None:
    """(ranks that saved, ranks now) when `setup` continues `recorded`'s run on another number of ranks: the same
    way of holding the training state on both sides, one of `RESHARDABLE` (DDP's, DeepSpeed's), and the same batch
    over all ranks. The data then continues at the first sample not yet trained (the sampler's order and the steps'
    batches are the run's); None otherwise, and where the world size is the same."""
    try:
        saved, now = int(recorded["world_size"]), int(setup["world_size"])
        batch = lambda side, ranks: int(side["per_device_train_batch_size"]) * ranks  # noqa: E731
        same_batch = batch(recorded, saved) == batch(setup, now)
    except (KeyError, TypeError, ValueError):
        return None
    movable = recorded.get("sharding") == setup.get("sharding") in RESHARDABLE
    return (saved, now) if saved != now and same_batch and movable else None


def reshard_refusal(recorded: dict[str, Any], setup: dict[str, Any]) -> str:
    """Why a checkpoint of `recorded` cannot continue on `setup`'s number of ranks, and what would let it: e.g.
    "it was saved on 2 ranks of per_device_train_batch_size 8 (16 in all), and this launch has 1 of 8: set
    per_device_train_batch_size 16, so that the ranks' batches together stay 16"."""
    saved, now = int(recorded["world_size"]), int(setup["world_size"])
    total = saved * int(recorded["per_device_train_batch_size"])
    said = (
        f"it was saved on {saved} rank{'s' * (saved != 1)} of per_device_train_batch_size "
        f"{recorded['per_device_train_batch_size']} ({total} in all), and this launch has {now} of "
        f"{setup['per_device_train_batch_size']}"
    )
    if (held := recorded.get("sharding") or "not recorded") not in RESHARDABLE:
        return (
            f"{said}; only a DDP or DeepSpeed checkpoint (here: {held}) moves to another number of ranks: relaunch "
            f"on {saved}"
        )
    if total % now:
        return f"{said}; {total} does not divide among {now} ranks: relaunch on {saved}"
    return f"{said}: set per_device_train_batch_size {total // now}, so that the ranks' batches together stay {total}"


def describe_differences(differ: dict[str, tuple[Any, Any]]) -> str:
    """e.g. "num_generations 8 in the checkpoint, 4 now; seed 42 in the checkpoint, 1 now"."""
    return "; ".join(f"{name} {then!r} in the checkpoint, {now!r} now" for name, (then, now) in differ.items())


def check_setup(checkpoint: str, setup: dict[str, Any]) -> None:
    """Refuse to resume from a checkpoint whose recorded setup differs from this run's (`run_setup`). A value
    unknown on either side (None, or a key an older record lacks) is not compared; a checkpoint saved before
    records existed is not checked.

    Raises:
        ConfigError: naming each differing field with its value in the checkpoint and now.
    """
    recorded = recorded_setup(checkpoint) or {}
    differences = setup_differences(recorded, setup)
    if "world_size" in differences and differences.keys() <= set(RESHARD_FIELDS):  # as a relaunch says it
        raise ConfigError(f"resume_from_checkpoint: {checkpoint}: {reshard_refusal(recorded, setup)}.")
    differ = describe_differences(differences)
    if differ:
        raise ConfigError(
            f"resume_from_checkpoint: {checkpoint} was saved by a run set up differently ({differ}); "
            "resume with the checkpoint's settings, or start a new run in another output_dir (or with "
            "overwrite_output_dir: true)."
        )


def check_resume(
    checkpoint: str | None, args: TrainingArguments, config: PretrainedConfig, trust_remote_code: bool = False
) -> None:
    """Before any weights load or engine starts: the checkpoint to resume from holds weights of the model this run
    trains (names and shapes, from their headers; an adapter's are checked whole only), and its record names the
    same architecture and `SETUP_FIELDS` (the dataset and rewards are compared once the trainer has them,
    `check_setup`).

    Args:
        checkpoint: the resolved checkpoint (`resolve_checkpoint`), or None.
        args: the run's config.
        config: the config of the model this run trains.
        trust_remote_code: passed to transformers when it builds the model on the meta device.

    Raises:
        ConfigError: naming the checkpoint and what differs.
    """
    if checkpoint is None:
        return
    if not any(name.startswith(_WEIGHT_PREFIXES) for name in os.listdir(checkpoint)):
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint!r} holds no model weights; resume from a checkpoint that has them, "
            "or start afresh in another output_dir."
        )
    if weight_files(checkpoint):  # a whole model (an adapter-only or FSDP-sharded save is checked by its record)
        check_weight_files(
            checkpoint,
            config,
            trust_remote_code,
            label=f"resume_from_checkpoint={checkpoint!r}",
            against=f"the model this run trains ({architecture(config)})",
            fix="resume from a checkpoint of this model, or start afresh in another output_dir",
        )
    check_setup(checkpoint, {"architecture": architecture(config), **config_setup(args)})
