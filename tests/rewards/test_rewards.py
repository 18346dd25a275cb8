"""Reward functions: abstentions, async functions run concurrently, reward models, resolving names."""

import asyncio
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from colograd.config.core import ConfigError
from colograd.models import tiny
from colograd.rewards.core import RewardError, RewardModel, resolve_reward, resolve_rewards, score

PROMPTS = ["ab>a:", "ab>a:"]
COMPLETIONS = ["aa", "ab"]


def call(funcs, **columns) -> torch.Tensor:
    return score(funcs, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[7, 7], [7, 8]], columns=columns)


def test_none_becomes_nan_and_columns_reach_the_function():
    def first_only(completions, target, **kwargs):
        return [
            float(c.count(t)) if i == 0 else None for i, (c, t) in enumerate(zip(completions, target, strict=True))
        ]

    rewards = call([first_only], target=["a", "a"])
    assert rewards[0, 0].item() == 2.0 and math.isnan(rewards[1, 0].item())


def test_async_functions_run_concurrently():
    # Each function waits for the other to arrive: run one after the other, the first would time out.
    barrier = asyncio.Barrier(2)

    async def meet(completions, **kwargs):
        await asyncio.wait_for(barrier.wait(), timeout=10)
        return [1.0] * len(completions)

    async def meet_too(completions, **kwargs):
        await asyncio.wait_for(barrier.wait(), timeout=10)
        return [2.0] * len(completions)

    def plain(completions, **kwargs):
        return [3.0] * len(completions)

    assert call([meet, plain, meet_too]).tolist() == [[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]]


def test_async_functions_work_inside_a_running_event_loop():
    async def one(completions, **kwargs):
        return [1.0] * len(completions)

    async def notebook_cell():  # as in Jupyter, where a loop is already running
        return call([one])

    assert asyncio.run(notebook_cell()).tolist() == [[1.0], [1.0]]


def test_wrong_number_of_rewards_is_an_error():
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        call([lambda completions, **kw: [1.0]])


def test_a_raising_function_is_named_with_the_sample_it_fails_on():
    def picky(completions, **kwargs):
        return [1.0 / (c.count("b")) for c in completions]  # ZeroDivisionError on "aa", sample 0

    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError: .* on completion 0 .*'aa'"):
        call([picky])


@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), "high"])
def test_unusable_values_are_named(bad):
    def second_bad(completions, **kwargs):
        return [1.0, bad]

    with pytest.raises(RewardError, match=r"'second_bad' returned .* for completion 1 .*'ab'"):
        call([second_bad])


def _reward_model(tmp_path=None) -> RewardModel:
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
        tiny.build_tokenizer().save_pretrained(tmp_path)
    return RewardModel(model, tiny.build_tokenizer())


def test_reward_model_scores_prompt_plus_completion_in_a_batch():
    rm = _reward_model()
    batched = call([rm])[:, 0]
    tokenizer = tiny.build_tokenizer()
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        alone = rm.model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item()
        assert batched[i].item() == pytest.approx(alone, abs=1e-5)  # padding does not change a score
    assert batched[0] != batched[1]


def test_reward_model_resolves_from_a_folder(tmp_path):
    _reward_model(tmp_path)
    rm = resolve_reward(str(tmp_path))
    assert isinstance(rm, RewardModel) and rm.__name__ == tmp_path.name
    assert torch.allclose(call([rm])[:, 0], call([_reward_model()])[:, 0])


def test_builtin_names_and_dotted_paths():
    from trl.rewards import accuracy_reward, think_format_reward

    from colograd.rewards import open_r1

    # A name keeps its ecosystem's meaning: TRL's script's names are TRL's, open-r1's registry names open-r1's.
    assert (
        resolve_reward("accuracy_reward") is accuracy_reward and resolve_reward("accuracy") is open_r1.accuracy_reward
    )
    assert (
        resolve_reward("think_format_reward") is think_format_reward
        and resolve_reward("think_format") is think_format_reward
    )
    assert resolve_reward("format") is open_r1.format_reward
    assert resolve_reward("colograd.models.tiny:letters_reward") is tiny.letters_reward


def test_resolve_rewards_checks_weights_and_reward_model_tokenizers():
    funcs, weights = resolve_rewards(["letters", tiny.letters_reward], [1.0, 0.5])
    assert len(funcs) == 2 and weights.tolist() == [1.0, 0.5]
    assert resolve_rewards("letters", None)[1].tolist() == [1.0]
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2"):
        resolve_rewards(["letters", "letters"], [1.0])
    # A bare model is TRL's reward model: its tokenizer comes from its name, here none (built in memory).
    with pytest.raises(ConfigError, match="pass it in reward_processing_classes"):
        resolve_rewards([_reward_model().model], None)
