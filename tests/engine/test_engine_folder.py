"""The engine's model folder, named by its content (`colograd.engine.folder`): the same files give the same folder,
any change another; processes placing it at once share one; an unwritable cache falls back to a temporary folder;
and an engine started again finds vLLM's compiled code from the first start instead of compiling it."""

import os
import threading
from pathlib import Path

import pytest

from colograd.engine.folder import engine_folder
from colograd.models import tiny
from colograd.runs import time_limit


def files(**contents: bytes):
    """A writer of these files (name=bytes)."""

    def write(folder: str) -> None:
        for name, data in contents.items():
            Path(folder, name).write_bytes(data)

    return write


def model_files(config=None, tokenizer=None):
    """A writer of the tiny model's config and tokenizer, as the engine writes them."""

    def write(folder: str) -> None:
        (config or tiny.model_config()).save_pretrained(folder)
        (tokenizer or tiny.build_tokenizer()).save_pretrained(folder)

    return write


def test_the_same_content_is_the_same_folder(tmp_path):
    first, temporary = engine_folder(model_files(), root=str(tmp_path))
    again, _ = engine_folder(model_files(), root=str(tmp_path))
    assert first == again and temporary is None
    assert os.path.dirname(first) == str(tmp_path) and len(os.path.basename(first)) == 16
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(first))
    assert os.listdir(tmp_path) == [os.path.basename(first)]  # no staging folder left


def test_any_change_is_another_folder(tmp_path):
    config = tiny.model_config()
    config.rms_norm_eps = 1e-5  # one value of the config
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template += " "  # one byte of the tokenizer
    folders = [
        engine_folder(writer, extra, root=str(tmp_path))[0]
        for writer, extra in [
            (model_files(), ""),
            (model_files(config=config), ""),
            (model_files(tokenizer=tokenizer), ""),
            (model_files(), "cpu_repack_weights=False"),
            (files(a=b"1", b=b"2"), ""),
            (files(a=b"1", b=b"3"), ""),
            (files(a=b"12", b=b""), ""),  # the same bytes, cut elsewhere
            (files(b=b"1", a=b"2"), ""),  # the same bytes under the other names
        ]
    ]
    assert len(set(folders)) == len(folders)


def test_processes_placing_the_same_content_at_once_share_one_folder(tmp_path):
    """Both stage before either renames (the barrier): one rename wins, the other caller takes the winner's folder
    and removes its own copy."""
    both_staged = threading.Barrier(2)
    write = files(**{"config.json": b"{}"})

    def staged_together(folder: str) -> None:
        write(folder)
        both_staged.wait(timeout=10)

    results = []
    threads = [threading.Thread(target=lambda: results.append(engine_folder(staged_together, root=str(tmp_path))))
               for _ in range(2)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    assert os.listdir(tmp_path) == [os.path.basename(results[0][0])]
    assert os.listdir(results[0][0]) == ["config.json"]


def test_an_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache's folder would be: it cannot be created
    folder, temporary = engine_folder(model_files(), root=str(blocker / "engines"), temporary_prefix="colograd-test-")
    assert temporary is not None and folder == temporary.name
    assert os.path.basename(folder).startswith("colograd-test-") and "config.json" in os.listdir(folder)
    assert temporary in set(time_limit._FOLDERS)  # removed even when the process ends stuck
    temporary.cleanup()
    assert not os.path.exists(folder)


def started(cache_root: Path, monkeypatch) -> tuple[str, str]:
    """An engine of the tiny model started with vLLM's cache at `cache_root`: the folder it read and the hash of its
    config, which vLLM's compile cache is keyed on (`VllmConfig.compute_hash`, the model's path among what it hashes;
    the same for an eager engine as for a compiled one)."""
    from vllm import envs

    from colograd import GRPOConfig
    from colograd.engine.core import Engine

    monkeypatch.setattr(envs, "VLLM_CACHE_ROOT", str(cache_root), raising=False)
    args = GRPOConfig(output_dir=str(cache_root / "out"), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none")  # fmt: skip
    engine = Engine(tiny.build_model(), tiny.build_tokenizer(), args)
    config = engine.llm.llm_engine.vllm_config
    return config.model_config.model, config.compute_hash()


@pytest.mark.slow  # two engine starts
def test_a_second_start_has_the_first_starts_compile_cache_key(tmp_path, monkeypatch):
    """The key, not timing: a second engine of the same model reads the same folder, so vLLM's config hash, which keys
    its compile cache, is the first's; with a new folder per start (colograd before this) it differed, and every
    start compiled afresh. Measured with compiled engines (2-core CPU, medians of 3, loaded): 34.4 s a start before,
    11.2 s for a second start now (docs/throughput.md)."""
    root = tmp_path / "vllm-cache"
    first = started(root, monkeypatch)
    second = started(root, monkeypatch)
    assert second == first and first[0].startswith(str(root / "colograd" / "engines"))
    assert [name for name in os.listdir(root / "colograd" / "engines") if not name.startswith(".")] == [
        os.path.basename(first[0])
    ]
