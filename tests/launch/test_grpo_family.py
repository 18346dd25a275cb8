"""The GRPO family end to end: 2 processes, the real engine, one short run per loss type (one launch)."""

import json
import math

import pytest
import torch
from conftest import launch

from colograd.grpo.loss import group_advantages

pytestmark = pytest.mark.slow  # multi-process launches with engines
RUNS = ["grpo", "dr_grpo", "bnpo", "dapo", "lora"]
CLIP_METRICS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("family")
    data = tmp_path_factory.mktemp("conversational")
    # A dataset folder: its files name the splits. Conversational prompts plus a column the rewards read.
    rows = [{"prompt": [{"role": "user", "content": f"{ctx}>{t}"}], "target": t} for ctx in ("abcd", "dcba", "bbad",
            "cadb") for t in "abcd"]  # fmt: skip
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (data / "test.jsonl").write_text(json.dumps(rows[0]))
    proc = launch("tests/scripts/grpo_family.py", str(out), str(data))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)] for name in RUNS}


def steps(record: dict) -> list[dict]:
    return [h for h in record["log_history"] if "loss" in h]


@pytest.mark.parametrize("name", RUNS)
def test_every_step_trains_and_ranks_agree(runs, name):
    for record in runs[name]:
        assert record["weights_agree"] == [True] * len(steps(record))
        for entry in steps(record):
            assert entry["loss"] == entry["loss"]  # finite, not NaN
            missing = [k for k in CLIP_METRICS if k not in entry]
            assert not missing, f"step {entry['step']} lacks {missing}"


# (global steps that generate a rollout, micro-steps per rollout): a rollout, and the sync before it,
# happen once per optimizer step at most, and only when a rollout is due.
SCHEDULES = {
    "grpo": [0, 2],  # num_iterations 2: each rollout trains two optimizer steps
    "dr_grpo": [0, 2],  # steps_per_generation 2, gradient accumulation 1
    "bnpo": [0, 1],  # gradient accumulation 2 = steps_per_generation: one rollout per optimizer step
    "dapo": [0, 2],  # generation_batch_size = 2 optimizer steps' worth
    "lora": [0, 1, 2],  # the defaults: one rollout per optimizer step
}


@pytest.mark.parametrize("name", RUNS)
def test_sync_and_rollout_once_per_generation(runs, name):
    for record in runs[name]:
        assert record["rollouts_at"] == SCHEDULES[name]
        assert record["synced_at"] == SCHEDULES[name]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_old_logps_are_stored_once_per_rollout(runs, name):
    # Each rollout's first micro-step trains the weights that sampled it (gap ~0); the next ones train weights
    # an optimizer step later against the stored log-probs of the sampling policy (gap clearly > 0).
    for record in runs[name]:
        gaps = record["old_logp_gaps"]
        assert gaps[0] < 1e-5 and gaps[2] < 1e-5
        assert gaps[1] > 1e-4 and gaps[3] > 1e-4


@pytest.mark.parametrize("name, from_engine", [("dr_grpo", True), ("grpo", False), ("dapo", False)])
def test_engine_logps_serve_as_old_logps_when_they_can(runs, name, from_engine):
    # One pass over each rollout and no correction: the engine's log-probs of its samples are the sampling
    # policy's, so no forward pass computes them. num_iterations 2 (grpo) or the importance-sampling correction
    # (dapo), which needs the trainer's own, take the forward pass.
    assert set(runs[name][0]["old_from_engine"]) == {from_engine}


def test_sampling_gap_is_logged_on_each_rollouts_first_slice_with_engine_old_logps(runs):
    # dr_grpo: a rollout every 2 optimizer steps, old log-probs from the engine; the first step of each rollout
    # trains the weights that sampled, so engine and trainer can be compared there.
    entries = steps(runs["dr_grpo"][0])
    assert ["sampling/sampling_logp_difference/max" in e for e in entries] == [True, False, True, False]
    assert max(e.get("sampling/sampling_logp_difference/max", 0.0) for e in entries) < 1e-3


@pytest.mark.parametrize("name", ["bnpo", "dapo"])
def test_importance_sampling_correction_is_logged_and_near_one(runs, name):
    # Engine and trainer share the weights, so the ratio of their probabilities is 1 up to numerics.
    for entry in steps(runs[name][0]):
        for stat in ("min", "mean", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1.0, abs=1e-3)
    assert "sampling/importance_sampling_ratio/mean" not in steps(runs["dr_grpo"][0])[0]


@pytest.mark.parametrize("name, micro_steps", [("bnpo", 4), ("lora", 3)])
def test_on_policy_rollouts_need_no_old_logps(runs, name, micro_steps):
    assert runs[name][0]["old_logp_gaps"] == [0.0] * micro_steps  # every slice trained before the next update


@pytest.mark.parametrize("name", ["grpo", "dapo", "lora"])
def test_kl_to_reference_is_logged_and_grows_from_zero(runs, name):
    kl = [entry["kl"] for entry in steps(runs[name][0])]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the first step trains the reference's own weights
    assert max(kl[1:]) > 1e-6
    # A frozen copy for a full model; for LoRA the same model with its adapters disabled.
    assert runs[name][0]["reference_is_a_copy"] is (name != "lora")


def test_weighted_rewards_sync_async_abstaining_and_model(runs):
    first = steps(runs["grpo"][0])[0]
    for name in ("target_letter", "short", "abstains_on_odd", "Qwen2ForSequenceClassification"):
        value = first[f"rewards/{name}/mean"]
        assert value == value, f"{name} mean is NaN"
    assert first["rewards/short/mean"] < 0


def test_conversational_prompts_get_the_chat_template(runs):
    assert runs["grpo"][0]["first_prompt"].startswith("u:") and runs["grpo"][0]["first_prompt"].endswith(";a:")


@pytest.mark.parametrize("name", RUNS)
def test_entropy_is_logged_at_every_step(runs, name):
    for entry in steps(runs[name][0]):
        assert 0.0 < entry["entropy"] <= math.log(64) + 1e-4  # the tiny model's vocabulary


def test_adaptive_entropy_coefficient_rises_below_its_target(runs):
    # dr_grpo: entropy_target 10 is above any entropy of a 64-token vocabulary: +0.01 after every optimizer step.
    for record in runs["dr_grpo"]:
        coefs = [entry["entropy_coef"] for entry in steps(record)]
        assert coefs == pytest.approx([0.02, 0.03, 0.04, 0.05])
        assert all("policy_loss" in entry for entry in steps(record))


def test_sync_ref_model_moves_the_reference_copy(runs):
    assert runs["dapo"][0]["reference_moved"] and runs["dapo"][1]["reference_moved"]
    assert not runs["grpo"][0]["reference_moved"]  # without sync_ref_model the copy stays the initial model


def test_batch_scaled_advantages_use_every_ranks_rewards(runs):
    # bnpo scales by the std of the whole batch (both ranks' rewards), as TRL's gathered batch does.
    ranks = runs["bnpo"]
    for (rewards_0, adv_0), (rewards_1, adv_1) in zip(ranks[0]["advantages"], ranks[1]["advantages"], strict=True):
        rewards_N = torch.tensor(rewards_0 + rewards_1)[:, 0]  # one reward function, weight 1
        expected = group_advantages(rewards_N, 8, "batch")
        assert torch.allclose(torch.tensor(adv_0 + adv_1), expected, atol=1e-5)
