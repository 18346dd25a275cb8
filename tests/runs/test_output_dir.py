"""An output_dir another run uses: never resumed or written over as if it were this run's.

The lock (a second run while the first runs; stale locks), the refusal of a fresh start over another run's work,
the record each checkpoint carries (finished or not, which setup), a save cut short by a full disk; then real runs
of `colograd/train.py` for the second-run and resume-mismatch refusals.
"""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, refused, run_cli
from datasets import Dataset

from colograd import GRPOConfig, GRPOTrainer
from colograd.config.core import ConfigError
from colograd.models import tiny
from colograd.runs.checkpoints import (
    RECORD_FILE,
    SETUP_FIELDS,
    begin_record,
    check_setup,
    checkpoint_problem,
    checkpoints,
    finish_record,
    is_complete,
    last_complete_checkpoint,
    resolve_checkpoint,
    rotate_checkpoints,
    run_setup,
)
from colograd.runs.output_dir import LOCK_FILE, _start_ticks, check_output_dir, claim_output_dir, take_lock
from colograd.runs.preemption import StepFailure

TINY = "recipes/grpo_tiny.yaml"


def args_for(out, rank: int = 0, overwrite: bool = False) -> SimpleNamespace:
    """The fields the output_dir stage reads, for a process of `rank`; a run that names no checkpoint does not look
    for its own here (`auto_resume`: tests/launch/test_relaunch.py)."""
    return SimpleNamespace(
        output_dir=str(out), process_index=rank, overwrite_output_dir=overwrite, auto_resume=False, max_steps=-1
    )


def write_lock(out, pid: int, host: str | None = None, ticks: int | None = None, **slurm) -> None:
    out.mkdir(exist_ok=True)
    ticks = ticks if ticks is not None else _start_ticks(pid)
    holder = {"host": host or socket.gethostname(), "pid": pid, "started": "2025-01-01T00:00:00+00:00",
              "ticks": ticks, "command": "colograd/train.py --config x", **slurm}  # fmt: skip
    (out / LOCK_FILE).write_text(json.dumps(holder))


@pytest.fixture
def sleeper():
    """Another process, alive for the test."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def save(folder, step: int, files: dict[str, bytes] | None = None, setup: dict | None = None):
    """A checkpoint saved as the trainer saves one: record begun, files written, state, record finished."""
    path = folder / f"checkpoint-{step}"
    begin_record(str(path))
    for name, data in (files or {"model.safetensors": b"w" * 64, "optimizer.pt": b"o" * 128}).items():
        (path / name).write_bytes(data)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    finish_record(str(path), setup or {"num_generations": 8})
    return path


# --- the lock ------------------------------------------------------------------------------------------------


def test_lock_names_this_process_and_a_second_claim_in_it_is_a_no_op(tmp_path):
    claim_output_dir(args_for(tmp_path))
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
    claim_output_dir(args_for(tmp_path))  # preflight, then the trainer: the same process claims again
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == holder


def test_a_running_run_stops_a_second_one_naming_it(tmp_path, sleeper):
    write_lock(tmp_path, sleeper.pid)
    with pytest.raises(ConfigError) as err:
        claim_output_dir(args_for(tmp_path))
    message = str(err.value)
    assert f"output_dir={str(tmp_path)!r} is in use by another run: pid {sleeper.pid} on host" in message
    assert "colograd/train.py --config x" in message and "choose another output_dir, or wait" in message
    assert "\n" not in message
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == sleeper.pid  # untouched


def test_other_ranks_never_take_or_check_the_lock(tmp_path, sleeper):
    write_lock(tmp_path, sleeper.pid)
    claim_output_dir(args_for(tmp_path, rank=1))
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == sleeper.pid


@pytest.mark.parametrize("how", ["dead", "pid reused", "unreadable"])
def test_a_stale_lock_on_this_host_is_taken_over_with_one_note(tmp_path, capsys, sleeper, how):
    if how == "dead":
        write_lock(tmp_path, dead_pid())
    elif how == "pid reused":  # the pid runs, but it is a later process than the one that wrote the lock
        write_lock(tmp_path, sleeper.pid, ticks=_start_ticks(sleeper.pid) - 1)
    else:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / LOCK_FILE).write_text('{"host": "h", "pi')
    claim_output_dir(args_for(tmp_path))
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.startswith(f"colograd: note: output_dir {tmp_path} ") and note.endswith("; taking it over.")


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
    write_lock(tmp_path, 1, host="elsewhere", ticks=1)
    with pytest.raises(
        ConfigError, match="on host elsewhere.*not this host.*delete .*_colograd_run.lock if it is gone"
    ):
        claim_output_dir(args_for(tmp_path))


@pytest.mark.parametrize("then", [None, 0, 1])
def test_a_lock_from_another_host_is_taken_over_only_from_an_earlier_run_of_this_slurm_job(
    tmp_path, capsys, monkeypatch, then
):
    """Slurm requeues a job (on another node, as often as not) once all its processes ended: the lock of an earlier
    run of the job is stale. The same run of it, or another job, may still run elsewhere: refused."""
    write_lock(tmp_path, 1, host="elsewhere", ticks=1, slurm_job="77", slurm_restarts=then)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    if then == 0:  # requeued once since
        claim_output_dir(args_for(tmp_path))
        assert json.loads((tmp_path / LOCK_FILE).read_text())["slurm_restarts"] == 1
        assert "was held by pid 1 on host elsewhere" in capsys.readouterr().err
        return
    with pytest.raises(ConfigError, match="on host elsewhere.*not this host"):
        claim_output_dir(args_for(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job
    write_lock(tmp_path, 1, host="elsewhere", ticks=1, slurm_job="77", slurm_restarts=0)
    with pytest.raises(ConfigError, match="on host elsewhere.*not this host"):
        claim_output_dir(args_for(tmp_path))


@pytest.mark.slow  # two Python processes that import colograd (torch): 12-15 s
def test_the_lock_goes_at_exit_and_a_killed_holder_leaves_one_that_is_taken_over(tmp_path, capsys):
    code = "import sys, time; from colograd.runs.output_dir import take_lock; take_lock(sys.argv[1]); "
    exits = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, timeout=120)
    assert exits.returncode == 0 and not (tmp_path / LOCK_FILE).exists()

    hold = code + "print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
        take_lock(str(tmp_path))
    holder.kill()  # SIGKILL: no exit hook runs
    holder.wait()
    take_lock(str(tmp_path))
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"was held by pid {holder.pid} on host" in capsys.readouterr().err


# --- a fresh start over another run's work -------------------------------------------------------------------


def test_a_new_run_over_another_runs_checkpoints_is_refused_with_the_three_ways_on(tmp_path):
    for step in (2, 4, 6, 8):
        save(tmp_path, step)
    with pytest.raises(ConfigError) as err:
        check_output_dir(args_for(tmp_path), None)
    message = str(err.value)
    assert (
        f"output_dir={str(tmp_path)!r} holds another run's checkpoints (..., checkpoint-4, checkpoint-6, " in message
    )
    ways = "resume it with --resume_from_checkpoint true, choose another output_dir, or set overwrite_output_dir: true"
    assert message.endswith(f"{ways} to start over.")


def test_a_finished_model_alone_is_refused_without_offering_a_resume(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    with pytest.raises(ConfigError, match=r"holds another run's finished model \(model.safetensors\); choose") as err:
        check_output_dir(args_for(tmp_path), None)
    assert "resume" not in str(err.value)


def test_an_interrupted_checkpoint_is_another_runs_work_too(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(ConfigError, match="checkpoints \\(checkpoint-3\\)"):
        check_output_dir(args_for(tmp_path), False)


def test_overwrite_removes_the_previous_runs_checkpoints_and_log_and_other_ranks_leave_it_to_rank_0(tmp_path, capsys):
    save(tmp_path, 2)
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "completions.jsonl").write_text("{}\n")
    (tmp_path / "model.safetensors").write_bytes(b"w")
    check_output_dir(args_for(tmp_path, rank=1), None)
    check_output_dir(args_for(tmp_path, rank=1, overwrite=True), None)
    assert (tmp_path / "checkpoint-2").exists()  # another rank neither refuses nor removes: rank 0 decides
    check_output_dir(args_for(tmp_path, overwrite=True), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "model.safetensors"]
    assert capsys.readouterr().err.strip() == (
        f"colograd: note: overwrite_output_dir: removed the previous run's checkpoint-2, checkpoint-4, "
        f"completions.jsonl from {tmp_path}."
    )


def test_a_resume_here_is_not_a_fresh_start_but_a_resume_from_elsewhere_is(tmp_path):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    checkpoint = save(here, 2)
    assert check_output_dir(args_for(here), True) == str(checkpoint)
    assert check_output_dir(args_for(here), str(checkpoint)) == str(checkpoint)
    with pytest.raises(ConfigError, match="holds another run's checkpoints"):
        check_output_dir(args_for(here), str(save(elsewhere, 5)))
    assert check_output_dir(args_for(tmp_path / "new"), str(elsewhere / "checkpoint-5"))


def test_a_folder_holding_only_logs_is_a_fresh_start_and_overwrite_clears_the_log(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "completions.jsonl").write_text("{}\n")
    assert check_output_dir(args_for(tmp_path), None) is None
    check_output_dir(args_for(tmp_path, overwrite=True), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "runs"]


def test_a_new_save_of_a_step_replaces_the_earlier_one_whole(tmp_path):
    old = save(tmp_path, 2, files={"model.safetensors": b"w", "entropy_ctrl_state.json": b"{}"})
    begin_record(str(old))
    assert list(old.iterdir()) == [old / RECORD_FILE] and not is_complete(str(old))


# --- checkpoints: finished or not ----------------------------------------------------------------------------


def test_a_recorded_checkpoint_is_finished_until_a_file_is_missing_or_cut_short(tmp_path):
    checkpoint = save(tmp_path, 2)
    assert checkpoint_problem(str(checkpoint)) is None
    record = json.loads((checkpoint / RECORD_FILE).read_text())
    state = (checkpoint / "trainer_state.json").stat().st_size
    assert record["finished"] and record["files"] == {"model.safetensors": 64, "optimizer.pt": 128,
                                                      "trainer_state.json": state}  # fmt: skip
    (checkpoint / "optimizer.pt").write_bytes(b"o" * 100)
    assert checkpoint_problem(str(checkpoint)) == "optimizer.pt is cut short or changed (100 of 128 bytes)"
    (checkpoint / "optimizer.pt").unlink()
    assert checkpoint_problem(str(checkpoint)) == "optimizer.pt is missing"


def test_a_save_that_wrote_its_state_but_not_its_record_is_unfinished(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    begin_record(str(checkpoint))
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2}')  # rank 0 is done; rank 1 is not
    assert checkpoint_problem(str(checkpoint)) == "its save did not finish"
    (checkpoint / RECORD_FILE).write_text('{"finished": tr')
    assert checkpoint_problem(str(checkpoint)) == f"its {RECORD_FILE} is unreadable: its save was interrupted"


def test_resume_true_falls_back_to_the_newest_finished_checkpoint_saying_so(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    two = save(tmp_path, 2)
    four = save(tmp_path, 4)
    (four / "rng_state_1.pth").write_bytes(b"")  # not in the record: fine
    (four / "optimizer.pt").write_bytes(b"o")
    assert resolve_checkpoint(True, str(tmp_path)) == str(two)
    assert resolve_checkpoint("true", str(tmp_path)) == str(two)
    (note,) = capsys.readouterr().err.strip().splitlines()  # said once, though resolved twice
    assert note == (
        f"colograd: note: {four} is incomplete (optimizer.pt is cut short or changed (1 of 128 bytes)); resuming "
        f"from {two}, the newest finished checkpoint."
    )


def test_a_named_incomplete_checkpoint_is_refused_naming_it_and_the_newest_finished_one(tmp_path):
    two, four = save(tmp_path, 2), save(tmp_path, 4)
    (four / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as err:
        resolve_checkpoint(str(four), str(tmp_path))
    assert str(err.value) == (
        f"resume_from_checkpoint={str(four)!r} is incomplete (model.safetensors is missing); resume from {two}, "
        "the newest finished one."
    )


def test_no_finished_checkpoint_names_the_newest_unfinished_one(tmp_path):
    (tmp_path / "checkpoint-7").mkdir()
    with pytest.raises(ConfigError, match=r"holds no finished checkpoint-<step> folder \(.*checkpoint-7: its "):
        resolve_checkpoint(True, str(tmp_path))


def test_save_total_limit_removes_unfinished_then_oldest_never_the_newest_or_the_best(tmp_path):
    two, four, six = save(tmp_path, 2), save(tmp_path, 4), save(tmp_path, 6)
    (tmp_path / "checkpoint-3").mkdir()
    rotate_checkpoints(str(tmp_path), 2)
    assert checkpoints(str(tmp_path)) == [str(four), str(six)]
    rotate_checkpoints(str(tmp_path), 1, best=str(four))
    assert checkpoints(str(tmp_path)) == [str(four), str(six)]
    rotate_checkpoints(str(tmp_path), 1)
    assert checkpoints(str(tmp_path)) == [str(six)] and not two.exists()


# --- checkpoints: which run ----------------------------------------------------------------------------------


def setup_of(steps: int = 1, dataset: Dataset | None = None, **overrides) -> dict:
    args = tiny.run_config("unused", steps, **overrides)
    dataset = tiny.letters_dataset(64) if dataset is None else dataset
    return run_setup(args, tiny.build_model(), "colograd:tiny-qwen2", dataset, ["letters_reward"], [1.0])


def test_the_setup_names_model_dataset_rewards_and_the_fields_that_change_the_math():
    setup = setup_of()
    assert setup["model"] == "colograd:tiny-qwen2" and setup["adapter"] == "none"
    assert setup["architecture"] == "qwen2, 2 layers of 128, vocabulary 64"
    assert setup["dataset"].startswith("64 rows, first prompts ")
    assert setup["reward_funcs"] == ["letters_reward"] and setup["reward_weights"] == [1.0]
    assert setup["world_size"] == 1 and setup["num_generations"] == 8 and setup["seed"] == 42
    assert set(SETUP_FIELDS) <= set(setup) and json.loads(json.dumps(setup)) == setup
    assert setup_of()["dataset"] == setup["dataset"]  # the same rows: the same identity
    assert setup_of(dataset=tiny.letters_dataset(64, seed=1))["dataset"] != setup["dataset"]
    assert setup_of(dataset=tiny.letters_dataset(64).to_iterable_dataset())["dataset"] == "a stream"


def test_every_setup_field_is_a_config_field():
    config = GRPOConfig(output_dir="unused", report_to="none")
    for name in SETUP_FIELDS:
        assert hasattr(config, name), name


def test_a_resume_of_a_run_set_up_differently_is_refused_naming_each_field(tmp_path):
    checkpoint = save(tmp_path, 2, setup=setup_of())
    check_setup(str(checkpoint), setup_of(steps=50, learning_rate=1e-4))  # more steps, a lower rate: the same run
    with pytest.raises(ConfigError) as err:
        check_setup(str(checkpoint), setup_of(num_generations=4, per_device_train_batch_size=32, seed=1))
    message = str(err.value)
    assert message.startswith(f"resume_from_checkpoint: {checkpoint} was saved by a run set up differently (")
    assert "num_generations 8 in the checkpoint, 4 now; " in message and "seed 42 in the checkpoint, 1 now" in message
    assert "per_device_train_batch_size 64 in the checkpoint, 32 now" in message
    assert message.endswith("; resume with the checkpoint's settings, or start a new run in another output_dir (or "
                            "with overwrite_output_dir: true).")  # fmt: skip


def test_deepspeeds_zero_stage_is_recorded_and_another_one_refused(tmp_path, monkeypatch):
    """A ZeRO stage from accelerate's launcher or from the `deepspeed` argument is recorded with the sharding; a resume
    under another stage (its optimizer files are laid out per stage) is refused like any changed setting, also when
    the run moves to another number of ranks; a record without a stage (no DeepSpeed, or saved before) is not
    compared."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert (setup_of()["sharding"], setup_of()["zero_stage"]) == ("none", None)
    config = tmp_path / "zero1.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto"}))
    assert (setup_of(deepspeed=str(config))["sharding"], setup_of(deepspeed=str(config))["zero_stage"]) == (
        "deepspeed",
        1,
    )
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    stage_2 = setup_of()
    assert (stage_2["sharding"], stage_2["zero_stage"]) == ("deepspeed", 2)
    checkpoint = save(tmp_path, 2, setup=stage_2)
    check_setup(str(checkpoint), setup_of())
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ConfigError, match=r"\(zero_stage 2 in the checkpoint, 3 now\)"):
        check_setup(str(checkpoint), setup_of())
    moved = setup_of() | {"world_size": 2, "per_device_train_batch_size": stage_2["per_device_train_batch_size"] // 2}
    with pytest.raises(ConfigError, match=r"\(zero_stage 2 in the checkpoint, 3 now\)"):
        check_setup(str(checkpoint), moved)
    older = save(tmp_path, 4, setup={k: v for k, v in stage_2.items() if k != "zero_stage"})
    check_setup(str(older), setup_of())


def test_unknown_values_and_checkpoints_without_a_record_are_not_compared(tmp_path):
    checkpoint = save(tmp_path, 2, setup=setup_of() | {"model": None, "retired_field": 1})
    check_setup(str(checkpoint), setup_of() | {"model": "elsewhere", "new_field": 2})
    legacy = tmp_path / "checkpoint-4"
    legacy.mkdir()
    (legacy / "trainer_state.json").write_text('{"global_step": 4}')
    assert is_complete(str(legacy))
    check_setup(str(legacy), setup_of())


# --- a disk that fills during a save -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_during_a_save_names_step_and_stage_and_keeps_the_last_finished_checkpoint(tmp_path, monkeypatch):
    """The optimizer state of step 3 is half written when the disk fills: the failure names step 3 and the save,
    checkpoint-3 never counts as finished, and checkpoint-2 survives save_total_limit=1 (which removed
    checkpoint-1 once checkpoint-2 was finished)."""
    real_save = torch.save

    def fill_the_disk(obj, f, *args, **kwargs):
        if isinstance(f, str) and f.endswith(os.path.join("checkpoint-3", "optimizer.pt")):
            with open(f, "wb") as out:
                out.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fill_the_disk)
    monkeypatch.delenv("RANK", raising=False)
    args = tiny.run_config(str(tmp_path), 3, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer = GRPOTrainer(tiny.build_model(), "letters", args, tiny.letters_dataset(256),
                          processing_class=tiny.build_tokenizer())  # fmt: skip
    with pytest.raises(StepFailure) as err:
        trainer.train()
    assert re.fullmatch(  # a full disk said as one, with what a save of this run takes (checkpoint-2's size)
        r"optimizer step 3, stage 'save': no space left on /\S*: \d+ MiB needed, \d+ MiB free \(the last finished "
        rf"checkpoint, {tmp_path}/checkpoint-2, is intact: fix the cause and rerun with --resume_from_checkpoint "
        r"true\)\.",
        str(err.value),
    ), str(err.value)
    assert is_complete(str(tmp_path / "checkpoint-2")) and not is_complete(str(tmp_path / "checkpoint-3"))
    assert not (tmp_path / "checkpoint-1").exists()
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    record = json.loads((tmp_path / "checkpoint-2" / RECORD_FILE).read_text())
    assert record["setup"] == trainer.run_setup and "rng_state.pth" in record["files"]


# --- real runs -----------------------------------------------------------------------------------------------


def start_cli(*args: str, log) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "colograd/train.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def error_line(proc: subprocess.CompletedProcess, only: bool = True) -> str:
    """The run's error line, having checked exit code 2, no traceback and (`only`) nothing else on stderr."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("colograd: error: ") and (len(lines) == 1 or not only), proc.stderr[-3000:]
    return lines[-1]


@pytest.mark.slow
def test_second_run_refused_while_the_first_runs_then_new_run_and_changed_resume_refused(tmp_path):
    """The first run is also the suite's one-process run of the tiny recipe from the command line: it trains, logs
    every step and saves the model, its tokenizer and its model card (the run tests/launch/test_cli.py would make)."""
    out = tmp_path / "out"
    flags = ["--config", TINY, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1",
             "--disable_tqdm", "true", "--output_dir", str(out)]  # fmt: skip
    with open(tmp_path / "first.log", "w") as log:
        first = start_cli(*flags, log=log)
    deadline = time.monotonic() + 120
    while not (out / LOCK_FILE).exists():
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.1)

    line = refused(*flags)  # in this process, stopped before any weights are read or an engine starts
    assert f"is in use by another run: pid {first.pid} on host {socket.gethostname()}" in line, line
    assert "choose another output_dir, or wait for that run to end." in line

    assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert not (out / LOCK_FILE).exists() and is_complete(str(out / "checkpoint-2"))
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert "`recipes/grpo_tiny.yaml`" in (out / "README.md").read_text()  # the model card
    assert "'reward':" in (tmp_path / "first.log").read_text()  # per-step logs

    # In processes of their own from here: a start refused after it took the lock holds it until its process ends.
    line = error_line(run_cli(*flags))  # the same command again: its run is over
    assert "holds this run's checkpoint-2, saved at its last step (max_steps 2): the run is over" in line, line
    line = error_line(run_cli(*flags, "--auto_resume", "false"))  # a run not looking for its own: another run's work
    assert "holds another run's checkpoints (checkpoint-1, checkpoint-2) and finished model" in line, line

    # Refused once the trainer knows the run's setup (after its engine started: libraries may log before).
    line = error_line(run_cli(*flags, "--num_generations", "4", "--resume_from_checkpoint", "true"), only=False)
    assert f"resume_from_checkpoint: {out}/checkpoint-2 was saved by a run set up differently" in line, line
    assert "num_generations 8 in the checkpoint, 4 now" in line

    # The final save lost (a full disk, a preemption in it): the same command writes the model from checkpoint-2,
    # trains nothing and exits 0; so does an explicit resume (which transformers would take one step past max_steps).
    model = (out / "model.safetensors").read_bytes()
    for resume in ([], ["--resume_from_checkpoint", "true"]):
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            (out / name).unlink()
        proc = run_cli(*flags, *resume)
        assert proc.returncode == 0 and "wrote the final model from it" in proc.stderr, proc.stderr[-3000:]
        assert (out / "model.safetensors").read_bytes() == model and (out / "tokenizer.json").exists()
        assert not (out / "checkpoint-3").exists() and "'reward':" not in proc.stderr + proc.stdout


# A run killed in its final save, after its last checkpoint finished: the weights half written, then SIGKILL.
KILLED_IN_THE_FINAL_SAVE = """
import os, sys
from colograd.runs import saving
from colograd.train import cli

save = saving.ModelSaving._save


def killed_in_the_final_save(self, output_dir=None, state_dict=None):
    save(self, output_dir, state_dict)
    if not os.path.basename(os.path.normpath(output_dir)).startswith("checkpoint-"):
        weights = os.path.join(output_dir, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
        os.kill(os.getpid(), 9)


saving.ModelSaving._save = killed_in_the_final_save
cli(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_run_killed_in_its_final_save_is_finished_by_the_same_command(tmp_path):
    out = tmp_path / "out"
    flags = ["--config", TINY, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1",
             "--disable_tqdm", "true", "--output_dir", str(out)]  # fmt: skip
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_THE_FINAL_SAVE, *flags], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert killed.returncode == -9 and is_complete(str(out / "checkpoint-2")), killed.stderr[-3000:]
    checkpoint = (out / "checkpoint-2/model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() != checkpoint  # cut short
    proc = run_cli(*flags)  # the scheduler's relaunch
    assert proc.returncode == 0 and "wrote the final model from it" in proc.stderr, proc.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() == checkpoint and not (out / "checkpoint-3").exists()
    line = error_line(run_cli(*flags))  # and once more: the run is over
    assert "the run is over, and its final model is there" in line, line
