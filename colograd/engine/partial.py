"""The engine's request loop for partial rollouts (`colograd.rollout.partial`): completions sampled a piece at a time,
across rollouts and weight versions.

`sample_until` drives vLLM's `LLMEngine` directly (add / step / abort), one request of n = 1 per unfinished
completion, streaming each step's new tokens (`RequestOutputKind.DELTA`) into the completion with the weight
version that sampled them; their log-probs are read as tensors from the sampler at the end of the call (the
sampler tap), or from vLLM's per-token objects where the tap is not installed. It stops once enough groups have
all their completions finished, and aborts the rest: what they sampled so far is kept, and a later call continues
each as prompt + tokens so far, with what is left of its length. The engine computes a continued completion's
tokens from the same context as it would have in one piece, so their log-probs are the same
(tests/rollout/test_partial_rollouts.py).

With routing replay (`routing_replay: rollout`) each piece's routing is read from the capture on the engine's
routers (`colograd.engine.routing`) and joined to the completion's: a position an earlier piece's engine routed keeps
that routing (its tokens were sampled from it), and the new piece adds the rest (`joined_routes`).
"""

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from colograd.config.core import GRPOConfig
from colograd.engine.requests import sampled_logps, sampling_params
from colograd.engine.routing import UNKNOWN

logger = logging.getLogger(__name__)


@dataclass
class Piecewise:
    """One completion, sampled over one or more rollouts.

    ids: its tokens so far; logps: the engine's log-prob of each, after temperature; versions: the weight version
    (the optimizer step) each was sampled under; finish: vLLM's finish reason once it has finished ("stop",
    "length"), else None; routed: with routing replay, the experts the engine routed each position of its group's
    prompt and of its tokens so far to, [prompt + tokens, layers, top_k] int16 (`UNKNOWN` where none did), else None.
    """

    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    routed: torch.Tensor | None = None

    def stale(self, version: int) -> int:
        """How many of its tokens (the first ones: a completion only grows) were sampled before `version`."""
        return sum(v < version for v in self.versions)


@dataclass
class Group:
    """The G completions of one prompt, and the dataset row it came from (its reward columns); `prompt_truncated`:
    its prompt was cut to the engine's prompt limit."""

    row: dict
    prompt_ids: list[int]
    completions: list[Piecewise]
    prompt_truncated: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.completions)

    def oldest(self, version: int) -> int:
        """The weight version of its oldest token (`version` when it has none yet)."""
        return min((c.versions[0] for c in self.completions if c.versions), default=version)


def sample_until(
    engine: Any, groups: list[Group], args: GRPOConfig, version: int, needed: int, capture: Any = None
) -> int:
    """Continue every unfinished completion of `groups` under the engine's current weights (weight version
    `version`) until `needed` groups are finished, then abort the rest, keeping what they sampled.

    Requests are added in the groups' order, which vLLM schedules first come, first served: carried groups first.
    The tokens' log-probs are asked only where the loss reads them (`args.needs_engine_logps`; else NaN), and read
    as tensors from the sampler (`colograd.engine.sampler_tap`) where its tap is installed: vLLM then builds no
    per-token objects. Returns the engine steps run.

    Args:
        engine: the `colograd.engine.core.Engine` (its `vllm.LLM`, cache salt, adapter, never-sampled tokens and
            sampler tap).
        groups: the rollout's groups in flight; updated in place.
        args: the run's sampling settings (`colograd.engine.requests.sampling_params`).
        version: the weight version the engine holds.
        needed: how many groups the rollout takes.
        capture: routing replay's capture on the engine's routers (`colograd.engine.routing.RoutingCapture`): each
            completion's `routed` gains this piece's routing. None: no routing is read.
    """
    tap = engine.sampler_tap() if args.needs_engine_logps else None
    tapped = tap is not None and tap.installed
    # Where each unfinished completion stands before this call: its tokens so far are its request's prompt.
    sampled = [
        (_request_id(i, j), group, len(c.ids), c)
        for i, group in enumerate(groups)
        for j, c in enumerate(group.completions)
        if c.finish is None
    ]

    def recording() -> Any:
        if capture is None:
            return nullcontext()
        engine.llm.reset_prefix_cache()  # every position of the pieces' prompts is computed inside the capture
        return capture.capturing()  # (which forgets any earlier steps)

    with recording(), tap.capturing() if tapped else nullcontext():
        steps = _step_until(engine, groups, args, version, needed, asks=tapped or args.needs_engine_logps)
    if tapped:
        logps = tap.request_logps(
            [(request, c.ids[start:], len(group.prompt_ids) + start) for request, group, start, c in sampled]
        )
        if logps is not None:
            for (_, _, start, completion), found in zip(sampled, logps, strict=True):
                completion.logps[start:] = found
        else:
            # The tap's rows did not hold these tokens (and vLLM built no objects for them): sample them again with
            # the objects, and leave the tap off from now on.
            logger.warning(
                "colograd: the sampler tap missed a partial rollout's log-probs; reading vLLM's Logprob objects."
            )
            tap.uninstall()
            for _, _, start, completion in sampled:
                del completion.ids[start:], completion.logps[start:], completion.versions[start:]
                completion.finish = None
            with recording():
                steps = _step_until(engine, groups, args, version, needed, asks=True)
    if capture is not None:
        pieces = [
            (request, group.prompt_ids + c.ids[:start], len(c.ids) - start) for request, group, start, c in sampled
        ]
        for (_, _, start, completion), routed in zip(sampled, capture.routes(pieces), strict=True):
            # A completion with no token yet sampled nothing from an earlier piece's routing: this piece's is its own.
            completion.routed = joined_routes(completion.routed if start else None, routed)
    return steps


def joined_routes(before: torch.Tensor | None, piece: torch.Tensor) -> torch.Tensor:
    """A completion's routing after one more piece: `before` covers its prompt and its tokens before the piece,
    `piece` (`RoutingCapture.routes`) those and the piece's. A position the earlier pieces' engine routed keeps that
    routing, whatever the engine computed for it again (the tokens after it were sampled from the first); the rest
    (the last token before the piece, never fed back until now, and positions no request computed) take the piece's."""
    if before is None:
        return piece
    head = piece[: len(before)].clone()
    known = before[:, 0, 0] != UNKNOWN
    head[known] = before[known]
    return torch.cat([head, piece[len(before) :]])


def _step_until(engine: Any, groups: list[Group], args: GRPOConfig, version: int, needed: int, asks: bool) -> int:
    """`sample_until`'s request loop: add a request per unfinished completion, step until `needed` groups are
    finished, abort the rest. Each token's log-prob comes from vLLM's objects where built, else NaN (`asks` False,
    or the sampler tap capturing them)."""
    from vllm.sampling_params import RequestOutputKind

    core = engine.llm.llm_engine
    bias = {"logit_bias": dict.fromkeys(engine.suppressed, -math.inf)} if engine.suppressed else {}
    asked = {} if asks else {"logprobs": None}
    live: dict[str, tuple[int, int]] = {}  # request id -> (group, completion)
    for i, group in enumerate(groups):
        for j, completion in enumerate(group.completions):
            if completion.finish is not None:
                continue
            left = args.max_completion_length - len(completion.ids)
            # DELTA: each step's new tokens only (the objects, where built, likewise).
            params = sampling_params(
                args, None, n=1, max_tokens=left, output_kind=RequestOutputKind.DELTA, **asked, **bias
            )
            request = _request_id(i, j)
            core.add_request(
                request, engine.prompt(group.prompt_ids + completion.ids), params, lora_request=engine.lora_request
            )
            live[request] = (i, j)
    done, steps = sum(group.finished for group in groups), 0
    try:
        while live and done < needed:
            steps += 1
            for output in core.step():
                if output.request_id not in live:  # (outputs carry the id a request was added under)
                    continue
                i, j = live[output.request_id]
                sample, completion = output.outputs[0], groups[i].completions[j]
                ids = list(sample.token_ids)
                completion.ids += ids
                completion.logps += sampled_logps(sample)
                completion.versions += [version] * len(ids)
                if output.finished:
                    completion.finish = sample.finish_reason
                    del live[output.request_id]
                    done += groups[i].finished
    finally:
        # Stopped early, or by an error: no request of this call may stay in the engine, where the next
        # `LLM.generate` would collect its outputs with its own.
        if live:
            core.abort_request(list(live))
    return steps


def _request_id(group: int, completion: int) -> str:
    """The engine request of a group's completion in one `sample_until` call (vLLM runs it under this id plus a
    random suffix, which the sampler tap strips)."""
    return f"partial-{group}.{completion}"
