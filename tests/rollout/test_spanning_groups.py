"""A group may span ranks, as TRL allows: only the rollout over all ranks (generation_batch_size) must hold whole
groups. Every rank reads the rollout's prompts, samples its contiguous slice of their completions, and the group
statistics are taken over every rank's rewards, so that a split group gets the advantages one process holding the
whole rollout computes. (tests/launch/test_spanning_launch.py trains so on 2 processes.)"""

import json
from types import SimpleNamespace

import pytest
import torch
import trl
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import DataLoaderConfiguration
from test_partial_groups import SIZES, accepted, build

from colograd import GRPOConfig, ScriptArguments
from colograd.config.core import ConfigError
from colograd.data.core import keep_rows, load_prompts
from colograd.data.streaming import RolloutBatches, rollout_stream
from colograd.grpo.loss import group_advantages, normalize_then_sum, spanned_advantages, weighted_rewards
from colograd.rollout.core import reward_metrics
from colograd.rollout.spans import check_share, check_spanning, per_completion, rank_share
from colograd.runs.ranks import gather_rows


def processes(monkeypatch, world: int) -> None:
    """Both configs read as if launched on `world` processes."""
    for cls in (GRPOConfig, trl.GRPOConfig):
        monkeypatch.setattr(cls, "world_size", property(lambda self: world))


# --- which completions each rank samples --------------------------------------------------------------------------


def test_each_rank_samples_its_slice_of_the_consecutive_groups():
    # 3 prompts × G=4 over 4 ranks of 3 (the module docstring's picture of `colograd.rollout.spans`).
    shares = [rank_share(3, 4, 3, rank) for rank in range(4)]
    assert shares == [(0, [3]), (0, [1, 2]), (1, [2, 1]), (2, [3])]
    with pytest.raises(ValueError, match="past the rollout"):
        rank_share(3, 4, 3, 4)


@pytest.mark.parametrize("prompts, g, world", [(32, 14, 7), (3, 4, 2), (3, 2, 2), (5, 3, 3), (7, 5, 5)])
def test_the_ranks_shares_lay_every_group_out_once_in_order(prompts, g, world):
    per_rank = prompts * g // world  # config_demo_code on 7 processes first: 64 completions per rank, 32 groups
    laid = []
    for rank in range(world):
        first, counts = rank_share(prompts, g, per_rank, rank)
        assert sum(counts) == per_rank and all(1 <= n <= g for n in counts)
        laid += per_completion(list(range(first, first + len(counts))), counts)
    assert laid == [p for p in range(prompts) for _ in range(g)]  # TRL's RepeatSampler order, cut in world slices


@pytest.mark.parametrize("prompts, g, world", [(32, 14, 7), (3, 4, 2), (5, 3, 3), (7, 5, 5)])
def test_the_truncated_prompts_share_over_ranks_is_the_rollouts(prompts, g, world):
    """Where groups span ranks, each rank counts its prompts cut per completion of its share (`Trainer.sample`), and
    the ranks' mean of `prompts/truncated_ratio` (how `log` reduces it) is the share of the rollout's prompts cut."""
    per_rank = prompts * g // world
    cut = [p % 3 == 1 for p in range(prompts)]
    ratios = []
    for rank in range(world):
        first, counts = rank_share(prompts, g, per_rank, rank)
        ratios.append(sum(per_completion(cut[first : first + len(counts)], counts)) / per_rank)
    assert sum(ratios) / world == pytest.approx(sum(cut) / prompts)


def test_a_generate_override_that_samples_whole_groups_is_refused():
    check_share(3, [1, 2])
    with pytest.raises(RuntimeError, match=r"returned 8 completions .* this rank's share is 3; sample context.counts"):
        check_share(8, [1, 2])  # G=4 of both prompts


# --- advantages: a split group gets the whole group's --------------------------------------------------------------


def ranks_gather(parts: list[torch.Tensor], rank: int):
    """What `across_ranks` gives rank `rank` when the ranks hold `parts`: every rank's values, in rank order."""
    return lambda local: torch.cat([local if r == rank else p.flatten() for r, p in enumerate(parts)])


def advantages_of(scale: str, aggregation: str, weights_F: torch.Tensor, g: int):
    """`GRPOTrainer.compute_advantages`'s function of the rewards and a gather."""

    def advantages(rewards_NF, gather):
        if aggregation == "normalize_then_sum":
            return normalize_then_sum(rewards_NF, weights_F, g, gather)
        return group_advantages(weighted_rewards(rewards_NF, weights_F), g, scale, gather)

    return advantages


CASES = [("group", "sum"), ("batch", "sum"), ("none", "sum"), ("group", "normalize_then_sum")]


@pytest.mark.parametrize("scale, aggregation", CASES)
@pytest.mark.parametrize("prompts, g, world", [(3, 4, 2), (3, 2, 2), (32, 14, 7), (5, 3, 3)])
def test_split_groups_get_the_advantages_of_one_process_holding_the_rollout(scale, aggregation, prompts, g, world):
    gen = torch.Generator().manual_seed(prompts * g + world)
    rewards_NF = torch.randint(0, 4, (prompts * g, 2), generator=gen).float()
    rewards_NF[5, :] = float("nan")  # an unscorable completion
    rewards_NF[-1, 1] = float("nan")  # a function that abstained
    weights_F = torch.tensor([1.0, 0.5])
    advantages = advantages_of(scale, aggregation, weights_F, g)
    whole_N = advantages(rewards_NF, None)  # one process holding the whole rollout
    parts = list(rewards_NF.chunk(world))
    per_rank = [spanned_advantages(advantages, part, ranks_gather(parts, r), r) for r, part in enumerate(parts)]
    assert torch.equal(torch.cat(per_rank), whole_N)
    assert whole_N.abs().sum() > 0  # the rewards differ within groups: advantages to get right


def test_a_split_group_by_hand():
    # G=2 over 2 ranks of 3: groups (1, 0) (1 | 0) (0, 0) — the middle one split; no scaling. A rank alone would see
    # one reward of it, and give it no advantage.
    rewards_NF = torch.tensor([[1.0], [0.0], [1.0], [0.0], [0.0], [0.0]])
    advantages = advantages_of("none", "sum", torch.ones(1), 2)
    parts = list(rewards_NF.chunk(2))
    per_rank = [spanned_advantages(advantages, part, ranks_gather(parts, r), r) for r, part in enumerate(parts)]
    assert torch.cat(per_rank).tolist() == [0.5, -0.5, 0.5, -0.5, 0.0, 0.0]


def test_reward_metrics_of_gathered_rewards_count_split_groups_whole():
    # Rank 0: (1, 0) and half of (1 | 1); rank 1: the other half and (0, 0). 2 of the 3 groups have zero spread.
    parts = [torch.tensor([[1.0], [0.0], [1.0]]), torch.tensor([[1.0], [0.0], [0.0]])]
    every_NF = gather_rows(parts[0], ranks_gather(parts, 0))
    metrics = reward_metrics(every_NF, torch.ones(1), 2)
    assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert metrics["reward"] == pytest.approx(0.5)


# --- the config: TRL's rule on the whole rollout -------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("group", [2, 4, 8, 14])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "-".join(f"{k[:5]}{v}" for k, v in s.items()))
def test_several_processes_accept_exactly_what_trl_accepts(monkeypatch, world, group, sizes):
    processes(monkeypatch, world)
    sizes = dict(sizes)
    if "generation_batch_size" in sizes:  # given over all ranks
        sizes["generation_batch_size"] *= world
    ours = accepted(num_generations=group, **sizes)
    assert ours == accepted(trl.GRPOConfig, num_generations=group, **sizes)
    if ours:
        args = build(num_generations=group, **sizes)
        per_rank = args.per_device_train_batch_size * args.steps_per_generation
        assert args.rollout_prompts * group == per_rank * world
        assert args.groups_span_ranks == (per_rank % group != 0)
        assert args.prompts_per_rollout == (args.rollout_prompts if args.groups_span_ranks else per_rank // group)


def test_open_r1_config_demo_codes_batch_on_7_processes_spans_ranks(monkeypatch):
    processes(monkeypatch, 7)
    # open-r1's qwen2_5-1_5b-instruct_config_demo_code.yaml: 16 per device × accumulation 4, G=14.
    args = build(per_device_train_batch_size=16, gradient_accumulation_steps=4, num_generations=14)
    assert (args.generation_batch_size, args.rollout_prompts, args.groups_span_ranks) == (448, 32, True)
    assert args.prompts_per_rollout == 32  # every rank reads the rollout's 32 prompts


def test_a_rollout_of_part_groups_over_all_ranks_is_refused_naming_a_fix(monkeypatch):
    processes(monkeypatch, 2)
    sizes = {"per_device_train_batch_size": 3, "num_generations": 4}
    assert not accepted(trl.GRPOConfig, **sizes)
    with pytest.raises(ConfigError) as err:
        build(**sizes)
    assert str(err.value) == (
        "per_device_train_batch_size=3 × steps_per_generation=1 × 2 processes = 6 completions per rollout is not a "
        "multiple of num_generations=4; set gradient_accumulation_steps to 2, or per_device_train_batch_size to 4."
    )
    assert accepted(**sizes, gradient_accumulation_steps=2) and accepted(
        per_device_train_batch_size=4, num_generations=4
    )


@pytest.mark.parametrize(
    "setting, fix",
    [
        ({"dynamic_sampling": True}, "dynamic_sampling needs each rank's rollout to hold whole groups"),
        ({"partial_rollouts": True}, "partial_rollouts needs each rank's rollout to hold whole groups"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size needs each rank's rollout to hold whole groups"),
    ],
)
def test_what_needs_whole_groups_on_a_rank_is_refused_in_one_line(monkeypatch, setting, fix):
    processes(monkeypatch, 2)
    sizes = {"per_device_train_batch_size": 3, "num_generations": 4, "gradient_accumulation_steps": 2}
    assert accepted(**sizes)
    with pytest.raises(ConfigError) as err:
        build(**sizes, **setting)
    message = str(err.value)
    assert message.startswith(fix) and "\n" not in message
    assert message.endswith(
        "= 6 completions is not a multiple of num_generations=4; set steps_per_generation to 4 or "
        f"per_device_train_batch_size to 4, or turn {next(iter(setting))} off."
    )
    assert accepted(**{**sizes, "per_device_train_batch_size": 4}, **setting) or "vllm_tensor" in fix


@pytest.mark.parametrize("setting", [{"dynamic_sampling": True}, {"partial_rollouts": True}])
def test_a_refusal_names_the_generation_batch_size_that_was_given(monkeypatch, setting):
    """Where the rollout's size was given as generation_batch_size, the fix names it: steps_per_generation beside it
    is refused, so advising it would send the user to a second refusal. The fix it names is accepted."""
    processes(monkeypatch, 2)
    sizes = {"per_device_train_batch_size": 3, "num_generations": 4, "generation_batch_size": 12}
    assert accepted(**sizes) and build(**sizes).groups_span_ranks
    with pytest.raises(ConfigError) as err:
        build(**sizes, **setting)
    message = str(err.value)
    assert "\n" not in message and "steps_per_generation" not in message
    assert "generation_batch_size=12 / 2 processes = 6 completions is not a multiple of num_generations=4" in message
    assert message.endswith(f"set generation_batch_size to 24, or turn {next(iter(setting))} off.")
    fixed = build(**{**sizes, "generation_batch_size": 24}, **setting)  # 12 a rank: whole micro-steps and groups
    assert not fixed.groups_span_ranks
    args = build(**sizes)
    with pytest.raises(ConfigError, match=r"^image prompts .* set generation_batch_size to 24\.$"):
        check_spanning(args, agents=False, images=True)


def test_agents_and_images_are_refused_and_the_rest_is_noted_once(monkeypatch, capsys):
    processes(monkeypatch, 2)
    args = build(per_device_train_batch_size=3, num_generations=4, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"^tools, environments and rollout_func sample whole groups on one rank.*"
                       r"set steps_per_generation to 4 or per_device_train_batch_size to 4\.$"):  # fmt: skip
        check_spanning(args, agents=True, images=False)
    with pytest.raises(ConfigError, match="^image prompts are sampled whole groups on one rank"):
        check_spanning(args, agents=False, images=True)
    capsys.readouterr()
    check_spanning(args, agents=False, images=False)
    note = capsys.readouterr().err
    assert note.count("colograd: note:") == 1 and "groups span ranks" in note and note.count("\n") == 1
    check_spanning(build(per_device_train_batch_size=4, num_generations=4), agents=True, images=True)
    assert capsys.readouterr().err == ""  # whole groups per rank: nothing refused, nothing said


# --- the data: every rank reads the rollout's prompts ---------------------------------------------------------------


def two_ranks() -> SimpleNamespace:
    """What the data loading reads of the accelerator of a 2-process run."""
    return SimpleNamespace(num_processes=2, dataloader_config=DataLoaderConfiguration())


def stream_batches(stream, rank: int, batch_size: int) -> list[list[str]]:
    """What rank `rank` of 2 trains on from a stream: accelerate's own preparation of the Trainer's dataloader."""
    loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, collate_fn=keep_rows)
    loader = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False,
                                 dispatch_batches=False)  # fmt: skip
    return [[row["prompt"] for row in batch] for batch in loader]


def span_args(monkeypatch, tmp_path, **kwargs) -> GRPOConfig:
    """2 processes of 3 completions × 2 micro-steps, G=4: 3 prompts a rollout, the middle one split."""
    processes(monkeypatch, 2)
    kwargs = {"per_device_train_batch_size": 3, "num_generations": 4, "gradient_accumulation_steps": 2,
              "max_steps": 3, "shuffle_dataset": False, **kwargs}  # fmt: skip
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)


def map_batches(args: GRPOConfig, dataset, rank: int) -> list[list[str]]:
    """What rank `rank` of 2 trains on from a map-style dataset: the Trainer's sampler and accelerate's sharding."""
    trainer = SimpleNamespace(args=args, accelerator=two_ranks(), resume_step=0, train_dataset=dataset)
    sampler = RolloutBatches._get_train_sampler(trainer, dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.prompts_per_rollout, sampler=sampler,
                                         collate_fn=keep_rows)  # fmt: skip
    loader = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
    return [[row["prompt"] for row in batch] for batch in loader]


def test_every_rank_reads_each_rollouts_prompts_once_per_micro_step(monkeypatch, tmp_path):
    rows = [{"prompt": f"p{i}", "target": "a"} for i in range(7)]
    args = span_args(monkeypatch, tmp_path)
    assert (args.rollout_prompts, args.prompts_per_rollout) == (3, 3)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stream = load_prompts(ScriptArguments(dataset_name=str(tmp_path / "p.jsonl")), streaming=True)
    ordered = rollout_stream(stream, args, two_ranks())
    rollouts = [["p0", "p1", "p2"]] * 2 + [["p3", "p4", "p5"]] * 2  # the 7th prompt makes no rollout
    for rank in range(2):
        assert stream_batches(ordered, rank, args.prompts_per_rollout) == rollouts
        assert map_batches(args, load_prompts(ScriptArguments(dataset_name=str(tmp_path / "p.jsonl"))), rank) == (
            rollouts
        )
    # Shuffled, the same order on both ranks (each then samples its own slice of the rollout's completions).
    shuffled = span_args(monkeypatch, tmp_path, shuffle_dataset=True)
    dataset = load_prompts(ScriptArguments(dataset_name=str(tmp_path / "p.jsonl")))
    first, second = (map_batches(shuffled, dataset, rank) for rank in range(2))
    assert first == second and first != rollouts and all(len(set(batch)) == 3 for batch in first)
