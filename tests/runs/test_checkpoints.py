"""Choosing the checkpoint to resume from: finished saves only; a save the disk cuts short is never one."""

import builtins
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainingArguments, modeling_utils

from colograd import train
from colograd.config.core import ConfigError
from colograd.models import tiny
from colograd.runs.checkpoints import (
    RECORD_FILE,
    SETUP_FIELDS,
    architecture,
    check_resume,
    is_complete,
    last_complete_checkpoint,
    resolve_checkpoint,
)
from colograd.runs.preemption import StepFailure
from colograd.runs.saving import ModelSaving


def save(folder, step: int, finished: bool = True):
    """A checkpoint as transformers saved them before colograd's record: weights, then the state file last."""
    path = folder / f"checkpoint-{step}"
    path.mkdir()
    save_file({"w": torch.zeros(4)}, path / "model.safetensors")
    if finished:
        (path / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return path


def test_newest_finished_checkpoint_wins_over_an_interrupted_newer_one(tmp_path):
    save(tmp_path, 5)
    ten = save(tmp_path, 10)  # numeric order, not text order: checkpoint-10 is newer than checkpoint-5
    save(tmp_path, 15, finished=False)
    assert last_complete_checkpoint(str(tmp_path)) == str(ten)
    assert resolve_checkpoint(True, str(tmp_path)) == str(ten)
    assert resolve_checkpoint("true", str(tmp_path)) == str(ten)


def test_a_state_file_cut_short_marks_an_interrupted_save(tmp_path):
    five = save(tmp_path, 5)
    cut = save(tmp_path, 10)
    (cut / "trainer_state.json").write_text('{"global_step": 10, "log_hist')  # the crash came mid-write
    assert last_complete_checkpoint(str(tmp_path)) == str(five)
    with pytest.raises(ConfigError, match="save was interrupted"):
        resolve_checkpoint(str(cut), str(tmp_path))


def test_no_resume_asked():
    assert resolve_checkpoint(None, "anywhere") is None
    assert resolve_checkpoint(False, "anywhere") is None


def test_named_checkpoint_must_exist_and_be_finished(tmp_path):
    assert resolve_checkpoint(str(save(tmp_path, 3)), str(tmp_path)) == str(tmp_path / "checkpoint-3")
    with pytest.raises(ConfigError, match="save was interrupted"):
        resolve_checkpoint(str(save(tmp_path, 6, finished=False)), str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "checkpoint-9"), str(tmp_path))


def test_resume_true_without_a_finished_checkpoint_names_the_folder(tmp_path):
    save(tmp_path, 2, finished=False)
    with pytest.raises(ConfigError, match="holds no finished checkpoint"):
        resolve_checkpoint(True, str(tmp_path))


# --- a disk that fills during a save, at every file of it ---------------------------------------------------


class Saver(ModelSaving):
    """The trainer's save hooks on a plain transformers Trainer: what a GRPO checkpoint writes, with no engine."""

    recipe = None
    run_setup = {"num_generations": 8}


@pytest.fixture
def saver(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), save_total_limit=1, report_to="none", use_cpu=True)
    trainer = Saver(model=tiny.build_model(), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=5)
    return trainer


def save_at(trainer: Saver, step: int) -> None:
    trainer.state.global_step = step
    trainer._save_checkpoint(trainer.model, None)


class FullDisk:
    """A disk that fills while `name` is written (its `nth` write): part of it lands, then OSError(ENOSPC).
    Stands in for the three ways a checkpoint's files are written (torch.save, safetensors, Python's open), so
    any file can be the one the disk fills on."""

    def __init__(self, monkeypatch, name: str, nth: int = 1) -> None:
        self.name, self.hit, self.writes_left = name, False, nth
        real_torch_save, real_safetensors, real_open = torch.save, modeling_utils.safe_save_file, builtins.open

        def torch_save(obj, f, *args, **kwargs):
            self._fill(f, lambda: real_torch_save(obj, f, *args, **kwargs))

        def safetensors_save(tensors, filename, *args, **kwargs):
            self._fill(filename, lambda: real_safetensors(tensors, filename, *args, **kwargs))

        def open_(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if "w" in mode and self._target(file):
                handle.write = self._failing_write(handle.write)
            return handle

        monkeypatch.setattr(torch, "save", torch_save)
        monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_save)
        monkeypatch.setattr(builtins, "open", open_)

    def _target(self, path) -> bool:
        # The record is written to a temporary name renamed into place.
        if isinstance(path, str | os.PathLike) and os.path.basename(path).removesuffix(".tmp") == self.name:
            self.writes_left -= 1
            return self.writes_left == 0
        return False

    def _fill(self, path, write) -> None:
        write()
        if self._target(path):
            os.truncate(path, os.path.getsize(path) // 2)
            self._raise()

    def _failing_write(self, write):
        def half(data):
            write(data[: len(data) // 2])
            self._raise()

        return half

    def _raise(self):
        self.hit = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def files_a_save_writes() -> list[str]:
    """Every file of a checkpoint, as a save of the tiny model writes it (found by saving one)."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, report_to="none", use_cpu=True)
        trainer = Saver(model=tiny.build_model(), args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=5)
        save_at(trainer, 1)
        return sorted(os.listdir(os.path.join(out, "checkpoint-1")))


@pytest.mark.parametrize(
    "name, nth", [*((name, 1) for name in files_a_save_writes()), (RECORD_FILE, 2)]
)  # the record is written twice: begun, then finished
def test_a_disk_that_fills_on_any_file_of_a_save_keeps_the_last_finished_checkpoint(saver, monkeypatch, name, nth):
    out = saver.args.output_dir
    save_at(saver, 1)
    save_at(saver, 2)  # save_total_limit=1: checkpoint-1 goes once checkpoint-2 is finished
    disk = FullDisk(monkeypatch, name, nth)
    with pytest.raises(StepFailure) as err:
        save_at(saver, 3)
    monkeypatch.undo()
    assert disk.hit
    saved = f"{out}/checkpoint-2"
    needed = sum(os.path.getsize(os.path.join(saved, n)) for n in os.listdir(saved))
    assert re.fullmatch(
        rf"optimizer step 3, stage 'save': no space left on /\S*: {needed / 2**20:.0f} MiB needed, \d+ MiB free "
        rf"\(the last finished checkpoint, {out}/checkpoint-2, is intact: fix the cause and rerun with "
        r"--resume_from_checkpoint true\)\.",
        str(err.value),
    ), str(err.value)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-3"]
    assert is_complete(f"{out}/checkpoint-2") and not is_complete(f"{out}/checkpoint-3")
    assert resolve_checkpoint(True, out) == f"{out}/checkpoint-2"
    with pytest.raises(ConfigError, match="checkpoint-3' is incomplete .*resume from .*checkpoint-2"):
        resolve_checkpoint(f"{out}/checkpoint-3", out)
    save_at(saver, 4)  # the disk has room again: the next save finishes and the broken one is rotated away
    assert sorted(os.listdir(out)) == ["checkpoint-4"] and is_complete(f"{out}/checkpoint-4")


# --- a damaged or mismatched checkpoint on resume ------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """checkpoint-1 and checkpoint-2 of the tiny model as colograd saves them (recorded), with the run's
    setup fields as a tiny run's config has them."""
    out = tmp_path_factory.mktemp("run")
    trainer = Saver(model=tiny.build_model(), args=TrainingArguments(str(out), report_to="none", use_cpu=True))
    trainer.run_setup = {"architecture": architecture(trainer.model.config)} | setup_fields(run_args(out))
    trainer.create_optimizer_and_scheduler(num_training_steps=5)
    save_at(trainer, 1)
    save_at(trainer, 2)
    return out


def run_args(out, **changes):
    return tiny.run_config(str(out), 4, **changes)


def setup_fields(args) -> dict:
    return json.loads(json.dumps({n: getattr(args, n) for n in SETUP_FIELDS}, default=str))


@pytest.fixture(params=["recorded", "unrecorded"])
def run(request, saved_run, tmp_path):
    """A copy of the saved run; "unrecorded" as saved before colograd's record existed."""
    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    if request.param == "unrecorded":
        for folder in out.iterdir():
            os.remove(folder / RECORD_FILE)
    return out


def damaged(run, name: str, how: str) -> str:
    path = run / "checkpoint-2" / name
    if how == "missing":
        os.remove(path)
    else:
        os.truncate(path, path.stat().st_size // 2)
    return str(run / "checkpoint-2")


CHECKED_FILES = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]


@pytest.mark.parametrize("how", ["cut short", "missing"])
@pytest.mark.parametrize("name", CHECKED_FILES)
def test_a_damaged_checkpoint_is_refused_by_name_and_resume_true_takes_the_last_intact_one(run, name, how, capsys):
    unrecorded = not (run / "checkpoint-1" / RECORD_FILE).exists()
    checkpoint = damaged(run, name, how)
    if how == "missing" and name != "trainer_state.json" and unrecorded:
        # Without a record, which files a save wrote is unknown: a checkpoint of an older run is taken without
        # them, as transformers takes it (a fresh optimizer, scheduler or RNG; a missing weights file: see below).
        assert resolve_checkpoint(checkpoint, str(run)) == checkpoint
        return
    with pytest.raises(ConfigError, match=f"checkpoint-2' is incomplete .*; resume from {run}/checkpoint-1"):
        resolve_checkpoint(checkpoint, str(run))
    assert resolve_checkpoint(True, str(run)) == f"{run}/checkpoint-1"
    assert "checkpoint-2 is incomplete" in capsys.readouterr().err
    shutil.rmtree(run / "checkpoint-1")
    with pytest.raises(ConfigError, match="holds no finished checkpoint-<step> folder .*checkpoint-2: "):
        resolve_checkpoint(True, str(run))


@pytest.mark.parametrize(
    "state",
    ["{x", "", "{}", "[]", '{"global_step": "two"}', '{"global_step": true}', '{"global_step": 2, "zzz": 1}'],
)
def test_a_corrupt_trainer_state_is_refused(run, state):
    (run / "checkpoint-2" / "trainer_state.json").write_text(state)
    with pytest.raises(ConfigError, match="trainer_state.json is (missing or cut short|not a trainer's state)"):
        resolve_checkpoint(str(run / "checkpoint-2"), str(run))


def test_a_checkpoint_without_weights_is_refused_before_start_up(run):
    os.remove(run / "checkpoint-2" / "model.safetensors")
    checkpoint = str(run / "checkpoint-2")
    if (run / "checkpoint-2" / RECORD_FILE).exists():
        with pytest.raises(ConfigError, match="model.safetensors is missing"):
            resolve_checkpoint(checkpoint, str(run))
    with pytest.raises(ConfigError, match="holds no model weights"):
        check_resume(checkpoint, run_args(run), tiny.build_model().config)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"tie_word_embeddings": True}, "shapes differ|ties tensors the weights hold apart"),
        ({"hidden_size": 256, "intermediate_size": 512}, "shapes differ: model.embed_tokens.weight is"),
        ({"vocab_size": 128}, "shapes differ"),
        ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "tensors the model needs are missing"),
    ],
    ids=["tied", "wider", "vocabulary", "deeper"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensors(run, changes, said):
    config = tiny.build_model().config
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=f"weights in model.safetensors do not match the model this run .*{said}"):
        check_resume(str(run / "checkpoint-2"), run_args(run), config)


def changed(value):
    """Another value of the same kind, for each kind a setup field holds."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return 1 if value is None else f"{value}-changed"


@pytest.mark.parametrize("field", SETUP_FIELDS)
def test_a_checkpoint_saved_with_other_settings_is_refused_naming_the_field(saved_run, field):
    args = run_args(saved_run)
    recorded = setup_fields(args)[field]
    args = SimpleNamespace(**{n: getattr(args, n) for n in SETUP_FIELDS} | {field: changed(recorded)})
    if recorded is None:
        check_resume(str(saved_run / "checkpoint-2"), args, tiny.build_model().config)  # unknown: not compared
        return
    if field == "world_size":  # another number of ranks: named with the batch that would keep the run's
        said = f"it was saved on {recorded} rank of per_device_train_batch_size"
        with pytest.raises(ConfigError, match=said):
            check_resume(str(saved_run / "checkpoint-2"), args, tiny.build_model().config)
        return
    with pytest.raises(ConfigError, match=f"was saved by a run set up differently \\({field} {recorded!r} in"):
        check_resume(str(saved_run / "checkpoint-2"), args, tiny.build_model().config)


def test_the_checkpoint_of_this_run_passes(run):
    check_resume(str(run / "checkpoint-2"), run_args(run), tiny.build_model().config)


def test_the_checkpoint_of_this_run_passes_while_a_zero3_config_is_active(run):
    """The trainer checks the checkpoint it resumes once accelerate's DeepSpeed config is live; under ZeRO-3
    transformers would partition the model built on the meta device for its shapes and fail (in a launch: "Cannot
    copy out of meta tensor"; here, DeepSpeed wants a process group), refusing every ZeRO-3 resume."""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    check_resume(str(run / "checkpoint-2"), run_args(run), tiny.build_model().config)
    assert is_deepspeed_zero3_enabled()  # the config active before stays active after
    del config


def test_through_the_command_line_a_mismatched_checkpoint_stops_before_start_up(run, capsys, monkeypatch):
    """A run of the untied tiny model asked to resume a checkpoint of the tied one: one line, exit 2, no model
    loaded and no engine started."""
    monkeypatch.setattr(train, "load_model", lambda *a: pytest.fail("the model was loaded"))
    argv = ["--config", "recipes/grpo_tiny.yaml", "--model_name_or_path", "colograd:tiny-qwen2-tied",
            "--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-2")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        train.cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("colograd: error: resume_from_checkpoint=")
    assert "do not match the model this run trains" in err[-1]


def test_a_real_full_filesystem_under_torchs_writer_is_said_as_a_full_disk(tmp_path):
    """A 4 MiB filesystem (tmpfs, in a mount namespace of its own) that torch.save of a 16 MiB tensor fills: torch's
    zip writer loses the errno ("unexpected pos ..."), and the failure still reads as a full disk, with the size."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is not permitted here: no filesystem of a chosen size to fill")
    script = f"""
import os, subprocess, torch
from colograd.runs.preemption import StepFailure, stage_failures
out = "{tmp_path}/small"
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", out], check=True)
os.makedirs(out + "/checkpoint-3")
try:
    with stage_failures("save", 3, out):
        torch.save(torch.zeros(4 * 2**20), out + "/checkpoint-3/optimizer.pt")
except StepFailure as err:
    print(err)
"""
    (tmp_path / "small").mkdir()
    run = subprocess.run(["unshare", "-m", sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert re.fullmatch(
        rf"optimizer step 3, stage 'save': no space left on {tmp_path}/small: at least 4 MiB needed, 0 MiB free "
        r"\(no checkpoint was saved yet\)\.\n",
        run.stdout,
    ), run.stdout + run.stderr[-2000:]
