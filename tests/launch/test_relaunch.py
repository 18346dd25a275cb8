"""A relaunch resumes its own run: the same command, run again in an output_dir holding its checkpoints, resumes
from the newest finished one; another run's checkpoints are still refused.

First the decision (`colograd.runs.relaunch`, through `check_output_dir`) on checkpoints written as the trainer writes
them; then torchrun's own restarts, refused; then real 2-process torchrun launches (with partial rollouts, with
dynamic sampling) whose worker is SIGKILLed after a finished checkpoint and which are relaunched with the same
command: they train only the steps after it and end with the weights of an uninterrupted run, bit for bit.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, _env, _free_port, refused, worker
from safetensors.torch import load_file

from colograd import train
from colograd.config.core import ConfigError
from colograd.errors import SaidBefore
from colograd.models import tiny
from colograd.runs.checkpoints import SETUP_FIELDS, begin_record, finish_record, is_complete, run_setup
from colograd.runs.output_dir import LOCK_FILE, RunFinished, check_output_dir, finish_from_checkpoint

# --- the decision --------------------------------------------------------------------------------------------


def args_for(out, rank: int = 0, world_size: int = 1, **changes) -> SimpleNamespace:
    """What the output_dir stage reads of a tiny run's config, for a process of `rank` in a launch of `world_size`."""
    config = tiny.run_config(str(out), 10, **changes)
    read = [*SETUP_FIELDS, "output_dir", "max_steps", "overwrite_output_dir", "auto_resume"]
    fields = {name: getattr(config, name) for name in read} | {"world_size": world_size}
    return SimpleNamespace(**fields, process_index=rank)


def setup_of(args: SimpleNamespace, rows: int = 64) -> dict:
    """The whole setup (`run_setup`) of a tiny run with `args`, on `rows` rows of the letters task."""
    return run_setup(args, tiny.build_model(), "colograd:tiny-qwen2", tiny.letters_dataset(rows), ["letters"], [1.0])


def save(out, step: int, setup: dict | None, finished: bool = True) -> Path:
    """A checkpoint as the trainer saves one: record begun (naming the run's setup), files, state, record finished."""
    path = out / f"checkpoint-{step}"
    begin_record(str(path), setup)
    (path / "model.safetensors").write_bytes(b"w" * 64)
    if finished:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        finish_record(str(path), setup)
    return path


@pytest.fixture(autouse=True)
def _rank_0(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # notes are said by the first rank


def test_the_same_run_resumes_its_newest_finished_checkpoint_saying_which_and_why(tmp_path, capsys):
    args = args_for(tmp_path)
    save(tmp_path, 2, setup_of(args))
    four = save(tmp_path, 4, setup_of(args))
    six = save(tmp_path, 6, setup_of(args), finished=False)  # killed while saving
    # Before the trainer knows the whole setup (the command line's checks): nothing refused, the trainer decides.
    assert check_output_dir(args, None) is None and capsys.readouterr().err == ""
    assert check_output_dir(args, None, setup_of(args)) == str(four)
    assert capsys.readouterr().err.splitlines() == [
        f"colograd: note: resuming from {four}, the newest finished checkpoint in {tmp_path}: it was saved by a run "
        f"set up as this one (auto_resume); {six} is incomplete (its trainer_state.json is missing or cut short: its "
        "save was interrupted)."
    ]
    assert six.exists()  # left for the next save of step 6 to replace


def test_more_steps_or_another_learning_rate_is_the_same_run(tmp_path):
    two = save(tmp_path, 2, setup_of(args_for(tmp_path)))
    args = args_for(tmp_path, learning_rate=1e-4)
    args.max_steps = 50
    assert check_output_dir(args, None, setup_of(args)) == str(two)


@pytest.mark.parametrize("known", ["config", "whole setup"])
def test_another_runs_checkpoints_are_refused_naming_what_differs(tmp_path, known):
    save(tmp_path, 2, setup_of(args_for(tmp_path)))
    if known == "config":  # refused before start-up: the config tells it apart
        args = args_for(tmp_path, num_generations=4)
        setup, differ = None, "num_generations 8 in the checkpoint, 4 now"
    else:  # the same config on other data: only the trainer, which has the dataset, tells it apart
        args = args_for(tmp_path)
        setup, differ = setup_of(args, rows=32), "dataset '64 rows, first prompts "
        assert check_output_dir(args, None) is None
    with pytest.raises(ConfigError) as err:
        check_output_dir(args, None, setup)
    message = str(err.value)
    assert message.startswith(
        f"output_dir={str(tmp_path)!r} holds another run's checkpoints: checkpoint-2, the newest finished, was saved "
        f"by a run set up differently ({differ}"
    ), message
    assert message.endswith(
        "; resume it with that run's settings, choose another output_dir, or set overwrite_output_dir: true to start "
        "over."
    )


def test_the_same_run_on_another_number_of_ranks_is_refused_naming_the_batch_that_would_keep_it(tmp_path):
    save(tmp_path, 2, setup_of(args_for(tmp_path, world_size=2, per_device_train_batch_size=16)))
    with pytest.raises(ConfigError) as err:
        check_output_dir(args_for(tmp_path, world_size=1, per_device_train_batch_size=16), None)
    assert str(err.value) == (
        f"output_dir={str(tmp_path)!r} holds this run's checkpoint-2, but it was saved on 2 ranks of "
        "per_device_train_batch_size 16 (32 in all), and this launch has 1 of 16: set per_device_train_batch_size "
        "32, so that the ranks' batches together stay 32; or set overwrite_output_dir: true to start over."
    )
    with pytest.raises(ConfigError, match=r"\(32 in all\), and this launch has 3 of 16; 32 does not divide among 3"):
        check_output_dir(args_for(tmp_path, world_size=3, per_device_train_batch_size=16), None)


def test_a_ddp_run_moves_to_another_number_of_ranks_keeping_its_batch_and_says_so(tmp_path, capsys):
    """2 ranks of 16 → 1 of 32: the same batches, the checkpoint whole (DDP): resumed, and said in one line."""
    from colograd.runs.relaunch import reshard_note

    two = save(tmp_path, 2, setup_of(args_for(tmp_path, world_size=2, per_device_train_batch_size=16)))
    one = args_for(tmp_path, world_size=1, per_device_train_batch_size=32)
    assert check_output_dir(one, None) is None  # the config's part agrees: the trainer decides
    assert check_output_dir(one, None, setup_of(one)) == str(two)
    assert reshard_note(str(two), setup_of(one)).startswith(
        f"{two} was saved on 2 ranks and continues on 1: the model, optimizer, schedule and data position carry over"
    )
    assert reshard_note(str(two), setup_of(args_for(tmp_path, world_size=2, per_device_train_batch_size=16))) is None


def test_an_fsdp_checkpoint_stays_on_its_number_of_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    save(tmp_path, 2, setup_of(args_for(tmp_path, world_size=2, per_device_train_batch_size=16)))
    one = args_for(tmp_path, world_size=1, per_device_train_batch_size=32)
    with pytest.raises(ConfigError, match=r"only a DDP or DeepSpeed checkpoint \(here: fsdp\) moves to another"):
        check_output_dir(one, None, setup_of(one))


def test_a_deepspeed_run_moves_to_another_number_of_ranks_as_its_universal_checkpoint(tmp_path, monkeypatch):
    """Resumed, and said so; the conversion itself runs in the trainer (tests/launch/test_reshard.py)."""
    from colograd.runs.relaunch import reshard_note

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    two = save(tmp_path, 2, setup_of(args_for(tmp_path, world_size=2, per_device_train_batch_size=16)))
    one = args_for(tmp_path, world_size=1, per_device_train_batch_size=32)
    assert check_output_dir(one, None, setup_of(one)) == str(two)
    assert reshard_note(str(two), setup_of(one)).startswith(
        f"{two} was saved on 2 ranks and continues on 1 (as DeepSpeed's universal checkpoint, converted once beside "
        "it): the model, optimizer"
    )
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")  # DDP now: another way of holding the state, another run's
    with pytest.raises(ConfigError, match=r"sharding 'deepspeed' in the checkpoint, 'none' now"):
        check_output_dir(one, None, setup_of(one))


def test_other_ranks_neither_refuse_nor_remove_and_resume_as_the_first_does(tmp_path, capsys):
    save(tmp_path, 2, setup_of(args_for(tmp_path)))
    assert check_output_dir(args_for(tmp_path, rank=1, num_generations=4), None) is None
    assert check_output_dir(args_for(tmp_path, rank=1), None, setup_of(args_for(tmp_path))) == str(
        tmp_path / "checkpoint-2"
    )
    other = tmp_path / "other"
    save(other, 2, setup_of(args_for(other)), finished=False)
    assert check_output_dir(args_for(other, rank=1), None, setup_of(args_for(other))) is None
    assert (other / "checkpoint-2").exists() and capsys.readouterr().err == ""


def test_another_rank_reading_a_save_as_the_first_removes_it_starts_afresh_as_the_first_does(tmp_path, monkeypatch):
    # The first process removes this run's unfinished save (a fresh start) while another still judges it: here the
    # folder goes between the reads of its state and of its record. The other rank must conclude what the first did
    # (no checkpoint), not die on a vanished file: in a launch, the first rank then waits for it in vain.
    import shutil

    from colograd.runs import checkpoints

    path = save(tmp_path, 2, setup_of(args_for(tmp_path)), finished=False)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 2}))  # written; the record not yet finished
    read_record = checkpoints.read_record

    def removed_meanwhile(checkpoint):
        shutil.rmtree(checkpoint, ignore_errors=True)  # its first read: gone from here on
        return read_record(checkpoint)

    monkeypatch.setattr(checkpoints, "read_record", removed_meanwhile)
    assert check_output_dir(args_for(tmp_path, rank=1), None, setup_of(args_for(tmp_path))) is None


def test_an_explicit_resume_from_checkpoint_keeps_its_meaning(tmp_path):
    args = args_for(tmp_path)
    two, four = save(tmp_path, 2, setup_of(args)), save(tmp_path, 4, setup_of(args))
    assert check_output_dir(args, str(two), setup_of(args)) == str(two)  # a named one, not the newest
    assert check_output_dir(args, True, setup_of(args)) == str(four)
    with pytest.raises(ConfigError, match="holds another run's checkpoints .*resume it with --resume_from_checkpoint"):
        check_output_dir(args, "false", setup_of(args))  # told not to resume: a fresh start, refused here


def test_auto_resume_false_refuses_as_a_fresh_start_over_another_runs_work(tmp_path):
    args = args_for(tmp_path, auto_resume=False)
    save(tmp_path, 2, setup_of(args))
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(checkpoint-2\); resume it with"):
        check_output_dir(args, None, setup_of(args))


def test_overwrite_output_dir_starts_over(tmp_path):
    args = args_for(tmp_path, overwrite_output_dir=True)
    save(tmp_path, 2, setup_of(args))
    assert check_output_dir(args, None, setup_of(args)) is None
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]


def test_nothing_finished_is_a_fresh_start_removing_only_this_runs_unfinished_saves(tmp_path, capsys):
    args = args_for(tmp_path)
    assert check_output_dir(args, None, setup_of(args)) is None  # an empty folder
    save(tmp_path, 2, setup_of(args), finished=False)  # killed during its first save
    (tmp_path / "completions.jsonl").write_text("{}\n")  # its steps, about to be trained again
    assert check_output_dir(args, None) is None and (tmp_path / "checkpoint-2").exists()  # the trainer decides
    assert check_output_dir(args, None, setup_of(args)) is None
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]
    assert capsys.readouterr().err.splitlines() == [
        "colograd: note: starting afresh, as no save of this run finished: removed its checkpoint-2, "
        f"completions.jsonl from {tmp_path}."
    ]
    save(tmp_path, 2, setup_of(args_for(tmp_path, seed=1)), finished=False)  # another run's unfinished save
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(checkpoint-2\)"):
        check_output_dir(args, None, setup_of(args))


def test_checkpoints_whose_record_names_no_setup_are_another_runs(tmp_path):
    args = args_for(tmp_path)
    legacy = tmp_path / "checkpoint-2"
    legacy.mkdir()
    (legacy / "trainer_state.json").write_text('{"global_step": 2}')  # saved before records existed: finished
    assert is_complete(str(legacy))
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(checkpoint-2\); resume it with"):
        check_output_dir(args, None, setup_of(args))


def test_a_relaunch_of_a_run_that_reached_max_steps_is_refused_not_trained_on(tmp_path):
    args = args_for(tmp_path)
    save(tmp_path, 10, setup_of(args))
    (tmp_path / "model.safetensors").write_bytes(b"w" * 64)  # its final model was written: the run is over
    with pytest.raises(ConfigError) as err:
        check_output_dir(args, None)
    assert str(err.value) == (
        f"output_dir={str(tmp_path)!r} holds this run's checkpoint-10, saved at its last step (max_steps 10): the "
        "run is over, and its final model is there; raise max_steps to train on, or choose another output_dir."
    )


LAST_STEP = {"model.safetensors": b"w" * 64, "config.json": b"{}", "tokenizer.json": b"{}", "README.md": b"card",
             "optimizer.pt": b"o" * 128, "scheduler.pt": b"s", "rng_state.pth": b"r", "training_args.bin": b"a",
             "entropy_ctrl_state.json": b"{}"}  # fmt: skip


def save_last_step(out, setup: dict, files: dict[str, bytes] = LAST_STEP) -> Path:
    path = out / "checkpoint-10"
    begin_record(str(path), setup)
    for name, data in files.items():
        (path / name).write_bytes(data)
    (path / "partial_rollouts").mkdir()
    (path / "partial_rollouts/rank-0.json").write_text("[]")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    finish_record(str(path), setup)
    return path


@pytest.mark.parametrize("explicit", [None, True, "checkpoint-10"])
def test_a_run_whose_final_save_was_lost_gets_its_model_from_the_last_checkpoint(tmp_path, capsys, explicit):
    """The final save failed (a full disk, a preemption in it) after the last checkpoint: the relaunch, and an
    explicit resume, write the model from that checkpoint and train nothing (transformers would train one step past
    max_steps)."""
    args = args_for(tmp_path)
    checkpoint = save_last_step(tmp_path, setup_of(args))
    resume = str(checkpoint) if explicit == "checkpoint-10" else explicit
    with pytest.raises(RunFinished) as done:
        check_output_dir(args, resume)
    assert done.value.checkpoint == str(checkpoint)
    copied = finish_from_checkpoint(done.value, args)
    assert copied == ["README.md", "config.json", "model.safetensors", "tokenizer.json", "training_args.bin"]
    for name in copied:
        assert (tmp_path / name).read_bytes() == LAST_STEP[name]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not (tmp_path / "optimizer.pt").exists() and not (tmp_path / "partial_rollouts").exists()
    assert "checkpoint-10 holds the run's last step (max_steps 10): wrote the final model" in capsys.readouterr().err
    if explicit is None:  # the relaunch after it: the run is over
        with pytest.raises(ConfigError, match="the run is over, and its final model is there"):
            check_output_dir(args, None)


def test_a_final_model_cut_short_is_no_final_model(tmp_path):
    """Killed in the final save: the weights half written, the tokenizer not yet. The relaunch writes the model."""
    args = args_for(tmp_path)
    save_last_step(tmp_path, setup_of(args))
    (tmp_path / "model.safetensors").write_bytes(b"w" * 32)
    (tmp_path / "config.json").write_bytes(b"{}")
    with pytest.raises(RunFinished) as done:
        check_output_dir(args, None)
    finish_from_checkpoint(done.value, args)
    assert (tmp_path / "model.safetensors").read_bytes() == LAST_STEP["model.safetensors"]
    (tmp_path / "tokenizer.json").unlink()  # whole weights, a companion missing: still no final model
    with pytest.raises(RunFinished):
        check_output_dir(args, None)


def test_an_explicit_resume_at_the_last_step_with_other_settings_is_refused_not_finished(tmp_path):
    args = args_for(tmp_path)
    checkpoint = save_last_step(tmp_path, setup_of(args))
    args.num_generations = 4
    with pytest.raises(ConfigError, match="was saved by a run set up differently \\(num_generations 8") as err:
        check_output_dir(args, str(checkpoint))
    assert not isinstance(err.value, RunFinished)


def test_a_last_checkpoint_without_model_files_says_how_to_consolidate_them(tmp_path):
    args = args_for(tmp_path)
    files = {name: data for name, data in LAST_STEP.items() if name != "model.safetensors"}
    save_last_step(tmp_path, setup_of(args), files)
    with pytest.raises(RunFinished) as done:
        check_output_dir(args, None)
    with pytest.raises(ConfigError, match="holds the run's last step but no model files .*zero_to_fp32.py"):
        finish_from_checkpoint(done.value, args)
    assert not (tmp_path / "config.json").exists()


# --- torchrun's own restarts --------------------------------------------------------------------------------

RESTARTS = (
    "torchrun --max-restarts 2 (accelerate launch --max_restarts): the restarted workers never form their process "
)


def test_torchruns_restarts_are_refused_in_one_line_saying_to_let_the_scheduler_relaunch(tmp_path):
    line = refused("--config", "recipes/grpo_tiny.yaml", "--output_dir", str(tmp_path),
                   env={"TORCHELASTIC_MAX_RESTARTS": "2"})  # fmt: skip
    assert line.startswith(f"colograd: error: {RESTARTS}"), line
    assert "(pytorch issue #167288); launch with no restarts and let the scheduler relaunch the same command" in line
    assert not (tmp_path / LOCK_FILE).exists()  # refused before anything else


def test_a_restarted_attempt_refuses_without_saying_it_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SaidBefore, match="torchrun --max-restarts 2"):
        tiny.run_config(str(tmp_path), 2)
    with pytest.raises(SystemExit) as exit_, redirect_stderr(io.StringIO()) as err:
        train._fail(SaidBefore("said by the first attempt"))
    assert exit_.value.code == 2 and err.getvalue() == ""


def test_no_restarts_is_no_refusal(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # what torchrun sets by default
    assert tiny.run_config(str(tmp_path), 2).max_steps == 2


@pytest.mark.slow  # a torchrun launch (no engine: refused before)
def test_a_torchrun_launch_with_restarts_ends_at_once_refusing_once(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1"]
    cmd = [*launcher, "--master_port", str(_free_port()), "colograd/train.py", "--config", "recipes/grpo_tiny.yaml",
           "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    said = [line for line in proc.stderr.splitlines() if line.startswith("colograd: error: ")]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-4000:]
    # Said once, by the first attempt, before a process group formed: its one restart refuses without a word.
    assert len(said) == 1, said
    assert said[0].startswith(f"colograd: error: {RESTARTS.replace('restarts 2', 'restarts 1')}"), said


# --- a worker killed, the same command relaunched ------------------------------------------------------------

# (Under accelerate launch, and with logs, model card and completions checked too: tests/launch/test_resume.py.)
# Every run is the same command, the output folder aside: the reward hangs from step 3 only where HANG_AT_STEP is
# set, so that the killed run is stopped mid-step once checkpoint-2 is finished.
FLAGS = [
    "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--max_steps", "4", "--save_strategy", "steps",
    "--save_steps", "2", "--disable_tqdm", "true", "--reward_funcs", "tests.scripts.hanging_reward.letters_or_hang",
    "--reward_sigterm_wait", "1",
]  # fmt: skip
# Partial rollouts carry groups from step to step (through checkpoint-2 here: completions of 24 tokens are long
# enough to be cut); dynamic sampling draws refill rounds (the two do not go together).
LONG_TAIL = {
    "partial rollouts": ["--partial_rollouts", "true", "--max_completion_length", "24"],
    "dynamic sampling": ["--dynamic_sampling", "true"],
}


def torchrun(out: Path, flags: list[str]) -> list[str]:
    """The command that trains into `out` on 2 processes under torchrun, with `flags` added."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    return [*launcher, "--master_port", str(_free_port()), *FLAGS, *flags, "--output_dir", str(out)]


def start(cmd: list[str], log: Path, hang_at_step: str = "") -> subprocess.Popen:
    """Start `cmd` in a session of its own, its output appended to `log`; its reward hangs from `hang_at_step` on."""
    env = {**_env(), "HANG_AT_STEP": hang_at_step, "HANG_MARKER": str(log.with_suffix(".hung"))}
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finished(proc: subprocess.Popen, log: Path, timeout: float = 400) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout} s:\n{log.read_text()[-4000:]}") from None


@pytest.mark.slow  # three 2-process launches
@pytest.mark.parametrize("long_tail", LONG_TAIL)
def test_torchrun_relaunched_after_a_worker_is_killed_ends_bit_identical(tmp_path, long_tail):
    reference, out, log = tmp_path / "uninterrupted", tmp_path / "out", tmp_path / "uninterrupted.log"
    uninterrupted = start(torchrun(reference, LONG_TAIL[long_tail]), log)
    assert finished(uninterrupted, log) == 0, log.read_text()[-4000:]

    log = tmp_path / "relaunched.log"
    cmd = torchrun(out, LONG_TAIL[long_tail])
    proc = start(cmd, log, hang_at_step="3")
    deadline = time.monotonic() + 400
    while not log.with_suffix(".hung").exists():  # step 3's reward: checkpoint-2 is finished, the run is mid-step
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    assert is_complete(str(out / "checkpoint-2"))
    if long_tail == "partial rollouts":
        assert json.loads((out / "checkpoint-2/partial_rollouts/rank-1.json").read_text())  # groups carried through
    os.kill(worker(proc.pid, rank=1), signal.SIGKILL)
    assert finished(proc, log) != 0
    assert finished(start(cmd, log), log) == 0, log.read_text()[-4000:]  # the same command, as a scheduler reruns it

    text = log.read_text()
    note = f"colograd: note: resuming from {out}/checkpoint-2, the newest finished checkpoint"
    assert note in text, text[-4000:]
    # Steps 3 and 4 trained, not all four again (a fresh start would end with the same weights too).
    assert text.split(note)[1].count("{'loss': ") == 2, text[-4000:]
    history = json.loads((out / "checkpoint-4/trainer_state.json").read_text())["log_history"]
    steps = {entry["step"]: entry for entry in history if "loss" in entry}
    assert sorted(steps) == [1, 2, 3, 4]
    if long_tail == "partial rollouts":
        assert steps[3]["partial_rollouts/resumed_groups"] > 0  # step 3 continued groups the checkpoint carried
    else:
        assert steps[3]["dynamic_sampling/rounds"] >= 1  # step 3 drew refills
    expected, got = load_file(reference / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_run_finished_from_its_last_checkpoint_pushes_as_the_trainer_would(tmp_path):
    from unittest.mock import patch

    from colograd.runs.saving import push_output_dir

    args = SimpleNamespace(output_dir=str(tmp_path / "my-run"), hub_model_id=None, hub_token="t",
                           hub_private_repo=True, hub_revision="v1")  # fmt: skip
    with (
        patch("huggingface_hub.HfApi.create_repo") as create,
        patch("huggingface_hub.HfApi.create_branch") as branch,
        patch("huggingface_hub.HfApi.upload_folder") as upload,
    ):
        create.return_value.repo_id = "me/my-run"
        assert push_output_dir(args) == "me/my-run"
    create.assert_called_once_with("my-run", private=True, exist_ok=True)
    branch.assert_called_once_with("me/my-run", branch="v1", exist_ok=True)
    assert upload.call_args.kwargs == {
        "repo_id": "me/my-run", "folder_path": str(tmp_path / "my-run"), "commit_message": "End of training",
        "revision": "v1", "ignore_patterns": ["_*", "checkpoint-*"],
    }  # fmt: skip
