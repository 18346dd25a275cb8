"""A micro-step smaller than a group: `per_device_train_batch_size` need not be a multiple of `num_generations`,
as in TRL; the rollout over all ranks (generation_batch_size) must hold whole groups. With one process that is a
rank's rollout, exactly TRL's rule; with several, a group may also span ranks
(tests/rollout/test_spanning_groups.py)."""

import re

import pytest
import torch
import trl
from conftest import ROOT, refused

from colograd import GRPOTrainer
from colograd.config.core import ConfigError, GRPOConfig
from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout, split_rows
from colograd.forward.logps import completion_logps, pack_shared
from colograd.forward.packing import prompt_sharing_cost
from colograd.grpo.loss import group_advantages
from colograd.models import tiny
from colograd.preflight.core import check_size

TINY = str(ROOT / "recipes/grpo_tiny.yaml")


def build(cls: type = GRPOConfig, **kwargs) -> GRPOConfig:
    return cls(output_dir="unused", report_to="none", bf16=False, **kwargs)


def accepted(cls: type = GRPOConfig, **kwargs) -> bool:
    try:
        build(cls, **kwargs)
    except (ConfigError, ValueError):  # ConfigError is colograd's; TRL raises ValueError
        return False
    return True


# Every way a rollout's size is given: per_device_train_batch_size with gradient_accumulation_steps (the default
# steps_per_generation), with steps_per_generation, or with generation_batch_size.
SIZES = [
    {"per_device_train_batch_size": b, "gradient_accumulation_steps": s} for b in range(1, 7) for s in range(1, 5)
] + [{"per_device_train_batch_size": b, "steps_per_generation": s} for b in (1, 2, 3, 4) for s in (1, 2, 3)]
SIZES += [{"per_device_train_batch_size": b, "generation_batch_size": b * s} for b in (2, 3) for s in (1, 2, 4)]


@pytest.mark.parametrize("group", [2, 3, 4, 8])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "-".join(f"{k[:5]}{v}" for k, v in s.items()))
def test_one_process_accepts_exactly_what_trl_accepts(group, sizes):
    ours = accepted(num_generations=group, **sizes)
    assert ours == accepted(trl.GRPOConfig, num_generations=group, **sizes)
    if ours:
        args = build(num_generations=group, **sizes)
        rollout = args.per_device_train_batch_size * args.steps_per_generation
        assert args.prompts_per_rollout * group == rollout  # whole groups, however a micro-step cuts them


def test_a_trl_recipe_with_a_micro_step_smaller_than_a_group_is_accepted():
    args = build(per_device_train_batch_size=4, num_generations=8, gradient_accumulation_steps=2)
    assert (args.steps_per_generation, args.generation_batch_size, args.prompts_per_rollout) == (2, 8, 1)
    args = build(per_device_train_batch_size=1, num_generations=8, gradient_accumulation_steps=16)
    assert args.prompts_per_rollout == 2


@pytest.mark.parametrize(
    "sizes, message",
    [
        (
            {"per_device_train_batch_size": 4, "num_generations": 8},
            "per_device_train_batch_size=4 × steps_per_generation=1 = 4 completions per rank and rollout is not a "
            "multiple of num_generations=8; set gradient_accumulation_steps to 2, or per_device_train_batch_size "
            "to 8.",
        ),
        (
            {"per_device_train_batch_size": 2, "num_generations": 8, "gradient_accumulation_steps": 3},
            "per_device_train_batch_size=2 × steps_per_generation=3 = 6 completions per rank and rollout is not a "
            "multiple of num_generations=8; set gradient_accumulation_steps to 4, or per_device_train_batch_size "
            "to 8.",
        ),
        (
            {"per_device_train_batch_size": 6, "num_generations": 4, "steps_per_generation": 3},
            "per_device_train_batch_size=6 × steps_per_generation=3 = 18 completions per rank and rollout is not a "
            "multiple of num_generations=4; set steps_per_generation to 4, or per_device_train_batch_size to 8.",
        ),
        (
            {"per_device_train_batch_size": 4, "num_generations": 8, "generation_batch_size": 12},
            "per_device_train_batch_size=4 × steps_per_generation=3 = 12 completions per rank and rollout is not a "
            "multiple of num_generations=8; set generation_batch_size to 16.",
        ),
    ],
)
def test_the_refusal_names_the_values_and_a_fix(sizes, message):
    with pytest.raises(ConfigError) as err:
        build(**sizes)
    assert str(err.value) == message


FIX = re.compile(r"set (\w+) to (\d+)")


@pytest.mark.parametrize("group", [3, 4, 8])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "-".join(f"{k[:5]}{v}" for k, v in s.items()))
def test_each_fix_named_is_accepted_and_the_nearest_one_up(group, sizes):
    try:
        build(num_generations=group, **sizes)
        return
    except ConfigError as err:
        fixes = FIX.findall(str(err))
    assert fixes
    for name, value in fixes:
        value = int(value)
        assert accepted(num_generations=group, **{**sizes, name: value})
        # Every value between the given one and the fix is refused: the fix is the nearest one up.
        assert not any(accepted(num_generations=group, **{**sizes, name: v}) for v in range(sizes[name], value))


@pytest.fixture
def two_processes(monkeypatch):
    """Both configs read as if launched on 2 processes."""
    for cls in (GRPOConfig, trl.GRPOConfig):
        monkeypatch.setattr(cls, "world_size", property(lambda self: 2))


def test_several_processes_let_a_group_span_ranks(two_processes):
    sizes = {"per_device_train_batch_size": 4, "num_generations": 8}
    assert accepted(trl.GRPOConfig, **sizes)  # TRL's 8 completions over both ranks form one group
    args = build(**sizes)
    assert (args.generation_batch_size, args.rollout_prompts, args.prompts_per_rollout) == (8, 1, 1)
    assert args.groups_span_ranks
    args = build(**sizes, gradient_accumulation_steps=2)
    assert (args.generation_batch_size, args.prompts_per_rollout, args.groups_span_ranks) == (16, 1, False)


def test_several_processes_refused_by_trl_are_refused(two_processes):
    sizes = {"per_device_train_batch_size": 3, "num_generations": 4}
    assert not accepted(trl.GRPOConfig, **sizes)
    with pytest.raises(ConfigError) as err:
        build(**sizes)
    assert "× 2 processes = 6 completions per rollout is not a multiple of num_generations=4;" in str(err.value)


def test_the_cli_refuses_in_one_line_before_start_up(tmp_path):
    # grpo_tiny: num_generations 8, gradient_accumulation_steps 1.
    line = refused("--config", TINY, "--output_dir", str(tmp_path), "--per_device_train_batch_size", "4")
    assert line.endswith("set gradient_accumulation_steps to 2, or per_device_train_batch_size to 8.")


def test_a_dataset_must_fill_one_rollout_of_whole_prompts():
    args = build(per_device_train_batch_size=2, num_generations=8, gradient_accumulation_steps=8)
    check_size(2, args)  # 2 × 8 completions: 2 prompts
    with pytest.raises(ConfigError, match=r"has 1 usable rows, fewer than one rollout batch: 2 prompts"):
        check_size(1, args)


def _rollout(prompts: int, group: int) -> tuple[list[list[int]], Rollout]:
    """`prompts` prompts of other lengths, `group` completions each of other lengths (tokens the tiny model
    knows)."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(3, 40, (3 + 2 * i,), generator=gen).tolist() for i in range(prompts)]
    completions = [torch.randint(3, 40, (1 + i % 5,), generator=gen).tolist() for i in range(prompts * group)]
    return prompt_ids, Rollout(completions, [[0.0] * len(c) for c in completions], [False] * len(completions))


def test_a_slice_that_cuts_groups_shares_their_prompts_and_computes_the_same_logps():
    # 3 prompts × 4 completions over 4 micro-steps of 3: slices [p0 p0 p0] [p0 p1 p1] [p1 p1 p2] [p2 p2 p2].
    prompt_ids, rollout = _rollout(prompts=3, group=4)
    rewards = torch.arange(12.0) % 5
    batch = pad_rollout(prompt_ids, rollout, group_advantages(rewards, 4), 4, pad_token_id=0)
    slices = split_rows(batch, 4)
    model = tiny.build_model()
    cost = prompt_sharing_cost(model)
    with torch.no_grad():
        for part in slices:
            alone = completion_logps(model, part)
            shared = completion_logps(model, part, share_prompts=cost)
            assert torch.allclose(shared, alone, atol=1e-5)
            # Each run of one prompt's rows, whole group or part of one, computes that prompt once.
            prompt_N = part["attention_mask"][:, : -part["completion_ids"].size(1)].sum(1).tolist()
            runs = [i == 0 or prompt_N[i] != prompt_N[i - 1] for i in range(len(prompt_N))]
            once = sum(p for p, first in zip(prompt_N, runs, strict=True) if first)
            assert pack_shared(part, cost).tokens == part["attention_mask"].sum() - sum(prompt_N) + once
    # The advantages of a group cut between slices are its whole group's, not each slice's own.
    assert torch.equal(torch.cat([part["advantages"] for part in slices]), group_advantages(rewards, 4))
    assert not torch.allclose(slices[1]["advantages"][1:], group_advantages(rewards[4:6], 2))


def distinct_letters(completions: list[str], **kwargs) -> list[float]:
    """A reward that differs between completions of a random model: distinct characters per completion."""
    return [float(len(set(c))) for c in completions]


class Recorded(GRPOTrainer):
    """Records each rollout's rows, rewards and micro-step slices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts: list[dict] = []

    def compute_advantages(self, rewards_NF):
        self.rollouts.append({"rewards": rewards_NF[:, 0].clone()})
        return super().compute_advantages(rewards_NF)

    def make_rollout(self, rows):
        slices = super().make_rollout(rows)
        self.rollouts[-1] |= {"rows": rows, "slices": slices}
        return slices


@pytest.mark.slow
def test_a_micro_step_smaller_than_a_group_trains(tmp_path):
    # TRL's rule holds (2 × 2 = 4 completions per rollout, one group of 4); each micro-step has half a group.
    args = tiny.run_config(
        str(tmp_path), 3, per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2,
        temperature=1.5, logging_steps=1,
    )  # fmt: skip
    assert args.prompts_per_rollout == 1
    model = tiny.build_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = Recorded(
        model=model,
        reward_funcs=distinct_letters,
        args=args,
        train_dataset=tiny.letters_dataset(16),
        processing_class=tiny.build_tokenizer(),
    )
    trainer.train()
    assert trainer.state.global_step == 3
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert len(trainer.rollouts) == 3  # one rollout per optimizer step, of one prompt
    for rollout in trainer.rollouts:
        assert len(rollout["rows"]) == 1
        slices = rollout["slices"]
        assert [len(part["advantages"]) for part in slices] == [2, 2]
        # Both micro-steps train completions of the same prompt: the group spans them.
        prompts = torch.cat([part["input_ids"][:, : -part["completion_ids"].size(1)] for part in slices])
        assert (prompts == prompts[0]).all()
        advantages = torch.cat([part["advantages"] for part in slices])
        assert torch.allclose(advantages, group_advantages(rollout["rewards"], 4), atol=1e-6)
    assert any(r["rewards"].std() > 0 for r in trainer.rollouts)  # some group had advantages to train on
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed
