"""Choosing the checkpoint to resume from: finished saves only."""

import pytest

from colograd.checkpoints import last_complete_checkpoint, resolve_checkpoint
from colograd.config import ConfigError


def save(folder, step: int, finished: bool = True):
    path = folder / f"checkpoint-{step}"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
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
