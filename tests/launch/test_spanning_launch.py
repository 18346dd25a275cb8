"""Groups that span ranks, on 2 processes with the real engine: each rank samples its slice of every rollout's
groups, and trains on the advantages one process holding all the rewards computes (tests/scripts/span_check.py)."""

import json
import shutil

import pytest
import torch
from conftest import launch
from safetensors.torch import load_file

from colograd.grpo.loss import group_advantages
from colograd.rollout.core import reward_metrics

pytestmark = pytest.mark.slow  # a multi-process launch with engines
G = 4
# The command line's run of the same layout: 3 completions per rank × 2 micro-steps, G=4, a checkpoint every 2 steps.
CLI = ["colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--per_device_train_batch_size", "3",
       "--num_generations", "4", "--gradient_accumulation_steps", "2", "--temperature", "1.5", "--max_steps", "4",
       "--save_strategy", "steps", "--save_steps", "2", "--disable_tqdm", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("span")
    proc = launch("tests/scripts/span_check.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], proc


def test_the_run_trains_every_step_with_the_ranks_in_step(run):
    ranks, proc = run
    for rank in ranks:
        assert rank["global_step"] == 3 and all(rank["weights_agree"])
        losses = [h["loss"] for h in rank["log_history"] if "loss" in h]
        assert len(losses) == 3 and all(loss == loss for loss in losses)  # not NaN
    assert proc.stderr.count("groups span ranks, as in TRL") == 1  # said once, by the first rank


def test_each_rank_samples_its_slice_of_the_same_rollouts_groups(run):
    (rank0, rank1), _ = run
    assert len(rank0["rollouts"]) == len(rank1["rollouts"]) == 3
    for own, other in zip(rank0["rollouts"], rank1["rollouts"], strict=True):
        assert own["rows"] == other["rows"] and len(own["rows"]) == 3  # both read the rollout's 3 prompts
        # Rank 0 samples p0 ×4, p1 ×2; rank 1 p1 ×2, p2 ×4: TRL's order, cut in two.
        assert own["scored_prompts"] + other["scored_prompts"] == [p for p in own["rows"] for _ in range(G)]
        assert len(own["completions"]) == len(other["completions"]) == 6
        # The split group's halves are samples of their own, not one rank's twice.
        assert own["completions"][4:] != other["completions"][:2]


def test_a_split_group_trains_on_the_advantages_of_all_its_rewards(run):
    (rank0, rank1), _ = run
    split_std = []
    logged = [h for h in rank0["log_history"] if "loss" in h]  # the steps' logs (not the run's summary)
    assert len(logged) == 3  # one rollout per optimizer step, logged at each
    for own, other, log in zip(rank0["rollouts"], rank1["rollouts"], logged, strict=True):
        rewards_N = torch.tensor(own["rewards"] + other["rewards"])
        expected_N = group_advantages(rewards_N, G)  # one process holding the rollout's 12 rewards
        trained_N = torch.tensor(own["advantages"] + other["advantages"])
        assert torch.allclose(trained_N, expected_N, atol=1e-6)
        split_std.append(rewards_N[G : 2 * G].std().item())
        # The groups' metrics are the whole rollout's, a split group counted once, whole.
        expected = reward_metrics(rewards_N[:, None], torch.ones(1), G)
        for name in ("reward", "reward_std", "frac_reward_zero_std"):
            assert log[name] == pytest.approx(expected[name], abs=1e-5)
    assert any(std > 0 for std in split_std)  # some split group had advantages to get right


def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = launch(*CLI, "--output_dir", str(full))
    assert proc.returncode == 0, proc.stderr[-5000:]
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    proc = launch(*CLI, "--output_dir", str(resumed))  # the same command resumes from checkpoint-2 by itself
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "resuming from" in proc.stderr
    # The same prompts, each rank's same slice of their groups, the same samples: steps 3 and 4 score alike.
    steps = [
        {h["step"]: h["reward"] for h in json.loads((run / "checkpoint-4/trainer_state.json").read_text())[
            "log_history"] if "reward" in h}
        for run in (full, resumed)
    ]  # fmt: skip
    assert [steps[1][k] for k in (3, 4)] == [steps[0][k] for k in (3, 4)]
    weights = [load_file(run / "model.safetensors") for run in (full, resumed)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
