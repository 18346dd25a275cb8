"""A DeepSpeed checkpoint on another number of ranks (`colograd.runs.universal`): the conversion's refusals and reuse,
and the optimizer step counts DeepSpeed's universal load leaves shared. The conversion and the load themselves, under
ZeRO-3 on 2 → 1 → 2 ranks: tests/launch/test_reshard.py."""

import os
import types

import pytest
import torch

from colograd.config.core import ConfigError
from colograd.runs import universal


def adam_after_a_universal_load() -> torch.optim.AdamW:
    """AdamW over two parameter groups (with and without weight decay, as transformers makes them) after 2 steps,
    its step tensors then made one, as DeepSpeed's ZeRO-3 universal load leaves them."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    adam = torch.optim.AdamW([{"params": [weight]}, {"params": [bias], "weight_decay": 0.0}], lr=1e-3)
    for _ in range(2):
        (weight.sum() + bias.sum()).backward()
        adam.step()
    one = adam.state[weight]["step"]
    adam.state[bias]["step"] = one  # the load's one tensor for every group
    return adam


def steps_after_one_more(adam: torch.optim.AdamW) -> list[float]:
    for group in adam.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    adam.step()
    return [float(state["step"]) for state in adam.state.values()]


def test_shared_step_counts_run_ahead_and_separated_they_count_each_step_once():
    assert steps_after_one_more(adam_after_a_universal_load()) == [4.0, 4.0]  # the defect: one step counted twice
    adam = adam_after_a_universal_load()
    wrapped = types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=adam))  # accelerate's, DeepSpeed's
    assert universal.separate_steps(wrapped) == 1
    assert steps_after_one_more(adam) == [3.0, 3.0]
    assert universal.separate_steps(adam) == 0  # nothing shared: nothing done


def test_a_checkpoint_without_deepspeeds_tag_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"has no DeepSpeed `latest` file naming its ZeRO state; resume it on the"):
        universal.convert(str(tmp_path), saved=2)


def test_a_failed_conversion_names_its_cause_and_leaves_the_checkpoint_as_it_was(tmp_path):
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "global_step2").mkdir()  # no ZeRO files in it
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError) as err:
        universal.convert(str(tmp_path), saved=2)
    message = str(err.value)
    assert message.startswith(f"{tmp_path} could not be converted to DeepSpeed's universal checkpoint, which a run")
    assert message.endswith("; relaunch on 2 ranks, as it was saved.") and "\n" not in message
    assert sorted(os.listdir(tmp_path)) == before  # no staging folder, no `latest_universal`


def test_a_finished_conversion_is_used_again_and_an_unfinished_one_is_not(tmp_path):
    (tmp_path / "latest").write_text("global_step2")
    (tmp_path / "global_step2_universal" / "zero").mkdir(parents=True)
    assert not universal.is_converted(str(tmp_path))  # no `latest_universal`: cut short before it was written
    (tmp_path / "latest_universal").write_text("global_step2_universal")
    assert universal.is_converted(str(tmp_path))
    assert universal.convert(str(tmp_path), saved=2) == str(tmp_path / "global_step2_universal")


def test_the_deepspeed_config_is_told_to_load_the_universal_form():
    config = {"zero_optimization": {"stage": 3}, "checkpoint": {"tag_validation": "Warn"}}
    universal.load_universal(config)
    assert config["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}
