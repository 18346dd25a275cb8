"""Dynamic sampling (DAPO, `colograd.rollout.dynamic`): uniform groups dropped, the rollout refilled, every rank in
step.

The logic runs on rollouts built by hand (no engine); the slow tests train through `GRPOTrainer` on the CPU engine,
in one process and on 2 ranks under ZeRO-3, with rewards that leave many groups uniform.
"""

import math

import pytest
import torch
from conftest import watch_rollouts
from datasets import Dataset, IterableDataset

from colograd.config.core import GRPOConfig
from colograd.engine.rollout import Rollout
from colograd.errors import ConfigError
from colograd.models import tiny
from colograd.rollout.core import PromptImages, ScoredRollout
from colograd.rollout.dynamic import (
    ROUND_STRIDE,
    DynamicSampling,
    group_spread,
    join,
    refuse_unrefillable,
    take_groups,
)

G = 4
WEIGHTS = torch.ones(1)
same = lambda numbers: numbers  # noqa: E731 — one rank: its numbers are the largest


def scored_of(names: list[str], uniform: set[str], images: bool = False) -> ScoredRollout:
    """A rollout of one group per name: G completions each; a name in `uniform` scores 1.0 on all of them, any other
    scores 0, 1, 0, 1. Completion j of group i is [i, j], so that groups can be followed."""
    n = len(names) * G
    rewards = [1.0 if name in uniform else float(j % 2) for name in names for j in range(G)]
    key = lambda name: sum(map(ord, name))  # noqa: E731
    return ScoredRollout(
        prompts=[f"prompt {name}" for name in names],
        prompt_ids=[[key(name)] for name in names],
        columns={"name": list(names)},
        rollout=Rollout(
            completion_ids=[[key(name), j] for name in names for j in range(G)],
            logps=[[-0.5, -0.5]] * n,
            truncated=[False] * n,
            engine_prompt_ids=[[key(name), 0] for name in names] if images else None,
        ),
        rewards_NF=torch.tensor(rewards).unsqueeze(1),
        truncated_prompts=0,
        images=PromptImages([[name] for name in names], [[key(name), 0] for name in names], [{}] * len(names))
        if images
        else None,
    )


def settings(**overrides) -> GRPOConfig:
    defaults = dict(num_generations=G, per_device_train_batch_size=4 * G, dynamic_sampling=True)
    return tiny.run_config("/tmp/unused", 1, **{**defaults, **overrides})


def test_group_spread_scores_each_group_on_its_total_weighted_reward():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [2.0, 0.0], [float("nan")] * 2, [float("nan")] * 2])
    spread = group_spread(rewards, torch.tensor([1.0, 1.0]), 2)
    assert spread.tolist() == [0.0, 0.0, 0.0]  # totals 1, 1 / 2, 2 / unscored
    spread = group_spread(rewards, torch.tensor([1.0, 0.5]), 2)
    assert spread[0] > 0 and spread[1:].tolist() == [0.0, 0.0]  # weighted: 1 against 0.5


@pytest.mark.parametrize("images", [False, True])
def test_groups_are_taken_and_joined_whole(images):
    a, b = scored_of(["a", "b"], set(), images), scored_of(["c"], set(), images)
    every = join([a, b])
    assert every.columns["name"] == ["a", "b", "c"] and len(every.rollout.completion_ids) == 3 * G
    kept = take_groups(every, [2, 0], G)
    assert kept.columns["name"] == ["c", "a"] and kept.prompts == ["prompt c", "prompt a"]
    assert kept.rollout.completion_ids == b.rollout.completion_ids + a.rollout.completion_ids[:G]
    assert torch.equal(kept.rewards_NF, torch.cat([b.rewards_NF, a.rewards_NF[:G]]))
    if images:  # per prompt: the images, the engine's expanded prompts, the pixels
        assert kept.images.images == [["c"], ["a"]]
        assert kept.rollout.engine_prompt_ids == [b.prompt_ids[0] + [0], a.prompt_ids[0] + [0]]
    else:
        assert kept.images is None and kept.rollout.engine_prompt_ids is None


class Rounds:
    """A stand-in for `GRPOTrainer.sample`: scores each row's group uniform when its name is in `uniform`."""

    def __init__(self, uniform: set[str], logs: bool = False) -> None:
        self.uniform, self.logs, self.calls = uniform, logs, []

    def __call__(self, rows: list[dict], round: int) -> ScoredRollout:
        self.calls.append(([row["name"] for row in rows], round))
        names = [row["name"] for row in rows]
        scored = scored_of(names, self.uniform)
        if self.logs:  # what a reward function logs about the round's rollout: a column per completion, a metric
            scored.rollout.reward_logs.log_extra("seen", [f"{name}{j}" for name in names for j in range(G)])
            scored.rollout.reward_logs.log_metric("calls", float(round))
        return scored


NAMES = [f"p{i}" for i in range(40)]
DATA = Dataset.from_dict({"prompt": NAMES, "name": NAMES})


def test_uniform_groups_are_replaced_by_informative_ones_from_the_dataset():
    args = settings()
    uniform = set(NAMES[::2])  # half the dataset: every even prompt
    rows = [DATA[i] for i in range(4)]  # p0 p1 p2 p3: two uniform
    sample = Rounds(uniform)
    kept, metrics, dropped = DynamicSampling(args, DATA, False, 0, 1).fill(rows, sample, WEIGHTS, same, 7)
    assert len(kept.prompts) == 4 and (group_spread(kept.rewards_NF, WEIGHTS, G) > 0).all()
    assert kept.columns["name"][:2] == ["p1", "p3"]  # the first round's informative groups first, in order
    assert [r for _, r in sample.calls] == list(range(len(sample.calls)))  # rounds seeded apart
    # 2 of 4 found, 2 missing: the share found says 4 prompts, oversampled
    assert len(sample.calls[1][0]) == math.ceil(2 * 4 / 2 * args.dynamic_sampling_oversample)
    assert metrics["dynamic_sampling/rounds"] == len(sample.calls) - 1 >= 1
    sampled = sum(len(names) for names, _ in sample.calls)
    assert metrics["dynamic_sampling/discarded_groups"] == sampled - 4
    assert metrics["dynamic_sampling/kept_fraction"] == 4 / sampled
    assert metrics["dynamic_sampling/filled_groups"] == 0
    assert dropped == (sampled - 4) * G * 2  # 2 tokens per completion


def test_every_rank_runs_the_rounds_the_rank_missing_most_needs():
    """This rank has its 4 informative groups at once; another rank misses 3: this one samples alongside it (the
    collectives of sampling and scoring must meet) and keeps its own first groups."""
    args = settings()
    rows = [DATA[i] for i in (1, 3, 5, 7)]
    other = iter([[3, 5], [1, 2], [0, 0]])  # what the rank missing most misses after each round, and would sample
    sample = Rounds(set(NAMES[::2]))
    kept, metrics, _ = DynamicSampling(args, DATA, False, 0, 2).fill(
        rows, sample, WEIGHTS, lambda numbers: [max(a, b) for a, b in zip(numbers, next(other), strict=True)], 7
    )
    assert [len(names) for names, _ in sample.calls] == [4, 5, 2]
    assert kept.columns["name"] == ["p1", "p3", "p5", "p7"]
    assert metrics["dynamic_sampling/rounds"] == 2


def test_a_refill_round_samples_what_the_share_found_so_far_says_it_takes():
    ds = DynamicSampling(settings(dynamic_sampling_oversample=1.0), DATA, False, 0, 1)
    assert ds.refill_size(4, 0, 4, 4) == 0  # nothing missing
    assert ds.refill_size(4, 2, 2, 4) == 4  # half found: 2 missing take 4
    assert ds.refill_size(4, 3, 1, 8) == 24  # 1 in 8: 3 missing take 24
    assert ds.refill_size(4, 4, 0, 4) == 4  # none found: as many again
    assert ds.refill_size(4, 4, 0, 400) == 32  # at most 8 × the batch
    assert DynamicSampling(settings(dynamic_sampling_oversample=1.5), DATA, False, 0, 1).refill_size(4, 2, 2, 4) == 6


def test_refill_prompts_are_seeded_by_step_and_split_between_ranks_and_rounds():
    args = settings()
    ranks = [DynamicSampling(args, DATA, False, r, 2) for r in range(2)]
    names = lambda ds, step, drawn, count: [row["name"] for row in ds.rows(step, drawn, count)]  # noqa: E731
    first = [names(ds, 5, 0, 8) for ds in ranks]
    assert first == [names(ds, 5, 0, 8) for ds in ranks]  # the same prompts for the same step
    second = [names(ds, 5, 8, 4) for ds in ranks]  # the next round, after 8 per rank
    drawn = first[0] + first[1] + second[0] + second[1]
    assert len(set(drawn)) == len(drawn) == 24  # no prompt twice in a rollout, across ranks and rounds
    assert first[0] != names(ranks[0], 6, 0, 8)  # another step
    assert len(names(ranks[1], 5, 0, 30)) == 30  # more than the dataset holds over the ranks: wraps round


def test_the_refill_seed_is_the_runs_micro_step_after_a_resume_too():
    """The step that seeds a rollout's refills counts micro-steps from the run's start: a resumed run, whose
    micro-step count restarts at its checkpoint's optimizer step, gets the same one."""
    from types import SimpleNamespace

    from colograd import GRPOTrainer

    args = SimpleNamespace(gradient_accumulation_steps=4)
    at = lambda global_step, micro: GRPOTrainer._run_micro_step(  # noqa: E731
        SimpleNamespace(args=args, state=SimpleNamespace(global_step=global_step), _micro_step=micro)
    )
    assert [at(m // 4, m) for m in range(12)] == list(range(12))  # uninterrupted: each micro-step its own
    assert [at(2 + m // 4, m) for m in range(4)] == list(range(8, 12))  # resumed at optimizer step 2


def test_rows_of_an_image_run_carry_their_names():
    rows = DynamicSampling(settings(), DATA, True, 0, 1).rows(0, 0, 2)
    assert all(row["__colograd_row__"].startswith("train_dataset row ") for row in rows)


def test_when_rounds_run_out_the_least_uniform_groups_fill_or_the_run_stops():
    rows = [DATA[i] for i in range(4)]  # p1 the only informative prompt, and not among those refills draw from
    refills = Dataset.from_dict({"prompt": NAMES[2:], "name": NAMES[2:]})
    everything_uniform = Rounds(set(NAMES) - {"p1"})
    args = settings(dynamic_sampling_max_rounds=2)
    kept, metrics, _ = DynamicSampling(args, refills, False, 0, 1).fill(rows, everything_uniform, WEIGHTS, same, 0)
    assert kept.columns["name"][0] == "p1" and len(kept.prompts) == 4
    assert metrics["dynamic_sampling/filled_groups"] == 3 and metrics["dynamic_sampling/rounds"] == 2
    args = settings(dynamic_sampling_max_rounds=1, dynamic_sampling_fallback="error")
    with pytest.raises(ConfigError, match="after 1 refill rounds a rank has only 1 of its 4 groups"):
        DynamicSampling(args, refills, False, 0, 1).fill(rows, Rounds(set(NAMES) - {"p1"}), WEIGHTS, same, 0)


def test_a_run_that_keeps_filling_with_uniform_groups_is_warned():
    """A reward that is never informative: every rollout runs out of rounds and trains on uniform groups (loss 0).
    The run is warned after WARN_AFTER such rollouts in a row, naming the way to stop (fallback: error), then at twice
    as many; an informative rollout between them starts the count again, and a run that only sometimes fills is not
    warned."""
    import warnings

    from colograd.rollout.dynamic import WARN_AFTER

    never = Rounds(set(NAMES))
    dynamic = DynamicSampling(settings(dynamic_sampling_max_rounds=2), DATA, False, 0, 1)
    rows = [DATA[i] for i in range(4)]

    def rollouts(count: int, sample: Rounds = never) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(count):
                dynamic.fill(rows, sample, WEIGHTS, same, step)
        return [str(w.message) for w in caught if "dynamic_sampling" in str(w.message)]

    assert rollouts(WARN_AFTER - 1) == []
    (first,) = rollouts(1)
    sampled = sum(len(names) for names, _ in never.calls)  # every round of the 3 rollouts
    assert first == (
        f"dynamic_sampling: {WARN_AFTER} rollouts in a row ran out of refill rounds (2 each) and were filled with "
        f"groups whose rewards do not differ: {sampled} groups sampled for {4 * WARN_AFTER} trained, 0 of them "
        "informative (the loss is 0); check the reward functions, raise dynamic_sampling_max_rounds or "
        "dynamic_sampling_oversample, or set dynamic_sampling_fallback: error to stop the run instead."
    )
    assert len(rollouts(WARN_AFTER - 1)) == 0 and len(rollouts(1)) == 1  # again at 2 × WARN_AFTER, not at each
    assert rollouts(1, Rounds(set())) == []  # an informative rollout ends the streak
    assert rollouts(WARN_AFTER - 1) == [] and len(rollouts(1)) == 1
    sometimes = [rollouts(1, Rounds(set(NAMES) if k % 2 else set())) for k in range(4 * WARN_AFTER)]
    assert sometimes == [[]] * (4 * WARN_AFTER)
    # Rank 1 of 2 counts alike but leaves the warning to rank 0.
    quiet = DynamicSampling(settings(dynamic_sampling_max_rounds=0), DATA, False, 1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(WARN_AFTER):
            quiet.fill(rows, never, WEIGHTS, same, step)
    assert quiet.streak.rollouts == WARN_AFTER and not caught


def test_the_rounds_of_a_rollout_wake_the_engine_once():
    """Inside a rollout's wake, a round's own wake does nothing: with sleep mode each would otherwise put the engine
    back to sleep between rounds (and level 2 drop the weights the rollout's sync wrote)."""
    from types import SimpleNamespace

    from colograd.engine.core import Engine

    calls = []
    llm = SimpleNamespace(
        wake_up=lambda tags: calls.append(f"wake {tags[0]}"), sleep=lambda level: calls.append("sleep")
    )
    engine = Engine.__new__(Engine)  # no vLLM: only the wake logic is under test
    engine.sleep_level, engine.llm, engine.stale = 2, llm, False
    engine.weights_resident = False  # asleep, as `Engine.__init__` leaves an engine with sleep mode on

    def sync_for_rollout() -> None:  # as the trainer's: the weights memory back, then the write
        engine.wake_weights()
        calls.append("sync")
        engine.stale = False  # (level 2 dropped them at the last sleep)

    sync_for_rollout()
    with engine.awake():
        for _ in range(3):
            with engine.awake():
                calls.append("round")
    assert calls == ["wake weights", "sync", "wake kv_cache", "round", "round", "round", "sleep"]
    sync_for_rollout()  # the next rollout wakes it again
    with engine.awake():
        pass
    assert calls[-4:] == ["wake weights", "sync", "wake kv_cache", "sleep"]


def test_a_rank_with_its_groups_stops_too_when_another_rank_runs_out_of_rounds():
    """The error fallback reads the agreed count: this rank found its 4 groups, another still misses 2 after the
    last round, and this rank raises with it (it would otherwise wait in the next collective alone)."""
    args = settings(dynamic_sampling_max_rounds=1, dynamic_sampling_fallback="error")
    other = lambda numbers: [max(numbers[0], 2), max(numbers[1], 4)]  # noqa: E731
    with pytest.raises(ConfigError, match="a rank has only 2 of its 4 groups"):
        DynamicSampling(args, DATA, False, 0, 2).fill(
            [DATA[i] for i in (1, 3, 5, 7)], Rounds(set()), WEIGHTS, other, 0
        )


def test_the_fallback_fills_with_the_least_uniform_groups_first():
    """With a tolerance, groups whose rewards differ a little are uniform too; the fallback trains those that differ
    most of them."""
    scored = scored_of(["a", "b", "c"], {"a", "b", "c"})
    scored.rewards_NF = torch.tensor([1.0, 1.0, 1.0, 1.001] + [1.0] * 4 + [1.0, 1.01, 1.0, 1.0]).unsqueeze(1)
    args = settings(dynamic_sampling_max_rounds=0, dynamic_sampling_std_eps=0.1)
    rows = [{"name": n} for n in "abc"]
    kept, metrics, _ = DynamicSampling(args, DATA, False, 0, 1).fill(rows, lambda r, k: scored, WEIGHTS, same, 0)
    assert kept.columns["name"] == ["c", "a", "b"] and metrics["dynamic_sampling/filled_groups"] == 3


def test_normalize_then_sum_keeps_groups_whose_totals_tie_but_whose_functions_differ():
    """normalize_then_sum normalises each function within the group before summing: a group whose totals tie
    (1 + 0, 0 + 1) still has nonzero advantages when the weights differ, so it is informative; one where every
    function ties is not."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([1.0, 1.0])
    assert group_spread(rewards, weights, 2).tolist() == [0.0, 0.0]  # totals 1, 1 / 2, 2
    per_function = group_spread(rewards, weights, 2, per_function=True)
    assert per_function[0] > 0 and per_function[1] == 0
    args = settings(multi_objective_aggregation="normalize_then_sum")
    assert DynamicSampling(args, DATA, False, 0, 1).per_function


def test_what_rewards_log_follows_the_kept_groups():
    sample = Rounds(set(NAMES[::2]), logs=True)
    kept, _, _ = DynamicSampling(settings(), DATA, False, 0, 1).fill(
        [DATA[i] for i in range(4)], sample, WEIGHTS, same, 3
    )
    assert len(sample.calls) > 1  # refill rounds ran
    extra, metrics = kept.rollout.reward_logs.take()
    assert extra["seen"] == [f"{name}{j}" for name in kept.columns["name"] for j in range(G)]
    assert metrics["calls"] == sum(range(len(sample.calls))) / len(sample.calls)


def test_what_cannot_be_refilled_is_refused_before_start_up():
    args = settings()
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "a"}]))
    with pytest.raises(ConfigError, match="draws its refill prompts from train_dataset by index"):
        refuse_unrefillable(args, stream, agents=False)
    with pytest.raises(ConfigError, match="with tools, environment_factory or rollout_func is not supported"):
        refuse_unrefillable(args, DATA, agents=True)
    refuse_unrefillable(settings(dynamic_sampling=False), stream, agents=True)  # off: nothing to refuse
    with pytest.raises(ConfigError, match="dynamic_sampling_fallback='drop' is unknown"):
        settings(dynamic_sampling_fallback="drop")
    with pytest.raises(ConfigError, match="dynamic_sampling_oversample=0.5: set it to 1 or more"):
        settings(dynamic_sampling_oversample=0.5)


def half_uniform_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """The letters reward, except that prompts asking for 'a' or 'b' score 0.5 whatever the completion: their groups
    are uniform."""
    return [
        0.5 if t in "ab" else (c.count(t) / len(c) if c else 0.0) for c, t in zip(completions, target, strict=True)
    ]


@pytest.mark.slow
def test_a_rollout_trains_on_informative_groups_only(tmp_path):
    """GRPOTrainer on the CPU engine, one process: the rows' own sampling has uniform groups, and the rollout dynamic
    sampling makes of the same rows trains none (every group's advantages nonzero); the metrics say how many rounds
    it took, and whole steps train."""
    from colograd import GRPOTrainer

    data = tiny.letters_dataset(256)
    rows = [data[i] for i in range(8)]
    args = tiny.run_config(str(tmp_path), 2, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    trainer = GRPOTrainer(tiny.build_model(), half_uniform_reward, args, data, processing_class=tiny.build_tokenizer())
    rebound = watch_rollouts(trainer)
    trainer.sync_for_rollout()
    plain = trainer.sample(rows)  # the first round alone: what a rollout without dynamic sampling trains
    assert (group_spread(plain.rewards_NF, trainer.reward_weights, args.num_generations) == 0).sum() >= 2
    steps, generate = [], trainer.engine.generate
    trainer.engine.generate = lambda *a, **k: steps.append(k["step"]) or generate(*a, **k)
    advantages = torch.cat([part["advantages"] for part in trainer.make_rollout(rows)])
    trainer.engine.generate = generate
    assert len(steps) >= 2 and steps == [steps[0] + k * ROUND_STRIDE for k in range(len(steps))]  # rounds apart
    assert (advantages.view(-1, args.num_generations).abs().sum(1) > 0).all()
    metrics = trainer.metrics
    assert metrics["dynamic_sampling/rounds"][0] >= 1 and metrics["frac_reward_zero_std"][0] == 0
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert rebound == set(), rebound  # the refill rounds leave nothing on the trainer (its plan was built above)


@pytest.mark.slow
def test_ranks_run_the_same_rounds_under_zero3(tmp_path_factory):
    """2 ranks under DeepSpeed ZeRO-3, where rank 0's reward leaves many more groups uniform than rank 1's: both
    ranks run the rounds the rank missing most needs (each deciding alone, they ran 2 and 1 rounds: tried), and each
    trains only on informative groups. (The launch is shared with partial rollouts' test: `longtail_launch`.)"""
    from longtail_launch import longtail_runs

    runs = longtail_runs(tmp_path_factory, "dynamic")
    assert runs[0]["rounds"] == runs[1]["rounds"] and max(runs[0]["rounds"]) >= 1, runs
    assert runs[0]["first_round_found"] != runs[1]["first_round_found"], runs  # the ranks needed different rounds
    for run in runs:
        assert run["sharded"] and len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"])
        assert all(count == 0 for count in run["uniform_kept"]), run
