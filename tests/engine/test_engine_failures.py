"""A failure in vLLM's own code ends in one line that says where in vLLM it was raised (`colograd.errors.said`): at
the engine's start-up a refusal (`colograd.engine.launch.unsupported_as_refusal`), in a step the step's failure
(`colograd.runs.preemption.StepFailure`). colograd's own failures stay as they are.

vLLM's code is stood in for by functions compiled under file names inside vLLM's installed package (their source
registered with `linecache`, as a real file's is read), so each test controls what raises and where; the zoo's
tests/zoo/test_hybrids.py runs a family whose real vLLM model fails to build on a CPU."""

import linecache
from pathlib import Path

import pytest
import vllm
from transformers import LlamaConfig

from colograd.engine.launch import unsupported_as_refusal
from colograd.errors import ConfigError, library_frames, said
from colograd.runs.preemption import StepFailure, stage_failures

VLLM = Path(vllm.__file__).resolve().parent


def vllm_code(relative: str, source: str) -> dict:
    """The functions `source` defines, as if from vLLM's file `relative` (under the installed package)."""
    filename = str(VLLM / relative)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    space: dict = {}
    exec(compile(source, filename, "exec"), space)
    return space


ROUTER = vllm_code(
    "model_executor/layers/fused_moe/router/stand_in_router.py",
    "def route(scoring_func):\n    assert scoring_func == 'softmax'\n",
)
MODEL = vllm_code(
    "model_executor/models/stand_in_family.py",
    "def build(config):\n    return config.score_func  # read through transformers' config\n",
)
ALLOCATOR = vllm_code(
    "triton_utils/stand_in_allocation.py",
    "def set_allocator():\n    raise AttributeError(\"module 'triton' has no attribute 'set_allocator'\")\n",
)
LAYER = vllm_code(
    "model_executor/layers/stand_in_linear_attn.py",
    "def build(set_allocator):\n    set_allocator()\n",
)
CALLBACK = vllm_code("v1/stand_in_worker.py", "def run(callback):\n    return callback()\n")


def test_a_start_vllms_code_cannot_make_is_one_line_naming_where_in_vllm():
    with pytest.raises(ConfigError) as err, unsupported_as_refusal("OlmoHybridForCausalLM"):
        LAYER["build"](ALLOCATOR["set_allocator"])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("vLLM's engine could not start OlmoHybridForCausalLM here: AttributeError: module 'triton'")
    assert "(vllm/triton_utils/stand_in_allocation.py:2, called from " in line
    assert "vllm/model_executor/layers/stand_in_linear_attn.py:2)" in line
    assert isinstance(err.value.__cause__, AttributeError)  # the traceback stays reachable (--debug prints it)


def test_a_config_key_vllms_model_reads_is_named_at_vllms_line_not_transformers():
    """vLLM's model reads a key the checkpoint's config lacks: transformers' config raises, vLLM's line is named."""
    with pytest.raises(ConfigError) as err, unsupported_as_refusal("AfmoeForCausalLM"):
        MODEL["build"](LlamaConfig())
    line = str(err.value)
    assert "AttributeError: 'LlamaConfig' object has no attribute 'score_func'" in line
    assert line.endswith("(vllm/model_executor/models/stand_in_family.py:2).")


def test_a_bare_assertion_in_vllm_is_named_by_its_source():
    with pytest.raises(StepFailure) as err, stage_failures("generate", 1, "no-such-output-dir"):
        ROUTER["route"]("sigmoid")
    line = str(err.value)
    assert "\n" not in line
    assert line == (
        "optimizer step 1, stage 'generate': AssertionError (vllm/model_executor/layers/fused_moe/router/"
        "stand_in_router.py:2: `assert scoring_func == 'softmax'`) (no checkpoint was saved yet)."
    )


def test_colograds_own_failures_stay_as_they_are():
    """A callback colograd gave vLLM raises inside vLLM's call: colograd's code is deeper, so it is colograd's (a
    traceback), and an error raised outside vLLM is said without a place."""

    def colograd_callback():
        return library_frames(None, "vllm")  # AttributeError in colograd/errors.py

    with pytest.raises(AttributeError), unsupported_as_refusal("LlamaForCausalLM"):
        CALLBACK["run"](colograd_callback)
    with pytest.raises(ValueError), unsupported_as_refusal("LlamaForCausalLM"):
        raise ValueError("a test's own")
    try:
        raise RuntimeError("plain\nsecond line")
    except RuntimeError as err:
        assert said(err) == "RuntimeError: plain"
    with pytest.raises(StepFailure) as failure, stage_failures("reward", 3, "no-such-output-dir"):
        raise KeyError("answer")
    assert str(failure.value) == "optimizer step 3, stage 'reward': KeyError: 'answer' (no checkpoint was saved yet)."
