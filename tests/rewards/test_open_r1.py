"""open-r1's reward names mean open-r1's functions, TRL's names TRL's: each built-in held against its reference
(open-r1's code as it ships, `open_r1_reference.py`; `trl.rewards`) on a table of completions chosen where the two
ecosystems' definitions part, and a recipe's names are said in the run's first lines."""

import math

import open_r1_reference as ref
import pytest
import trl.rewards

from colograd.config.core import ConfigError
from colograd.config.data import ScriptArguments
from colograd.rewards.core import resolve_reward
from colograd.rewards.names import BUILTIN_REWARDS, reward_meanings

THINK = "<think>\nI add them.\n</think>\n"
# Completions (as chats, as open-r1 reads them) where the definitions part: think-only, think-and-answer, tags
# inline, a boxed right and wrong answer, steps, repetition, code fences, long and short, empty.
TEXTS = [
    f"{THINK}<answer>\n$\\boxed{{\\frac{{1}}{{3}}}}$\n</answer>",
    f"{THINK}The answer is $\\boxed{{\\frac{{1}}{{2}}}}$.",
    "<think>I add them.</think><answer>\\boxed{1/3}</answer>",
    "Step 1: add.\nStep 2: reduce.\n1. check\n- done\nFinally, $\\boxed{\\frac{1}{3}}$",
    "the cat the cat the cat the cat the cat the cat",
    f"{THINK}<answer>\n```python\nprint(1)\n```\n</answer>",
    f"{THINK}<answer>\n```cpp\nint main(){{}}\n```\n</answer>",
    "First, " + "x" * 900 + " $\\boxed{\\frac{1}{3}}$",
    "",
    "$\\boxed{2}$ $\\boxed{1/3}$",
]
COMPLETIONS = [[{"role": "assistant", "content": text}] for text in TEXTS]
SOLUTIONS = ["$\\frac{1}{3}$"] * (len(TEXTS) - 2) + ["not latex at all", "$\\frac{1}{3}$"]
COMPLETION_IDS = [[1] * n for n in (5, 990, 1000, 1010, 1100, 1300, 0, 1280, 1024, 7)]


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or math.isclose(g, w, abs_tol=1e-12), (got, want)


OPEN_R1 = {  # name -> open-r1's own function, as its registry builds it from its script's defaults
    "accuracy": ref.accuracy_reward,
    "format": ref.format_reward,
    "tag_count": ref.tag_count_reward,
    "reasoning_steps": ref.reasoning_steps_reward,
    "length": ref.len_reward,
    "cosine": ref.get_cosine_scaled_reward(0.0, -0.5, 0.5, 1.0, 1000),
    "repetition_penalty": ref.get_repetition_penalty_reward(3, -1.0),
    "code_format": ref.get_code_format_reward("python"),
    "soft_overlong_punishment": ref.get_soft_overlong_punishment(16384, 4096),
}


@pytest.mark.parametrize("name", OPEN_R1)
def test_an_open_r1_name_is_open_r1s_function(name):
    ours = resolve_reward(name)
    kwargs = {"completions": COMPLETIONS, "solution": SOLUTIONS, "completion_ids": COMPLETION_IDS}
    _same(ours(**kwargs), OPEN_R1[name](**kwargs))


def test_open_r1_parameters_reach_its_rewards():
    options = ScriptArguments(
        cosine_min_value_wrong=-1.0, cosine_max_len=300, repetition_n_grams=2, repetition_max_penalty=-0.5,
        code_language="cpp", max_completion_len=1200, soft_punish_cache=300,
    )  # fmt: skip
    kwargs = {"completions": COMPLETIONS, "solution": SOLUTIONS, "completion_ids": COMPLETION_IDS}
    pairs = {
        "cosine": ref.get_cosine_scaled_reward(-1.0, -0.5, 0.5, 1.0, 300),
        "repetition_penalty": ref.get_repetition_penalty_reward(2, -0.5),
        "code_format": ref.get_code_format_reward("cpp"),
        "soft_overlong_punishment": ref.get_soft_overlong_punishment(1200, 300),
    }
    for name, reference in pairs.items():
        _same(resolve_reward(name, options)(**kwargs), reference(**kwargs))
    # A row's language column decides code_format's fence, as in open-r1.
    languages = ["cpp"] * len(TEXTS)
    got = resolve_reward("code_format")(completions=COMPLETIONS, language=languages)
    assert got == ref.get_code_format_reward("python")(COMPLETIONS, language=languages) and got[6] == 1.0


def test_the_table_parts_the_ecosystems():
    """The cases are ones where the names matter: open-r1's format refuses a think-only completion TRL's accepts,
    and the two cosines (characters against tokens) and repetition penalties (words against token ids) disagree
    somewhere on the table. (The two accuracies differ only in normalisation flags, and agree on every case here.)"""
    kwargs = {"completions": COMPLETIONS, "solution": SOLUTIONS, "completion_ids": COMPLETION_IDS}
    assert ref.format_reward(COMPLETIONS)[1] == 0.0 and trl.rewards.think_format_reward(COMPLETIONS)[1] == 1.0
    assert resolve_reward("format")(**kwargs) != resolve_reward("think_format_reward")(**kwargs)
    assert resolve_reward("cosine")(**kwargs) != trl.rewards.get_cosine_scaled_reward(1000)(**kwargs)
    trl_repetition = trl.rewards.get_repetition_penalty_reward(3, -1.0)
    assert resolve_reward("repetition_penalty")(**kwargs) != trl_repetition(**kwargs)


TRL = {  # name -> TRL's function (its `trl grpo` script's registry)
    "accuracy_reward": trl.rewards.accuracy_reward,
    "think_format_reward": trl.rewards.think_format_reward,
    "reasoning_accuracy_reward": trl.rewards.reasoning_accuracy_reward,
    "think_format": trl.rewards.think_format_reward,
    "reasoning_accuracy": trl.rewards.reasoning_accuracy_reward,
}


@pytest.mark.parametrize("name", TRL)
def test_a_trl_name_is_trls_function(name):
    assert resolve_reward(name) is TRL[name]


def test_trls_script_soft_overlong_punishment_has_its_script_values():
    ids = [[1] * n for n in (1000, 1024, 1100, 1280, 1300)]
    reference = trl.rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    assert resolve_reward("get_soft_overlong_punishment")(completion_ids=ids) == reference(ids)


def test_open_r1s_ioi_code_takes_the_recipes_parameters():
    from colograd.config.data import ScriptArguments
    from colograd.rewards.code_ioi import IoiCodeReward

    reward = resolve_reward("ioi_code", ScriptArguments(code_eval_test_batch_size=3, ioi_provider="morph"))
    assert isinstance(reward, IoiCodeReward) and (reward.test_batch_size, reward.provider_type) == (3, "morph")
    assert reward is resolve_reward("ioi_code", ScriptArguments(code_eval_test_batch_size=3, ioi_provider="morph"))


def test_open_r1s_cf_code_takes_the_recipes_parameters(tmp_path, monkeypatch):
    from colograd.config.data import ScriptArguments
    from colograd.rewards.code_codeforces import CfCodeReward

    monkeypatch.setenv("CF_TESTS_FOLDER", str(tmp_path))
    options = ScriptArguments(code_eval_scoring_mode="partial", code_eval_test_batch_size=-1)
    reward = resolve_reward("cf_code", options)
    assert isinstance(reward, CfCodeReward) and reward.__name__ == "cf_code"
    assert (reward.scoring_mode, reward.test_batch_size, reward.tests_folder) == ("partial", -1, str(tmp_path))
    monkeypatch.delenv("CF_TESTS_FOLDER")
    with pytest.raises(ConfigError, match="reward_funcs: cf_code: CF_TESTS_FOLDER is not set"):
        resolve_reward("cf_code", ScriptArguments(code_eval_scoring_mode="pass_fail"))


def test_every_name_is_said_with_its_ecosystem():
    line = reward_meanings(["accuracy", "format", "tag_count", "my_pkg.rewards.length", "accuracy_reward"])
    assert line.startswith("rewards: accuracy is open-r1's accuracy") and "format is open-r1's format" in line
    assert "accuracy_reward is TRL's accuracy_reward" in line and "my_pkg" not in line
    assert reward_meanings(["my_pkg.rewards.length"]) == ""
    assert "cf_code is open-r1's cf_code (Codeforces tests" in reward_meanings(["cf_code"])
    for name, builtin in BUILTIN_REWARDS.items():  # every built-in names its origin
        assert builtin.means.startswith(("open-r1's", "TRL's", "colograd's")), name


def test_reward_model_name_comes_first_as_in_trls_script():
    assert ScriptArguments().reward_funcs == ["letters"]
    args = ScriptArguments(reward_model_name_or_path="org/rm", reward_funcs=["accuracy"])
    assert args.reward_funcs == ["org/rm", "accuracy"]
    assert ScriptArguments(reward_model_name_or_path="org/rm").reward_funcs == ["org/rm"]


def test_a_dataset_mixture_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="dataset_mixture: colograd trains on one dataset"):
        ScriptArguments(dataset_mixture={"datasets": [{"id": "a"}]})
