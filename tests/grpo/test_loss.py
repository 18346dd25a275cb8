"""The GRPO math against values worked out by hand."""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from colograd.grpo.entropy import EntropyTerms, high_entropy_mask, next_coef
from colograd.grpo.loss import (
    clipped_fractions,
    group_advantages,
    importance_ratio_metrics,
    kl_k3,
    log_importance_weights,
    policy_loss,
    sampling_gap_metrics,
    weighted_rewards,
)


def test_advantages_unscaled_are_reward_minus_group_mean():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]), num_generations=2, scale_rewards="none")
    assert adv.tolist() == [0.5, -0.5, -1.5, 1.5]


def test_advantages_group_scaled_divide_by_group_std():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); group [0, 3]: mean 1.5, std sqrt(4.5)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]), num_generations=2, scale_rewards="group")
    expected = [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)]
    expected += [-1.5 / (math.sqrt(4.5) + 1e-4), 1.5 / (math.sqrt(4.5) + 1e-4)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_advantages_batch_scaled_divide_by_batch_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0])
    adv = group_advantages(rewards, num_generations=2, scale_rewards="batch")
    std = rewards.std().item()  # sqrt(((1-1)^2 + 1 + 1 + 4) / 3) = sqrt(2)
    assert std == pytest.approx(math.sqrt(2))
    assert adv.tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -1.5 / (std + 1e-4), 1.5 / (std + 1e-4)]
    )


def test_equal_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0, 2.0]), num_generations=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()


# Two completions: advantages [2, -1]; the first has 2 tokens, the second 1 (mask), 3 columns of padding room.
LOGPS = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
ADV = torch.tensor([2.0, -1.0])


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, (-2.0 + 1.0) / 2),  # per-sequence means -2 and +1, then their mean
        ("bnpo", {}, (-2.0 - 2.0 + 1.0) / 3),  # all 3 tokens
        ("dr_grpo", {"max_completion_length": 4}, (-2.0 - 2.0 + 1.0) / (2 * 4)),
        ("dapo", {"num_items": 6}, (-2.0 - 2.0 + 1.0) / 6),
    ],
)
def test_loss_types_at_ratio_one(loss_type, kwargs, expected):
    # ratio 1: each token's loss is minus its advantage
    loss = policy_loss(LOGPS, LOGPS, ADV, MASK, loss_type=loss_type, **kwargs).loss
    assert loss.item() == pytest.approx(expected)


def test_clipping_caps_the_ratio_and_stops_its_gradient():
    old = torch.zeros(2, 1)
    # token 0: ratio 1.5 with A = +1 → clipped to 1.2; token 1: ratio 0.5 with A = -1 → clipped to 0.8
    logps = torch.log(torch.tensor([[1.5], [0.5]])).requires_grad_()
    loss = policy_loss(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), loss_type="bnpo").loss
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    loss.backward()
    assert logps.grad.tolist() == [[0.0], [0.0]]


def test_unclipped_gradient_is_minus_advantage_times_ratio():
    logps = torch.zeros(2, 1, requires_grad=True)
    loss = policy_loss(logps, torch.zeros(2, 1), torch.tensor([1.0, -3.0]), torch.ones(2, 1), loss_type="bnpo").loss
    loss.backward()
    # d/dlogp of -(ratio * A) / 2 at ratio 1 is -A / 2
    assert logps.grad.flatten().tolist() == pytest.approx([-0.5, 1.5])


def test_padding_does_not_count():
    logps = torch.tensor([[0.0, 5.0]], requires_grad=True)
    loss = policy_loss(logps, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1, 0]]), loss_type="grpo").loss
    loss.backward()
    assert logps.grad[0, 1].item() == 0.0


def test_weighted_rewards_skip_abstentions_and_mark_unscorable():
    nan = float("nan")
    rewards_NF = torch.tensor([[1.0, 2.0], [nan, 2.0], [nan, nan]])
    total = weighted_rewards(rewards_NF, torch.tensor([1.0, 0.5]))
    assert total[:2].tolist() == [2.0, 1.0]  # 1 + 0.5·2; the abstention counts 0
    assert total[2].isnan()


def test_unscorable_completion_is_left_out_of_its_group():
    # group [1, 3, NaN]: mean 2 and std sqrt(2) over the two scored; the unscorable one gets 0
    adv = group_advantages(torch.tensor([1.0, 3.0, float("nan")]), num_generations=3, scale_rewards="group")
    s = math.sqrt(2) + 1e-4
    assert adv.tolist() == pytest.approx([-1 / s, 1 / s, 0.0])


def test_sequence_level_ratio_is_exp_of_mean_token_log_ratio():
    logps = torch.log(torch.tensor([[2.0, 8.0, 5.0]]))  # old log-probs are 0: log-ratios log 2, log 8 (masked: 5)
    log_w = log_importance_weights(logps, torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), level="sequence")
    assert torch.exp(log_w).flatten().tolist() == pytest.approx([4.0])  # geometric mean of 2 and 8


def test_k3_kl_by_hand():
    # r = log π_ref - log π_θ = log 2: e^r - r - 1 = 1 - log 2; zero where the policies agree
    kl = kl_k3(torch.tensor([[0.0, -1.0]]), torch.tensor([[math.log(2), -1.0]]))
    assert kl.flatten().tolist() == pytest.approx([1 - math.log(2), 0.0])


def test_kl_term_is_added_per_token_and_weighted_by_beta():
    logps = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2), 0.0]])
    args = dict(loss_type="bnpo", ref_logps_NT=ref, beta=0.5)
    # advantage 0: only the KL remains; bnpo averages its two tokens: 0.5 · (1 - log 2 + 0) / 2
    out = policy_loss(logps, logps, torch.zeros(1), torch.ones(1, 2), **args)
    assert out.loss.item() == pytest.approx(0.5 * (1 - math.log(2)) / 2)
    assert out.kl_NT.flatten().tolist() == pytest.approx([1 - math.log(2), 0.0])


def test_clipped_fractions_by_hand():
    ratio = torch.tensor([[0.5, 1.5, 1.0], [0.5, 1.5, 1.0]])
    clipped = clipped_fractions(ratio, torch.tensor([-1.0, 1.0]), epsilon_low=0.2, epsilon_high=0.28)
    # low: ratio < 0.8 with A < 0 (row 0, token 0); high: ratio > 1.28 with A > 0 (row 1, token 1)
    assert clipped["low"].tolist() == [[True, False, False], [False, False, False]]
    assert clipped["high"].tolist() == [[False, False, False], [False, True, False]]
    assert clipped["region"].sum().item() == 2


def test_adaptive_entropy_state_round_trips_through_a_checkpoint_in_trls_file(tmp_path):
    args = SimpleNamespace(use_adaptive_entropy=True, entropy_coef=0.1, top_entropy_quantile=1.0,
                           output_dir=str(tmp_path), should_save=True)  # fmt: skip
    saved = EntropyTerms(args, None, None, defaultdict(list))
    saved.coef, saved.last_entropy = 0.035, 1.25
    (tmp_path / "checkpoint-3").mkdir()
    saved.write_state(str(tmp_path / "checkpoint-3"))
    state = json.loads((tmp_path / "checkpoint-3" / "entropy_ctrl_state.json").read_text())
    assert state == {"entropy_coef": 0.035, "last_world_entropy": 1.25}  # the keys TRL reads back
    resumed = EntropyTerms(args, None, None, defaultdict(list))
    resumed.resume(str(tmp_path / "checkpoint-3"))
    assert (resumed.coef, resumed.last_entropy) == (0.035, 1.25)
    fresh = EntropyTerms(args, None, None, defaultdict(list))
    fresh.resume(None)  # a run that starts from scratch keeps its initial coefficient
    assert (fresh.coef, fresh.last_entropy) == (0.1, math.inf)


def test_entropies_carry_a_gradient_only_while_a_bonus_applies():
    # Under adaptive control the bonus is off (coefficient 0) while the last step's entropy is above the target, the
    # usual state: the entropies are then computed detached, which spares the backward pass through them.
    args = SimpleNamespace(use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=0.2, top_entropy_quantile=1.0)
    terms = EntropyTerms(args, None, None, defaultdict(list))
    assert (terms.applied_coef, terms.mode) == (0.0, "detached")  # nothing measured yet: no bonus
    terms.last_entropy = 2.5
    assert (terms.applied_coef, terms.mode) == (0.0, "detached")
    terms.last_entropy = 0.15
    assert (terms.applied_coef, terms.mode) == (0.1, "grad")
    fixed = EntropyTerms(SimpleNamespace(**{**vars(args), "use_adaptive_entropy": False}), None, None, {})
    assert (fixed.applied_coef, fixed.mode) == (0.1, "grad")
    off = EntropyTerms(
        SimpleNamespace(**{**vars(args), "use_adaptive_entropy": False, "entropy_coef": 0.0}), None, None, {}
    )
    assert off.mode == "detached"  # the metric and the mask only


def test_high_entropy_mask_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # the 9s are padding or tool results
    # ρ = 0.4: the 0.6 quantile of [1, 2, 3, 4, 5] is 3.4, so 4 and 5 keep their loss.
    kept = high_entropy_mask(entropy, mask, 0.4)
    assert kept.tolist() == [[False, False, False, False], [True, True, False, False]]
    # Another rank's tokens move the threshold: with [0.5] × 5 there, the 0.6 quantile of all ten (position 5.4 of
    # 0.5 0.5 0.5 0.5 0.5 1 2 3 4 5) is 1.4.
    everyone = high_entropy_mask(entropy, mask, 0.4, gather=lambda x: torch.cat([x, torch.full((5,), 0.5)]))
    assert everyone.tolist() == [[False, True, True, False], [True, True, False, False]]


def test_adaptive_entropy_coefficient_steps_by_hand():
    assert next_coef(0.1, 0.5, target=0.8, delta=0.05, low=0.0, high=0.12) == 0.12  # below target: up, capped
    assert next_coef(0.1, 0.8, target=0.8, delta=0.05, low=0.0, high=1.0) == pytest.approx(0.15)  # at target: up
    assert next_coef(0.03, 2.0, target=0.8, delta=0.05, low=0.01, high=1.0) == 0.01  # above: down, floored


def test_sampling_gap_leaves_out_inserted_tokens_and_completions_not_scored():
    nan = float("nan")
    trainer_NT = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    engine_NT = torch.tensor([[-1.5, -2.0, -9.0], [nan, nan, nan]])  # completion 1: log-probs not asked for
    sampled_NT = torch.tensor([[1, 1, 0], [1, 1, 1]])  # token 2 of completion 0: an inserted tool result
    assert sampling_gap_metrics(trainer_NT, engine_NT, sampled_NT) == {
        "sampling/sampling_logp_difference/mean": 0.25,
        "sampling/sampling_logp_difference/max": 0.5,
    }
    assert sampling_gap_metrics(trainer_NT[1:], engine_NT[1:], sampled_NT[1:]) == {}


def test_importance_ratio_metrics_over_counted_tokens_or_completions():
    weights_NT = torch.tensor([[0.5, 9.0], [1.5, 1.0]])
    mask_NT = torch.tensor([[1, 0], [1, 1]])
    assert importance_ratio_metrics(weights_NT, mask_NT) == {
        "sampling/importance_sampling_ratio/min": 0.5,
        "sampling/importance_sampling_ratio/mean": 1.0,
        "sampling/importance_sampling_ratio/max": 1.5,
    }
    per_sequence = importance_ratio_metrics(torch.tensor([[2.0], [4.0]]), mask_NT)
    assert per_sequence["sampling/importance_sampling_ratio/mean"] == 3.0
    assert importance_ratio_metrics(weights_NT, torch.zeros_like(mask_NT)) == {}
