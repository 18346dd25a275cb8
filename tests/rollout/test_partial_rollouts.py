"""Partial rollouts (APRIL, `colograd.rollout.partial`, `colograd.engine.partial`): a rollout stops once enough groups
have finished, the rest carried to the next, continued first, their stale tokens corrected or masked.

The logic runs on groups built by hand (no engine); the slow tests sample on the CPU engine: a continued completion's
log-probs against the engine's for it in one piece, training that carries groups across steps and a checkpoint, and
2 ranks under ZeRO-3. The tiny model stops at any of 5 of its 64 tokens (`tail_model`), so that completion lengths
run from 1 token to the limit, as a long tail does.
"""

import json
import math
import os
from dataclasses import asdict

import pytest
import torch
from conftest import watch_rollouts
from datasets import Dataset, IterableDataset

from colograd.engine.partial import Group, Piecewise, joined_routes
from colograd.engine.requests import Sampling
from colograd.engine.rollout import Rollout
from colograd.engine.routing import UNKNOWN
from colograd.errors import ConfigError
from colograd.forward.batch import pad_rollout
from colograd.models import tiny
from colograd.rollout import partial as partial_module
from colograd.rollout.partial import PartialRollouts, refuse_overridden_stages, refuse_unresumable

G = 4
STOPS = [1, 40, 41, 42, 43]  # <eos> and four characters: a random model stops at ~1 token in 13


def settings(**overrides):
    defaults = dict(num_generations=G, per_device_train_batch_size=4 * G, partial_rollouts=True)
    return tiny.run_config("/tmp/unused", 1, **{**defaults, **overrides})


def tail_model(seed: int = 0):
    """The tiny Qwen2, stopping at any of `STOPS` (its generation config's end-of-sequence ids, which the engine
    stops at too)."""
    model = tiny.build_model(seed=seed)
    model.generation_config.eos_token_id = list(STOPS)
    return model


def group(name: str, lengths: list[int], versions: list[int], finished: list[bool]) -> Group:
    """A group whose completion j holds `lengths[j]` tokens sampled under `versions[j]`."""
    return Group(
        {"prompt": name, "target": "a"},
        [ord(name[0])],
        [
            Piecewise(list(range(n)), [-0.5] * n, [v] * n, "stop" if done else None)
            for n, v, done in zip(lengths, versions, finished, strict=True)
        ],
    )


# Settings


def test_both_options_are_off_by_default_and_partial_rollouts_turn_the_correction_on():
    plain = tiny.run_config("/tmp/unused", 1)
    assert not plain.partial_rollouts and not plain.mask_stale_tokens
    assert not plain.vllm_importance_sampling_correction
    corrected = settings()
    assert corrected.vllm_importance_sampling_correction and corrected.needs_engine_logps
    masked = settings(mask_stale_tokens=True)
    assert not masked.vllm_importance_sampling_correction


@pytest.mark.parametrize(
    "overrides, names",
    [
        (dict(partial_rollouts=False, mask_stale_tokens=True), "mask_stale_tokens"),
        (dict(dynamic_sampling=True), "dynamic_sampling"),
        (dict(generation_kwargs={"presence_penalty": 0.5}), "presence_penalty"),
        (dict(generation_kwargs={"min_tokens": 4}), "min_tokens"),
        (dict(generation_kwargs={"stop": ["."]}), "stop"),
        (dict(vllm_structured_outputs_regex="[ab]+"), "vllm_structured_outputs_regex"),
        (dict(partial_rollout_overprovision=0.5), "partial_rollout_overprovision"),
        (dict(partial_rollout_max_staleness=-1), "partial_rollout_max_staleness"),
    ],
)
def test_what_cannot_be_resumed_is_refused_in_one_line(overrides, names):
    with pytest.raises(ConfigError, match=names) as error:
        settings(**overrides)
    assert "\n" not in str(error.value)


def test_streams_agents_and_images_are_refused_before_start_up():
    args = settings()
    rows = [{"prompt": "ab>a:", "target": "a"}]
    stream = IterableDataset.from_generator(lambda: iter(rows))
    with pytest.raises(ConfigError, match="stream"):
        refuse_unresumable(args, stream, agents=False, images=False)
    with pytest.raises(ConfigError, match="tools"):
        refuse_unresumable(args, Dataset.from_list(rows), agents=True, images=False)
    with pytest.raises(ConfigError, match="image"):
        refuse_unresumable(args, Dataset.from_list(rows), agents=False, images=True)
    refuse_unresumable(tiny.run_config("/tmp/unused", 1), stream, agents=True, images=True)  # off: nothing refused


def test_a_subclass_whose_generate_or_sample_would_be_skipped_is_refused_in_one_line():
    """Partial rollouts continue their groups in the engine itself: a subclass's own `generate` or `sample` would
    silently never run, so it is refused; other stages (and every stage without partial rollouts) are honoured."""
    from colograd import GRPOTrainer

    class OwnGenerate(GRPOTrainer):
        def generate(self, prompt_ids, context, images=None):
            return super().generate(prompt_ids, context, images)

    class OwnSample(GRPOTrainer):
        def sample(self, rows, num_generations=None, *, evaluation=False, round=0):
            return super().sample(rows, num_generations, evaluation=evaluation, round=round)

    class OwnScore(GRPOTrainer):
        def score(self, prompts, rollout, columns):
            return super().score(prompts, rollout, columns)

    on, off = settings(), tiny.run_config("/tmp/unused", 1)
    for trainer_class in (OwnGenerate, OwnSample):
        stage = "generate" if trainer_class is OwnGenerate else "sample"
        refused = rf"^partial_rollouts .* {trainer_class.__name__}\.{stage} would never run"
        with pytest.raises(ConfigError, match=refused):
            refuse_overridden_stages(on, trainer_class, GRPOTrainer)
        refuse_overridden_stages(off, trainer_class, GRPOTrainer)
    refuse_overridden_stages(on, OwnScore, GRPOTrainer)
    refuse_overridden_stages(on, GRPOTrainer, GRPOTrainer)


def test_rows_that_a_checkpoint_could_not_hold_are_refused_before_start_up():
    """Carried groups go into checkpoints as JSON: a column JSON cannot write is refused at start, not at the first
    save (where one rank failing would leave the others waiting)."""
    dated = Dataset.from_list([{"prompt": "ab>a:", "target": "a", "blob": b"\x00\x01"}])
    with pytest.raises(ConfigError, match="JSON") as error:
        refuse_unresumable(settings(), dated, agents=False, images=False)
    assert "\n" not in str(error.value)
    refuse_unresumable(settings(), tiny.letters_dataset(8), agents=False, images=False)


# The batch


def rollout_of(stale: list[int] | None) -> Rollout:
    return Rollout(
        completion_ids=[[5, 6, 7, 8], [5, 6], [9, 9, 9], [7]],
        logps=[[-1.0] * 4, [-1.0] * 2, [-1.0] * 3, [-1.0]],
        truncated=[False] * 4,
        stale=stale,
    )


def test_stale_tokens_leave_the_loss_only_with_mask_stale_tokens_and_the_gap_metric_always():
    advantages = torch.ones(4)
    plain = pad_rollout([[3, 4]], rollout_of(None), advantages, 4, 0)
    corrected = pad_rollout([[3, 4]], rollout_of([2, 0, 3, 0]), advantages, 4, 0)
    masked = pad_rollout([[3, 4]], rollout_of([2, 0, 3, 0]), advantages, 4, 0, mask_stale_tokens=True)
    assert torch.equal(corrected["completion_mask"], plain["completion_mask"])  # corrected: every token counts
    assert masked["completion_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    for batch in (corrected, masked):
        assert torch.equal(batch["tool_mask"], masked["completion_mask"])  # the gap metric: fresh tokens only
    # With the engine's routing replayed, a completion with stale tokens leaves the comparison whole: its new tokens
    # read a context the trainer routes as the older engine did (a carried one with none takes the new routing).
    routed = rollout_of([2, 0, 3, 0])
    routed.routed = [torch.zeros(2 + len(ids), 1, 1, dtype=torch.int16) for ids in routed.completion_ids]
    replayed = pad_rollout([[3, 4]], routed, advantages, 4, 0)
    assert replayed["tool_mask"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert torch.equal(replayed["completion_mask"], corrected["completion_mask"])  # the loss's tokens unchanged
    # No stale token: the batch of a partial rollout is the plain one, bit for bit, mask or not.
    for mask in (False, True):
        fresh = pad_rollout([[3, 4]], rollout_of([0] * 4), advantages, 4, 0, mask_stale_tokens=mask)
        assert all(torch.equal(fresh[k], plain[k]) for k in plain), mask


# Carrying groups


def test_a_rollout_takes_the_first_groups_to_finish_carried_ones_first(monkeypatch):
    """The groups in flight are the carried ones, then the new rows; the rollout takes the first `want` finished in
    that order, and carries the others (finished or not) with everything they sampled."""
    partial = PartialRollouts(settings(), None, False, 0, 1)
    partial.carried = [group("old", [3, 5, 2, 4], [0] * 4, [True, True, True, False])]
    finish = {"old", "b", "c"}  # what the stand-in engine finishes: the carried group and two of three new ones

    def sample_until(engine, groups, args, version, needed, capture=None):
        for g in groups:
            for c in g.completions:
                c.ids, c.logps, c.versions = c.ids + [7], c.logps + [-0.25], c.versions + [version]
                c.finish = "stop" if g.row["prompt"] in finish else None
        return 1

    monkeypatch.setattr(partial_module, "sample_until", sample_until)
    rows = [{"prompt": name, "target": "a"} for name in "abc"]
    taken, metrics, generated = partial.take(None, rows, [[1], [2], [3]], 2, 1)
    assert [g.row["prompt"] for g in taken] == ["old", "b"]
    assert [g.row["prompt"] for g in partial.carried] == ["a", "c"]  # "c" finished, but the rollout was full
    assert generated == 4 * G  # one token under version 1 in each completion in flight
    assert metrics["partial_rollouts/resumed_groups"] == 1 and metrics["partial_rollouts/carried_groups"] == 2
    assert metrics["partial_rollouts/staleness/max"] == 1.0
    rollout = partial.rollout(taken, 1)
    assert rollout.stale == [3, 5, 2, 4] + [0] * G
    assert rollout.asked == [True] * 2 * G  # partial rollouts read every token's log-prob (the correction is on)
    assert rollout.completion_ids[1] == [0, 1, 2, 3, 4, 7] and rollout.logps[1][-1] == -0.25
    old_tokens = 3 + 5 + 2 + 4
    assert metrics["partial_rollouts/stale_token_fraction"] == pytest.approx(old_tokens / (old_tokens + 2 * G))


def test_groups_older_than_the_staleness_bound_are_dropped_and_extra_prompts_keep_the_flight_full():
    args = settings(partial_rollout_max_staleness=2, partial_rollout_overprovision=2.0)
    data = tiny.letters_dataset(64)
    partial = PartialRollouts(args, data, False, 0, 1)
    partial.carried = [
        group("v1", [2] * G, [1] * G, [False] * G),
        group("v3", [2] * G, [3] * G, [False] * G),
        group("new", [0] * G, [0] * G, [False] * G),  # nothing sampled yet: as fresh as the rollout
    ]
    assert partial.drop_stale(4) == 1 and [g.row["prompt"] for g in partial.carried] == ["v3", "new"]
    extra = partial.extra_rows(4, 4)
    assert len(extra) == 2 * 4 - 2 - 4  # 2 × 4 in flight: 2 carried, the dataloader's 4, 2 drawn
    assert extra == PartialRollouts(args, data, False, 0, 1).extra_rows(4, 4)[:2]  # seeded by the version
    partial.carried = partial.carried * 3
    assert partial.extra_rows(4, 4) == []  # enough carried


def test_extra_prompts_of_a_vision_language_run_carry_their_names_as_the_dataloaders_do():
    from colograd.data.streaming import ROW_KEY

    partial = PartialRollouts(settings(), tiny.letters_dataset(16), True, 0, 1)
    assert all(ROW_KEY in row for row in partial.extra_rows(4, 0))


def test_ranks_draw_extra_prompts_that_do_not_overlap_whatever_they_carry():
    args = settings(partial_rollout_overprovision=2.0)
    data = Dataset.from_list([{"prompt": f"p{i}", "target": "a"} for i in range(100)])
    ranks = [PartialRollouts(args, data, False, r, 2) for r in range(2)]
    ranks[0].carried = [group("c", [1] * G, [0] * G, [False] * G)]  # rank 0 carries one, rank 1 none
    drawn = [[row["prompt"] for row in p.extra_rows(4, 7)] for p in ranks]
    assert len(drawn[0]) == 3 and len(drawn[1]) == 4 and not set(drawn[0]) & set(drawn[1])


def test_carried_groups_of_a_run_on_another_number_of_ranks_are_shared_out_whole(tmp_path):
    """Saved by 2 ranks, resumed on 1 or 3: every carried group comes back exactly once, each rank every world-th of
    them all in the saving ranks' order."""
    saved = []
    for rank, prompts in enumerate((["a", "b", "c"], ["d", "e"])):
        partial = PartialRollouts(settings(), None, False, rank, 2)
        partial.carried = [group(p, [1] * G, [0] * G, [False] * G) for p in prompts]
        partial.write_state(str(tmp_path))
        saved += partial.carried
    for world in (1, 3):
        back = [PartialRollouts(settings(), None, False, rank, world) for rank in range(world)]
        for partial in back:
            partial.resume(str(tmp_path))
        assert [g for rank in range(world) for g in saved[rank::world]] == [g for p in back for g in p.carried]
    same = PartialRollouts(settings(), None, False, 1, 2)
    same.resume(str(tmp_path))
    assert same.carried == saved[3:]  # the same number of ranks: each its own


def test_carried_groups_go_into_the_checkpoint_and_come_back(tmp_path):
    partial = PartialRollouts(settings(), None, False, 1, 2)
    partial.carried = [group("x", [3, 0, 2, 1], [4, 0, 5, 4], [True, False, False, True])]
    partial.carried[0].completions[2].logps = [-0.1, float("-inf")]
    partial.write_state(str(tmp_path))
    back = PartialRollouts(settings(), None, False, 1, 2)
    back.resume(str(tmp_path))
    assert back.carried == partial.carried
    other_rank = PartialRollouts(settings(), None, False, 0, 2)
    other_rank.resume(str(tmp_path))
    assert other_rank.carried == []  # each rank reads its own file only
    json.loads((tmp_path / partial_module.STATE_DIR / "rank-1.json").read_text())  # a readable record


def test_a_completions_routing_joins_piece_by_piece():
    """Routing replay (`joined_routes`): a position an earlier piece's engine routed keeps that routing (the tokens
    after it were sampled from it), even where the next piece's engine, recomputing it under newer weights, routed it
    otherwise; the positions no earlier piece routed (the last token before the piece, never fed back until then) and
    the piece's own take the piece's."""
    before = torch.full((5, 2, 3), 7, dtype=torch.int16)  # a prompt of 3 and 2 tokens
    before[1], before[4] = UNKNOWN, UNKNOWN
    piece = torch.full((8, 2, 3), 9, dtype=torch.int16)  # the same 5 positions and 3 more
    piece[7] = UNKNOWN
    joined = joined_routes(before, piece)
    assert joined.shape == (8, 2, 3) and joined.dtype == torch.int16
    assert [int(row[0, 0]) for row in joined] == [7, 9, 7, 7, 9, 9, 9, UNKNOWN]
    assert joined_routes(None, piece) is piece


def test_carried_routing_goes_into_the_checkpoint_and_comes_back(tmp_path):
    """With routing replay each carried completion's routing is saved beside its rank's groups (a tensor each, not
    JSON) and comes back with its completion, on the same number of ranks and shared out on another."""
    args, saved = settings(routing_replay="rollout"), []
    for rank, prompts in enumerate((["a", "b", "c"], ["d", "e"])):
        partial = PartialRollouts(args, None, False, rank, 2)
        partial.carried = [group(p, [3, 0, 2, 1], [0] * G, [True, False, False, True]) for p in prompts]
        for k, carried in enumerate(partial.carried):
            for j, c in enumerate(carried.completions):
                c.routed = torch.full((1 + len(c.ids), 2, 3), 100 * rank + 10 * k + j, dtype=torch.int16)
        partial.write_state(str(tmp_path))
        saved += partial.carried
    assert (tmp_path / partial_module.STATE_DIR / "rank-0.routes.pt").exists()
    json.loads((tmp_path / partial_module.STATE_DIR / "rank-0.json").read_text())  # still a readable record

    def routes(groups):
        return [[c.routed.tolist() for c in g.completions] for g in groups]

    for world in (1, 2, 3):
        back = [PartialRollouts(args, None, False, rank, world) for rank in range(world)]
        for partial in back:
            partial.resume(str(tmp_path))
        expected = [saved[:3], saved[3:]] if world == 2 else [saved[rank::world] for rank in range(world)]
        for partial, theirs in zip(back, expected, strict=True):
            assert [g.row for g in partial.carried] == [g.row for g in theirs]
            assert routes(partial.carried) == routes(theirs)


# On the engine


def rows_of(n: int) -> list[dict]:
    data = tiny.letters_dataset(64)
    return [data[i] for i in range(n)]


@pytest.mark.slow
def test_a_resumed_completion_has_the_log_probs_the_engine_gives_it_in_one_piece(tmp_path):
    """Completions cut by a rollout that stopped early are continued under the same weights: each token's log-prob,
    the stored ones and the continued ones, equals the engine's log-prob of it in the whole sequence (prompt
    log-probs of prompt + completion, at temperature 1, where vLLM's processed and raw log-probs are the same)."""
    from colograd import GRPOTrainer
    from colograd.engine.partial import sample_until

    args = tiny.run_config(str(tmp_path), 1, num_generations=G, per_device_train_batch_size=8 * G,
                           max_completion_length=48, temperature=1.0, partial_rollouts=True)  # fmt: skip
    trainer = GRPOTrainer(tail_model(), tiny.letters_reward, args, tiny.letters_dataset(64),
                          processing_class=tiny.build_tokenizer())  # fmt: skip
    rows = rows_of(8)
    _, prompt_ids, _ = trainer.prepare_prompts(rows)
    groups = [Group(row, ids, [Piecewise() for _ in range(G)]) for row, ids in zip(rows, prompt_ids, strict=True)]
    engine = trainer.engine
    trainer.sync_for_rollout()
    with engine.awake():
        sample_until(engine, groups, args, 0, 2)
        cut = [(g, c, len(c.ids)) for g in groups for c in g.completions if c.finish is None and c.ids]
        assert sum(g.finished for g in groups) >= 2 and len(cut) >= 4
        assert not engine.llm.llm_engine.has_unfinished_requests()  # the others were aborted
        # An engine call after the cut one serves only its own requests (the cut ones were aborted).
        assert len(engine.generate(prompt_ids[:2], Sampling.of(args), num_generations=2).completion_ids) == 4
        sample_until(engine, groups, args, 0, len(groups))  # continued, under the same weights
        assert all(g.finished for g in groups)
        gaps = []
        for g, c, before in cut:
            assert len(c.ids) > before or c.finish == "length"
            whole = engine.prompt_logprobs(g.prompt_ids + c.ids)[len(g.prompt_ids) - 1 :]
            gaps.append((whole - torch.tensor(c.logps)).abs().max().item())
    assert max(gaps) < 1e-5, gaps


@pytest.fixture(scope="module")
def tail_trainer(tmp_path_factory):
    """A trainer of the stopping tiny model whose engine serves the tap tests below (IS correction on: every
    token's log-prob is asked)."""
    from colograd import GRPOTrainer

    folder = str(tmp_path_factory.mktemp("tap"))
    args = tiny.run_config(folder, 1, num_generations=G, per_device_train_batch_size=8 * G, max_completion_length=48,
                           temperature=1.0, partial_rollouts=True)  # fmt: skip
    return GRPOTrainer(tail_model(), tiny.letters_reward, args, tiny.letters_dataset(64),
                       processing_class=tiny.build_tokenizer())  # fmt: skip


def fresh_groups(trainer, n: int = 8) -> list[Group]:
    rows = rows_of(n)
    _, prompt_ids, _ = trainer.prepare_prompts(rows)
    return [Group(row, ids, [Piecewise() for _ in range(G)]) for row, ids in zip(rows, prompt_ids, strict=True)]


def cut_and_continued(engine, groups, args) -> list[tuple[Piecewise, int]]:
    """Stop once 2 groups have finished, then continue every completion to its end (under the same weights, from
    one seeded random state, on an empty prefix cache); the completions the first call cut, with their length there."""
    from colograd.engine.partial import sample_until

    engine.reset_prefix_cache()
    torch.manual_seed(0)  # vLLM's CPU sampler draws unseeded requests from torch's generator
    sample_until(engine, groups, args, 0, 2)
    cut = [(c, len(c.ids)) for g in groups for c in g.completions if c.finish is None and c.ids]
    sample_until(engine, groups, args, 0, len(groups))
    assert all(g.finished for g in groups)
    return cut


@pytest.mark.slow
def test_the_sampler_tap_gives_the_log_probs_of_the_objects_across_calls(tail_trainer, monkeypatch, objects_built):
    """The same completions sampled twice from one random state, cut by one call and continued by the next: read
    from vLLM's Logprob objects (no tap), and from the sampler tap, where vLLM builds none; the same log-probs."""
    trainer, args = tail_trainer, tail_trainer.args
    engine = trainer.engine
    trainer.sync_for_rollout()
    with engine.awake():
        tap = engine.sampler_tap()
        assert tap is not None
        monkeypatch.setattr(engine, "sampler_tap", lambda: None)
        objects = fresh_groups(trainer)
        cut_and_continued(engine, objects, args)
        assert objects_built  # the objects path builds them
        objects_built.clear()
        monkeypatch.setattr(engine, "sampler_tap", lambda: tap)
        tapped = fresh_groups(trainer)
        cut = cut_and_continued(engine, tapped, args)
    assert not objects_built and tap.installed  # no Logprob object built, and the tap held every token
    assert len(cut) >= 4 and any(len(c.ids) > before for c, before in cut)
    pairs = [
        (a, b)
        for ga, gb in zip(objects, tapped, strict=True)
        for a, b in zip(ga.completions, gb.completions, strict=True)
    ]
    assert all(a.ids == b.ids and a.finish == b.finish for a, b in pairs)  # one random state: the same tokens
    gaps = [abs(x - y) for a, b in pairs for x, y in zip(a.logps, b.logps, strict=True)]
    assert len(gaps) == sum(len(b.ids) for _, b in pairs) and max(gaps) <= 1e-6  # (NaN would fail the bound)


@pytest.mark.slow
def test_without_a_loss_that_reads_them_no_log_probs_are_asked(tail_trainer, monkeypatch, objects_built):
    """`mask_stale_tokens` without the importance-sampling correction: the loss reads no engine log-prob, so the
    requests ask none (the sampler computes none) and the completions hold NaN."""
    from colograd.engine.partial import sample_until

    trainer = tail_trainer
    args = tiny.run_config(trainer.args.output_dir, 1, num_generations=G, per_device_train_batch_size=8 * G,
                           max_completion_length=48, partial_rollouts=True, mask_stale_tokens=True)  # fmt: skip
    assert not args.needs_engine_logps
    engine = trainer.engine
    core = engine.llm.llm_engine
    asked = []
    add = core.add_request
    monkeypatch.setattr(core, "add_request", lambda rid, prompt, params, **kw: asked.append(params.logprobs) or add(
        rid, prompt, params, **kw))  # fmt: skip
    groups = fresh_groups(trainer, 4)
    trainer.sync_for_rollout()
    with engine.awake():
        sample_until(engine, groups, args, 0, 1)
    assert asked and set(asked) == {None} and not objects_built
    logps = [x for g in groups for c in g.completions for x in c.logps]
    assert logps and all(math.isnan(x) for x in logps)


@pytest.mark.slow
def test_a_missed_tap_samples_the_call_again_with_the_objects(tail_trainer, monkeypatch, caplog):
    """When the tap's rows miss a call's tokens, the call's sampling is undone and done again reading vLLM's
    objects, with one warning; the tap is uninstalled, so that later calls read the objects at once. (Last of the
    tests on `tail_trainer`: it leaves the engine without its tap.)"""
    import logging

    from colograd.engine.partial import sample_until

    trainer, args = tail_trainer, tail_trainer.args
    engine = trainer.engine
    groups = fresh_groups(trainer)
    trainer.sync_for_rollout()
    with engine.awake():
        tap = engine.sampler_tap()
        assert tap is not None and tap.installed
        sample_until(engine, groups, args, 0, 2)  # read through the tap
        carried = [(g, c, list(c.ids), list(c.logps)) for g in groups for c in g.completions if c.finish is None]
        monkeypatch.setattr(tap, "request_logps", lambda requests: None)
        with caplog.at_level(logging.WARNING, logger="colograd.engine.partial"):
            sample_until(engine, groups, args, 0, len(groups))
        assert not tap.installed and caplog.text.count("the sampler tap missed") == 1
        assert all(g.finished for g in groups)
        gaps = []
        for g, c, before, logps in carried:
            assert c.ids[: len(before)] == before and c.logps[: len(logps)] == logps  # the first call's stand
            assert len(c.ids) == len(c.logps) == len(c.versions)
            whole = engine.prompt_logprobs(g.prompt_ids + c.ids)[len(g.prompt_ids) - 1 :]
            gaps.append((whole - torch.tensor(c.logps)).abs().max().item())
    assert max(gaps) < 1e-5, gaps


@pytest.mark.slow
def test_training_carries_groups_across_steps_and_a_checkpoint(tmp_path):
    """One process on the CPU engine: groups are carried and continued, their stale tokens importance-corrected
    (ratios away from 1 there, 1 on fresh tokens: the trainer's weights are the engine's); a checkpoint holds the
    carried groups and a resumed run continues them; with mask_stale_tokens the stale tokens leave the loss."""
    from colograd import GRPOTrainer

    def build(**overrides):
        args = tiny.run_config(str(tmp_path / "run"), 3, num_generations=G, per_device_train_batch_size=6 * G,
                               max_completion_length=48, partial_rollouts=True, save_strategy="steps",
                               save_steps=2, **overrides)  # fmt: skip
        return GRPOTrainer(tail_model(), tiny.letters_reward, args, tiny.letters_dataset(64),
                           processing_class=tiny.build_tokenizer())  # fmt: skip

    trainer = build()
    rebound = watch_rollouts(trainer)
    saved = {}
    write = trainer.partial.write_state
    trainer.partial.write_state = lambda folder: saved.update({os.path.basename(folder): json.dumps(
        [asdict(g) for g in trainer.partial.carried])}) or write(folder)  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert sum(h["partial_rollouts/resumed_groups"] for h in logs) > 0
    assert max(h["partial_rollouts/stale_token_fraction"] for h in logs) > 0
    # Stale tokens after an optimizer step that moved the weights (one whose groups were all uniform does not).
    stale_step = next(h for before, h in zip(logs[:-1], logs[1:], strict=True)
                      if h["partial_rollouts/stale_token_fraction"] > 0 and before["grad_norm"] > 0)  # fmt: skip
    ratios = stale_step["sampling/importance_sampling_ratio/min"], stale_step["sampling/importance_sampling_ratio/max"]
    assert ratios[0] < 0.999 or ratios[1] > 1.001, ratios  # stale tokens: sampled by older weights
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-4  # the fresh tokens: the engine is the trainer
    assert rebound == {"weight_plan"}, rebound  # the carried groups live in `partial`, not on the trainer

    resumed = build()
    back = []
    resume = resumed.partial.resume
    resumed.partial.resume = lambda folder: resume(folder) or back.append(
        json.dumps([asdict(g) for g in resumed.partial.carried]))  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.state.global_step == 3
    # The groups carried at the checkpoint came back whole (rows, tokens, log-probs, weight versions), and the
    # resumed rollout continued them first.
    assert json.loads(saved["checkpoint-2"]) and back == [saved["checkpoint-2"]]
    assert {v for g in json.loads(back[0]) for c in g["completions"] for v in c["versions"]} <= {0, 1}
    again = [h for h in resumed.state.log_history if "loss" in h][-1]
    assert again["partial_rollouts/resumed_groups"] > 0 and math.isfinite(again["loss"])

    resumed.args.mask_stale_tokens = True
    slices = resumed.make_rollout(rows_of(6))
    stale = resumed.metrics["partial_rollouts/stale_token_fraction"][-1]
    counted = sum(int(s["completion_mask"].sum()) for s in slices)
    sampled = sum(int(s["attention_mask"][:, -s["completion_mask"].size(1) :].sum()) for s in slices)
    assert stale > 0 and counted == round(sampled * (1 - stale)), (counted, sampled, stale)


@pytest.mark.slow
def test_two_ranks_under_zero3_each_carry_their_own_groups(tmp_path_factory):
    """2 ranks under DeepSpeed ZeRO-3: each rank continues the groups it carried and trains its own batch; no rank
    waits for another's groups. (The launch is shared with dynamic sampling's test: `longtail_launch`.)"""
    from longtail_launch import longtail_runs

    runs = longtail_runs(tmp_path_factory, "partial")
    assert runs[0]["prompts"] != runs[1]["prompts"]  # each rank its own prompts, carried ones included
    for run in runs:
        assert run["sharded"] and len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"]), run
        assert sum(run["resumed"]) > 0 and run["groups"] == [6, 6, 6], run
