"""A rollout as tensors: padding sides, masks, truncation masking, and the split into micro-batches."""

import pytest
import torch

from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout, split_rows


def test_pad_rollout_by_hand():
    # Two prompts ([5, 6] and [7]) × G=2 completions; the last one was cut at max_completion_length.
    rollout = Rollout(completion_ids=[[8, 1], [9], [10, 11, 12], [13, 14, 15]],
                      logps=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7, -0.8, -0.9]],
                      truncated=[False, False, False, True])  # fmt: skip
    batch = pad_rollout([[5, 6], [7]], rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), 2, pad_token_id=0,
                        mask_truncated_completions=True)  # fmt: skip
    assert batch["input_ids"].tolist() == [
        [5, 6, 8, 1, 0],  # prompt left-padded to 2, completion right-padded to 3
        [5, 6, 9, 0, 0],
        [0, 7, 10, 11, 12],
        [0, 7, 13, 14, 15],
    ]
    assert batch["attention_mask"][2].tolist() == [0, 1, 1, 1, 1]
    assert batch["position_ids"][2].tolist() == [0, 0, 1, 2, 3]  # positions start at the first real token
    assert batch["completion_ids"][1].tolist() == [9, 0, 0]
    assert batch["completion_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]  # truncated: out
    assert batch["engine_logps"][1].tolist() == pytest.approx([-0.3, 0.0, 0.0])


def test_split_rows_keeps_groups_together_and_shares_scalars():
    batch = {"advantages": torch.arange(8.0), "num_items": torch.tensor(3.0)}
    first, second = split_rows(batch, 2)
    assert first["advantages"].tolist() == [0, 1, 2, 3] and second["advantages"].tolist() == [4, 5, 6, 7]
    assert first["num_items"] is batch["num_items"] and second["num_items"] is batch["num_items"]


def test_pad_rollout_masks_tool_results_and_takes_a_prompt_per_completion():
    # Completion 0: two sampled tokens, two inserted (a tool result), one sampled. Each completion its own prompt.
    rollout = Rollout(completion_ids=[[8, 9, 20, 21, 1], [10]], logps=[[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4]],
                      truncated=[False, False], tool_mask=[[1, 1, 0, 0, 1], [1]],
                      prompt_ids=[[5, 6], [7]])  # fmt: skip
    batch = pad_rollout([[99]], rollout, torch.tensor([1.0, -1.0]), 2, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 9, 20, 21, 1], [0, 7, 10, 0, 0, 0, 0]]
    assert batch["tool_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert batch["completion_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert batch["attention_mask"][0].tolist() == [1] * 7  # the model reads the tool result; the loss skips it
