"""Rewards started while the rollout decodes: each group of G completions is handed to the reward functions that
take it (`scores_while_decoding`, e.g. `colograd.rewards.code.CodeReward`) as soon as the engine has sampled it.

A function that takes it has a ``prefetch`` method with the reward signature, which starts the work and returns; the
scoring stage (`colograd.rewards.core.score`) then calls the function as always, on the whole rollout, and the function
serves what was started. The rewards are the function's own, in the rollout's order, whether or not anything was
started early; a failure while starting is left for the scoring call to report, naming the function and sample.
"""

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from colograd.rewards.core import RewardFunc


def early_rewards(reward_funcs: Sequence[RewardFunc]) -> list[Any]:
    """The reward functions marked to be started while the rollout decodes."""
    return [f for f in reward_funcs if getattr(f, "scores_while_decoding", False)]


def group_starter(
    funcs: Sequence[Any], tokenizer: PreTrainedTokenizerBase, rows: list[dict], conversational: bool
) -> Callable[[int, list[list[int]]], None]:
    """The engine's `on_group` callback: row i's completions decoded as the scoring stage decodes them (text, or an
    assistant message for chat prompts), with the row's columns, handed to each function's `prefetch`."""

    def start(i: int, completion_ids: list[list[int]]) -> None:
        g = len(completion_ids)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        row = rows[i]
        columns = {k: [v] * g for k, v in row.items() if k != "prompt"}
        for func in funcs:
            try:
                func.prefetch(prompts=[row["prompt"]] * g, completions=completions, completion_ids=completion_ids,
                              **columns)  # fmt: skip
            except Exception:  # noqa: BLE001 — the scoring call runs the function again and reports it
                pass

    return start
