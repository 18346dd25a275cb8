"""`micro_batch_tokens`: a micro-step in several forward + backward passes trains exactly as in one (2 processes)."""

import json

import pytest
import torch
from conftest import launch
from test_logps import _grouped_batch

from colograd import tiny
from colograd.batch import split_by_tokens
from colograd.logps import pack_shared, prompt_sharing_cost

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("token_budget")
    proc = launch("tests/scripts/token_budget.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_passes_by_token_budget_give_the_same_step(ranks, loss_type):
    for rank in ranks:
        whole, split = rank[f"{loss_type}-None"], rank[f"{loss_type}-40"]
        assert whole["sampled"] == split["sampled"]  # the same rollout, so the same step is expected
        assert whole["passes"] == [1, 1] and min(split["passes"]) > 2
        for budget in ("None", "40"):  # ranks agree: gradients were reduced once, after the last pass
            assert rank[f"{loss_type}-{budget}"]["weights"] == ranks[0][f"{loss_type}-{budget}"]["weights"]
        # Plain SGD: the step is lr × gradient, so the weights compare the gradients themselves.
        assert (torch.tensor(whole["weights"]) - torch.tensor(rank["initial"])).abs().max() > 1e-4
        gap = (torch.tensor(split["weights"]) - torch.tensor(whole["weights"])).abs().max().item()
        assert gap < 1e-7, f"{loss_type}: weights differ by {gap:.2e} after one step"


def test_split_keeps_rows_whole_and_scales_the_loss():
    mask = torch.zeros(5, 10, dtype=torch.long)
    for i, n in enumerate([3, 4, 9, 2, 2]):
        mask[i, :n] = 1
    batch = {"attention_mask": mask, "completion_mask": mask[:, 2:], "advantages": torch.arange(5.0),
             "num_items": torch.tensor(7.0)}  # fmt: skip
    passes = split_by_tokens(batch, max_tokens=7, loss_type="grpo")
    assert [p["advantages"].tolist() for p in passes] == [[0.0, 1.0], [2.0], [3.0, 4.0]]  # 9 tokens: a pass alone
    assert sum(p["loss_scale"].item() for p in passes) == pytest.approx(1.0)
    assert all(p["num_items"].item() == 7.0 for p in passes)
    bnpo = split_by_tokens(batch, max_tokens=7, loss_type="bnpo")
    # Completion tokens (from column 2): 1, 2, 7, 0, 0; the last pass has none, so it weighs nothing.
    assert [p["loss_scale"].item() for p in bnpo] == pytest.approx([3 / 10, 7 / 10, 0.0])


def test_with_shared_prompts_a_pass_counts_the_tokens_its_forward_computes():
    # GRPO's groups (rows 0-3 share a prompt, 5-6 another): a row that shares the prompt before it costs its
    # completion, so passes hold whole groups; each pass's shared forward stays within the budget.
    batch = _grouped_batch(seed=5)
    cost = prompt_sharing_cost(tiny.build_model())
    fewer = []
    for budget in (10, 20, 30, 40, 60, 80):
        unshared = split_by_tokens(batch, max_tokens=budget, loss_type="grpo")
        shared = split_by_tokens(batch, max_tokens=budget, loss_type="grpo", share_prompts=cost)
        fewer.append(len(shared) < len(unshared))
        assert len(shared) <= len(unshared)
        assert torch.cat([p["advantages"] for p in shared]).equal(batch["advantages"])  # rows whole, in order
        assert sum(p["loss_scale"].item() for p in shared) == pytest.approx(1.0)
        for part in shared:
            longest = int(part["attention_mask"].sum(1).max())
            assert pack_shared(part, cost).tokens <= max(budget, longest)
    assert any(fewer)
