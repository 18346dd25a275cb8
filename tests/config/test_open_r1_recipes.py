"""open-r1's GRPO recipes as it ships them (tests/configs/open_r1/, huggingface/open-r1 @ 1416fa0c, unchanged; the
model and dataset swapped by flags): each parses, its fields mean what they mean in open-r1, and what colograd does
not run stops in one line naming why. (tests/launch/test_trl_recipe.py trains the demo recipe on 2 processes.)"""

import os
from types import SimpleNamespace
from unittest.mock import patch

import pytest
from conftest import ROOT
from transformers import Trainer
from trl import ModelConfig

from colograd import GRPOConfig
from colograd.config.core import ConfigError, ScriptArguments
from colograd.rewards.core import resolve_reward
from colograd.runs.saving import ModelSaving
from colograd.train import _Parser, load_model_config

RECIPES = ROOT / "tests/configs/open_r1"
SWAP = ["--model_name_or_path", "colograd:tiny-qwen2", "--dataset_name", "tests/configs/data/math_problems.jsonl",
        "--report_to", "none", "--push_to_hub", "false"]  # fmt: skip


def parse(name: str, tmp_path, *flags: str):
    argv = ["--config", str(RECIPES / name), *SWAP, "--output_dir", str(tmp_path), *flags]
    with patch.dict(os.environ):  # the wandb names a recipe sets stay in this test
        return _Parser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(argv)


def test_the_deepseek_recipe_parses_with_its_template_and_liger_said(tmp_path, capsys):
    script, args, model = parse("deepseek-r1-distill-qwen-1_5b_config_demo.yaml", tmp_path)
    err = capsys.readouterr().err
    assert "use_liger_kernel: TRL's Liger loss" in err and args.use_liger_kernel is False  # transformers won't load it
    assert args.chat_template.startswith("{% if not add_generation_prompt is defined %}")
    _, tokenizer, _ = load_model_config(model, args)
    assert tokenizer.chat_template == args.chat_template  # the prompts are rendered with the recipe's template
    assert [type(resolve_reward(n, script)).__name__ for n in script.reward_funcs] == ["function"] * 3


def test_the_code_recipe_runs_on_its_7_processes_with_groups_spanning_ranks(tmp_path, monkeypatch):
    # 16 per device × accumulation 4 = 64 completions per rank, num_generations 14: launched (as open-r1 does) on 7
    # processes, 448 completions, 32 groups, some split between ranks, as TRL lays them out.
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 7))
    _, args, _ = parse("qwen2_5-1_5b-instruct_config_demo_code.yaml", tmp_path)
    assert (args.num_generations, args.generation_batch_size, args.rollout_prompts) == (14, 448, 32)
    assert args.groups_span_ranks
    # On one process its 64 completions are not whole groups: refused, as TRL refuses it, in one line.
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 1))
    with pytest.raises(
        ConfigError, match="64 completions per rank and rollout is not a multiple of num_generations=14"
    ) as err:
        parse("qwen2_5-1_5b-instruct_config_demo_code.yaml", tmp_path)
    assert "\n" not in str(err.value)


def test_the_ioi_recipe_runs_ioi_code_with_its_parameters(tmp_path):
    # Its batch fits colograd's rule at 2 × 16 per rank; ioi_code built with the recipe's test batch and provider.
    from colograd.rewards.code_ioi import IoiCodeReward

    script, _, _ = parse("qwen2_5-1_5b-instruct_config_demo_code_ioi.yaml", tmp_path, "--num_generations", "16")
    assert script.reward_funcs[0] == "ioi_code" and script.code_eval_test_batch_size == 3
    reward = resolve_reward("ioi_code", script)
    assert isinstance(reward, IoiCodeReward) and (reward.test_batch_size, reward.provider_type) == (3, "piston")


def test_the_codeforces_recipe_runs_cf_code_with_its_scoring(tmp_path, capsys, monkeypatch):
    # 4 × 32 with num_generations 16; scale_rewards: false (TRL's boolean), vllm_device dropped, the wandb and hub
    # names read; cf_code built with the recipe's scoring mode and batch, its tests folder from CF_TESTS_FOLDER.
    from colograd.rewards.code_codeforces import CfCodeReward

    script, args, _ = parse("qwen2_5-coder-7b-instruct_config_codeforces.yaml", tmp_path, "--num_generations", "16")
    assert script.reward_funcs == ["cf_code", "code_format"] and script.code_eval_test_batch_size == -1
    assert args.scale_rewards == "none" and args.hub_revision == "v01.00"
    assert "vllm_device ignored" in capsys.readouterr().err
    monkeypatch.setenv("CF_TESTS_FOLDER", str(tmp_path))
    reward = resolve_reward("cf_code", script)
    assert isinstance(reward, CfCodeReward) and (reward.scoring_mode, reward.test_batch_size) == ("weighted_sum", -1)


def test_open_r1_fields_set_wandb_and_the_hub_branch_and_note_the_rest(tmp_path, capsys):
    with patch.dict(os.environ):
        args = GRPOConfig(
            output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8, num_generations=4,
            wandb_entity="org", wandb_project="r1", wandb_run_group="g", hub_model_revision="v2",
            benchmarks=["aime24"], callbacks=["push_to_hub_revision"],
        )  # fmt: skip
        assert (os.environ["WANDB_ENTITY"], os.environ["WANDB_PROJECT"], os.environ["WANDB_RUN_GROUP"]) == (
            "org", "r1", "g")  # fmt: skip
    assert args.hub_revision == "v2"
    err = capsys.readouterr().err
    assert "benchmarks aime24: open-r1's Slurm scripts run them" in err and "callbacks (push_to_hub_revision)" in err
    with pytest.raises(ConfigError, match="hub_model_revision='v2' and hub_revision='v3' name two branches"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8, num_generations=4,
                   hub_model_revision="v2", hub_revision="v3")  # fmt: skip


def test_the_hub_branch_is_created_before_the_first_push():
    trainer = ModelSaving.__new__(ModelSaving)
    trainer.args = SimpleNamespace(hub_revision="v01.00", hub_token=None)
    trainer.hub_model_id = "org/run"
    with (
        patch.object(Trainer, "init_hf_repo"),
        patch.object(Trainer, "is_world_process_zero", return_value=True),
        patch("huggingface_hub.HfApi.create_branch") as create,
    ):
        trainer.init_hf_repo()
        trainer.args.hub_revision = None
        trainer.init_hf_repo()  # the default branch: nothing to create
    create.assert_called_once_with("org/run", branch="v01.00", token=None, exist_ok=True)


@pytest.mark.parametrize("value, meant", [("false", "none"), ("true", "group"), ("batch", "batch")])
def test_scale_rewards_takes_trls_booleans_in_a_recipe_and_on_the_command_line(tmp_path, value, meant):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"scale_rewards: {value}\nnum_generations: 4\nper_device_train_batch_size: 8\n")
    for argv in (["--config", str(recipe)], ["--scale_rewards", value, "--num_generations", "4"]):
        _, args, _ = _Parser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(
            [*argv, "--output_dir", str(tmp_path), "--report_to", "none"]
        )
        assert args.scale_rewards == meant
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", scale_rewards=False).scale_rewards == "none"
