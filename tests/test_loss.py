"""The GRPO math against values worked out by hand."""

import math

import pytest
import torch

from colograd.loss import group_advantages, policy_loss


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
    loss = policy_loss(LOGPS, LOGPS, ADV, MASK, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected)


def test_clipping_caps_the_ratio_and_stops_its_gradient():
    old = torch.zeros(2, 1)
    # token 0: ratio 1.5 with A = +1 → clipped to 1.2; token 1: ratio 0.5 with A = -1 → clipped to 0.8
    logps = torch.log(torch.tensor([[1.5], [0.5]])).requires_grad_()
    loss = policy_loss(logps, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), loss_type="bnpo")
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    loss.backward()
    assert logps.grad.tolist() == [[0.0], [0.0]]


def test_unclipped_gradient_is_minus_advantage_times_ratio():
    logps = torch.zeros(2, 1, requires_grad=True)
    loss = policy_loss(logps, torch.zeros(2, 1), torch.tensor([1.0, -3.0]), torch.ones(2, 1), loss_type="bnpo")
    loss.backward()
    # d/dlogp of -(ratio * A) / 2 at ratio 1 is -A / 2
    assert logps.grad.flatten().tolist() == pytest.approx([-0.5, 1.5])


def test_padding_does_not_count():
    logps = torch.tensor([[0.0, 5.0]], requires_grad=True)
    loss = policy_loss(logps, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1, 0]]), loss_type="grpo")
    loss.backward()
    assert logps.grad[0, 1].item() == 0.0
