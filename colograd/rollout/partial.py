"""APRIL's partial rollouts: a rollout that does not wait for its slowest completions.

Generation otherwise runs until the longest completion of the batch has finished, the engine decoding ever fewer
sequences at the end. `PartialRollouts` keeps more groups in flight than a rollout takes (`partial_rollout_
overprovision`), stops the engine once a rollout's worth of groups have all their completions finished
(`colograd.engine.partial.sample_until`), and carries the others, with the tokens they sampled so far, their
log-probs and the weight version of each token, to the next rollout, where they are continued first.

A weight version is an optimizer step: tokens sampled at `global_step` s came from the weights of s optimizer steps
(rollouts between two optimizer steps share them). A carried group whose oldest token is more than
`partial_rollout_max_staleness` versions old is dropped at the start of a rollout. Tokens sampled under older weights
than the rollout's are stale: the loss corrects them with the importance-sampling weights of their stored log-probs
(the engine's, under the weights that sampled them), or leaves them out (`mask_stale_tokens`).

Groups stay on the rank that sampled them, and every rank takes its own batch's worth each rollout, so no rank waits
for another. The carried groups are part of the run's state: each rank writes its own into every checkpoint, and a
resumed run continues them, or drops them by the same staleness rule.
"""

import json
import math
import os
from dataclasses import asdict, replace
from typing import Any

import torch

from colograd.data.streaming import NumberedRows
from colograd.engine.partial import Group, Piecewise, sample_until
from colograd.engine.rollout import Rollout
from colograd.engine.routing import UNKNOWN
from colograd.errors import ConfigError
from colograd.rollout.dynamic import draw_rows, refuse_stream

STATE_DIR = "partial_rollouts"  # in a checkpoint: one file per rank of its carried groups
ROUTES = ".routes.pt"  # beside a rank's groups, with routing replay: its completions' routing


def _routes(groups: list[Group]) -> list[torch.Tensor]:
    """Each completion's routing, as `Rollout.routed` holds it; a completion carried from a checkpoint saved without
    routing replay that finished before it, all `UNKNOWN` (the trainer routes those positions itself and counts them
    in `moe/routing_replay/unreplayed`)."""
    known = next((c.routed for group in groups for c in group.completions if c.routed is not None), None)
    if known is None:
        raise RuntimeError("routing replay: no completion of the partial rollout carries the engine's routing")
    return [
        c.routed
        if c.routed is not None
        else torch.full((len(group.prompt_ids) + len(c.ids), *known.shape[1:]), UNKNOWN, dtype=known.dtype)
        for group in groups
        for c in group.completions
    ]


def _plain(completion: Piecewise) -> dict:
    """A carried completion as JSON writes it: its routing (a tensor) is saved beside (`ROUTES`)."""
    return {name: value for name, value in asdict(replace(completion, routed=None)).items() if name != "routed"}


def refuse_unresumable(args: Any, train_dataset: Any, agents: bool, images: bool) -> None:
    """Refuse, before start-up, what partial rollouts cannot carry over: a stream (extra prompts are drawn by index),
    agent rollouts (their tool calls and environments are not resumable mid-turn), image prompts, and rows JSON
    cannot write (carried groups go into checkpoints as JSON; a dataset's columns have one type each, so its first
    row stands for all)."""
    if not args.partial_rollouts:
        return
    refuse_stream(train_dataset, "partial_rollouts", "extra prompts")
    # Images first: their rows would fail the JSON check below, whose fix (cast the column) does not apply.
    if images:
        raise ConfigError(
            "images are not supported with partial_rollouts yet (a continued request would send its images "
            "again); turn partial_rollouts off for vision-language runs with images."
        )
    if train_dataset is not None and len(train_dataset):
        try:
            json.dumps(train_dataset[0])
        except (TypeError, ValueError) as error:
            raise ConfigError(
                "partial_rollouts writes the rows of carried groups into checkpoints as JSON, and train_dataset's "
                f"rows hold a value JSON cannot write ({error}); cast that column to text or numbers, or turn "
                "partial_rollouts off."
            ) from None
    if agents:
        raise ConfigError(
            "partial_rollouts with tools, environment_factory or rollout_func is not supported (a turn cut short "
            "cannot be resumed with its tool calls); turn partial_rollouts off for agent runs."
        )


def refuse_overridden_stages(args: Any, trainer_class: type, base: type) -> None:
    """Refuse a subclass's own `sample` or `generate` under partial rollouts: their rollouts continue carried groups
    in the engine itself (`PartialRollouts.take`), so those stages would never run."""
    if not args.partial_rollouts:
        return
    for stage in ("sample", "generate"):
        if getattr(trainer_class, stage) is not getattr(base, stage):
            raise ConfigError(
                f"partial_rollouts continues its groups in the engine itself, so {trainer_class.__name__}.{stage} "
                "would never run; turn partial_rollouts off, or leave that stage to GRPOTrainer."
            )


class PartialRollouts:
    """The groups a rank has in flight between rollouts, and how a rollout takes its batch from them.

    Args:
        args: the run's config (`partial_rollout_*`, `num_generations`, lengths, sampling).
        dataset: the training dataset (in memory: extra prompts are drawn from it by index).
        numbered: the rows carry their names (`NumberedRows`), as the dataloader's do for a vision-language model.
        rank, world: this process's place among the ranks.
    """

    def __init__(self, args: Any, dataset: Any, numbered: bool, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.dataset = NumberedRows(dataset) if numbered and dataset is not None else dataset
        self.carried: list[Group] = []  # unfinished (or finished, not taken) groups, oldest first

    def drop_stale(self, version: int) -> int:
        """Drop the carried groups whose oldest token is more than `partial_rollout_max_staleness` versions behind
        `version`; returns how many were."""
        bound = self.args.partial_rollout_max_staleness
        kept = [group for group in self.carried if version - group.oldest(version) <= bound]
        dropped, self.carried = len(self.carried) - len(kept), kept
        return dropped

    def extra_rows(self, want: int, step: int) -> list[dict]:
        """The prompts drawn from the dataset to keep `partial_rollout_overprovision` × `want` groups in flight,
        beside the carried groups and the dataloader's `want` rows (none when those are enough); seeded by the
        rollout's `step` (the run's micro-step), each rank its own slice."""
        target = math.ceil(want * self.args.partial_rollout_overprovision)
        count = max(0, target - len(self.carried) - want)
        # Each rank's slice of the permutation is as long as any rank's draw may be, so that the slices of ranks
        # carrying different counts do not overlap.
        if not count:
            return []
        return draw_rows(self.dataset, self.args.seed, step, self.rank, self.world, 0, target)[:count]

    def take(
        self,
        engine: Any,
        rows: list[dict],
        prompt_ids: list[list[int]],
        want: int,
        version: int,
        truncated: list[bool] | None = None,
    ) -> tuple[list[Group], dict[str, float], int]:
        """Sample until `want` groups are finished, carried groups continued first, then the new `rows` (with their
        prompts' `prompt_ids`, and whether each was `truncated` to fit); keep the rest for the next rollout.

        Returns:
            The `want` finished groups, oldest first; the metrics (`partial_rollouts/*`); the completion tokens
            generated under this version, in every group (taken or carried).
        """
        g = self.args.num_generations
        cut = truncated or [False] * len(rows)
        fresh = [
            Group(row, ids, [Piecewise() for _ in range(g)], was_cut)
            for row, ids, was_cut in zip(rows, prompt_ids, cut, strict=True)
        ]
        resumed, flight = len(self.carried), self.carried + fresh
        capture = engine.routing_capture() if self.args.routing_replay == "rollout" else None
        steps = sample_until(engine, flight, self.args, version, want, capture)
        finished = [i for i, group in enumerate(flight) if group.finished][:want]
        if len(finished) < want:  # `sample_until` returns only once `want` have finished, or every request has
            raise RuntimeError(
                f"partial rollouts: {len(finished)} of {want} groups finished; the engine stopped early"
            )
        chosen = set(finished)
        taken = [flight[i] for i in finished]
        self.carried = [group for i, group in enumerate(flight) if i not in chosen]
        tokens = [c for group in taken for c in group.completions]
        stale = sum(c.stale(version) for c in tokens)
        staleness = [version - group.oldest(version) for group in taken]
        generated = sum(v == version for group in flight for c in group.completions for v in c.versions)
        metrics = {
            "partial_rollouts/resumed_groups": float(sum(i < resumed for i in finished)),
            "partial_rollouts/carried_groups": float(len(self.carried)),
            "partial_rollouts/in_flight_groups": float(len(flight)),
            "partial_rollouts/stale_token_fraction": stale / max(1, sum(len(c.ids) for c in tokens)),
            # (`/max` and `/mean`: a logging window reduces them so, over steps and ranks.)
            "partial_rollouts/staleness/mean": sum(staleness) / max(1, len(staleness)),
            "partial_rollouts/staleness/max": float(max(staleness, default=0)),
            "partial_rollouts/engine_steps": float(steps),
        }
        return taken, metrics, generated

    def rollout(self, groups: list[Group], version: int) -> Rollout:
        """The finished `groups` as a rollout of this version: completions in group order, each with its stale
        token count, and whether the engine was asked its tokens' log-probs (`sample_until` asks them of every
        token where the loss reads them), so that a NaN the engine gave in place of one stops the parity guard."""
        completions = [c for group in groups for c in group.completions]
        return Rollout(
            completion_ids=[list(c.ids) for c in completions],
            logps=[list(c.logps) for c in completions],
            truncated=[c.finish == "length" for c in completions],
            stale=[c.stale(version) for c in completions],
            asked=[self.args.needs_engine_logps] * len(completions),
            routed=_routes(groups) if self.args.routing_replay == "rollout" else None,
        )

    def write_state(self, folder: str) -> None:
        """Write this rank's carried groups into the checkpoint being saved in `folder` (every rank writes its own):
        their rows and tokens as JSON, and with routing replay their completions' routing beside it (a tensor each)."""
        os.makedirs(os.path.join(folder, STATE_DIR), exist_ok=True)
        routes = [[c.routed for c in group.completions] for group in self.carried]
        groups = [
            {**asdict(replace(group, completions=[])), "completions": [_plain(c) for c in group.completions]}
            for group in self.carried
        ]
        with open(os.path.join(folder, STATE_DIR, f"rank-{self.rank}.json"), "w") as f:
            json.dump(groups, f)
        if any(r is not None for group in routes for r in group):
            torch.save(routes, os.path.join(folder, STATE_DIR, f"rank-{self.rank}{ROUTES}"))

    def resume(self, checkpoint: str | None) -> None:
        """Take this rank's carried groups from the checkpoint training resumes from; a checkpoint saved without
        partial rollouts carries none. Saved by another number of ranks (`colograd.runs.checkpoints.resharded`),
        every rank's groups are shared out: rank r takes every world-th of them all, in the saving ranks' order."""
        if not checkpoint:
            return
        folder = os.path.join(checkpoint, STATE_DIR)
        saved = sorted(
            (
                int(name[len("rank-") : -len(".json")])
                for name in os.listdir(folder)
                if name.startswith("rank-") and name.endswith(".json")
            )
            if os.path.isdir(folder)
            else []
        )
        moved = bool(saved) and saved[-1] + 1 != self.world  # saved by another number of ranks
        groups, routes = [], []
        for rank in saved if moved else [self.rank]:
            path = os.path.join(folder, f"rank-{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    these = json.load(f)
                groups += these
                routed = os.path.join(folder, f"rank-{rank}{ROUTES}")
                saved_routes = torch.load(routed) if os.path.exists(routed) else None
                routes += saved_routes or [[None] * len(g["completions"]) for g in these]
        if moved:
            groups, routes = groups[self.rank :: self.world], routes[self.rank :: self.world]
        self.carried = []
        for g, routed in zip(groups, routes, strict=True):
            completions = [Piecewise(**c, routed=r) for c, r in zip(g["completions"], routed, strict=True)]
            self.carried.append(Group(**{**g, "completions": completions}))
