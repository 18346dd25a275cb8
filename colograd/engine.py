"""The colocated engine: one `vllm.LLM` per training process, in that process, on that process's device.

The engine starts with dummy weights and receives the trainer's weights through `load_weights` (see
`colograd.sync`) before its first generation, so it never reads a checkpoint from disk and works the same
for a hub model, a local folder, or a model built in memory.
"""

import copy
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Keep vLLM's engine core in this process (no extra process per rank) and its logs to what matters.
# Both must be set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
import torch.distributed as dist
from peft import PeftModel
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from colograd.config import GRPOConfig


@dataclass
class Rollout:
    """What the engine returns for N = prompts × G completions, groups contiguous.

    completion_ids: token ids of each completion (ends with EOS when the model stopped by itself).
    logps: the engine's log-prob of each sampled token, after temperature (same length as its ids).
    truncated: whether each completion was cut at max_completion_length.
    """

    completion_ids: list[list[int]]
    logps: list[list[float]]
    truncated: list[bool]


class Engine:
    """A vLLM engine that lives in this training process.

    Args:
        model: the trained model; its config (not its weights) defines the engine's architecture.
        tokenizer: the tokenizer the engine detokenizes with.
        args: the run's config; the `vllm_*` fields, lengths and seed are read here.
        lora_rank: serve a LoRA adapter of this rank on top of the base weights (adapter-only sync).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        args: GRPOConfig,
        lora_rank: int | None = None,
    ) -> None:
        from vllm import LLM

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Tensor parallel: consecutive ranks share one engine, as vLLM's external launcher groups them.
        self.tp_size = args.vllm_tensor_parallel_size
        self.tp_group = _tensor_parallel_group(self.tp_size, world) if self.tp_size > 1 else None
        self._tp_index = rank // self.tp_size  # which engine this rank belongs to
        # vLLM reads the architecture from a folder: write the config and tokenizer, never the weights.
        self._dir = tempfile.TemporaryDirectory(prefix=f"colograd-engine-{rank}-")
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        config = copy.deepcopy(base.config)
        # A model built from a config (not loaded) has no `architectures`; vLLM picks its class from it.
        config.architectures = [_architecture(base)]
        config.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)

        # Without a prompt limit the engine takes the model's own context length.
        max_model_len = args.vllm_max_model_length or (
            args.max_prompt_length + args.max_completion_length if args.max_prompt_length else None
        )
        memory = (
            {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}
            if torch.cuda.is_available()
            # On CPU the "GPU" fraction is a fraction of host memory, which every rank shares: size the cache.
            else {"kv_cache_memory_bytes": int(args.vllm_kv_cache_gib * 2**30)}
        )
        if not torch.cuda.is_available():
            _set_cpu_repacking(args.vllm_cpu_repack_weights)
        with _launcher_env():
            self.llm = LLM(
                model=self._dir.name,
                load_format="dummy",
                dtype=_engine_dtype(model, args),
                seed=args.seed + self._tp_index,  # each engine samples different completions
                tensor_parallel_size=self.tp_size,
                # None: one rollout of the whole TP group as one batch.
                max_num_seqs=args.vllm_max_num_seqs
                or args.per_device_train_batch_size * args.steps_per_generation * self.tp_size,
                max_num_batched_tokens=args.vllm_max_num_batched_tokens,
                max_model_len=max_model_len,
                enforce_eager=args.vllm_enforce_eager,
                enable_prefix_caching=args.vllm_enable_prefix_caching,
                # The engine joins this process's torch process group (or, alone, makes a world of one).
                distributed_executor_backend="external_launcher",
                # The engine reports log-probs of the distribution it sampled from (after temperature), the
                # same distribution the trainer scores, so the two are comparable token by token.
                logprobs_mode="processed_logprobs",
                **({"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1} if lora_rank else {}),
                enable_sleep_mode=args.vllm_enable_sleep_mode,
                **memory,
            )
        # Between rollouts a sleeping engine gives its GPU memory to training. Level 2 drops the weights too,
        # which the next sync rewrites anyway; an adapter-only engine keeps its frozen base (level 1: to CPU).
        self.sleep_level = (1 if lora_rank else 2) if args.vllm_enable_sleep_mode else 0
        self.stale = True  # True until the trainer's weights are loaded, and again after a level-2 sleep
        # Whether the engine computes with the weight tensors it holds (GPU; CPU without repacking), so a sync
        # can copy straight into them, or re-processes them into a kernel layout that needs a reload.
        self.direct_load = all(self.llm.collective_rpc(_holds_plain_weights))
        # Prompts must leave room for a whole completion in the engine's context.
        self.max_prompt_tokens = self.llm.llm_engine.model_config.max_model_len - args.max_completion_length
        self.lora_request = None  # set by `load_adapter`; every generation then applies the adapter
        self._adapter_dir: tempfile.TemporaryDirectory | None = None

    def generate(self, prompt_ids: list[list[int]], args: GRPOConfig, step: int = 0) -> Rollout:
        """Sample `args.num_generations` completions of every prompt in one engine call.

        `n=G` makes the engine prefill each prompt once for its whole group. Under tensor parallelism the ranks
        of a group pool their prompts, run one engine call together, and each keeps its own completions;
        `step` (the micro-step being trained) then seeds the call, so that every rank of the group samples the
        same tokens (vLLM's CPU sampler otherwise draws from each process's own generator).
        """
        from vllm import SamplingParams

        mine = len(prompt_ids)
        seeds: list[int | None] = [None] * mine
        if self.tp_group is not None:
            pooled: list[list[list[int]]] = [[] for _ in range(self.tp_size)]
            dist.all_gather_object(pooled, prompt_ids, group=self.tp_group)
            prompt_ids = [ids for part in pooled for ids in part]
            # One seed per request (vLLM gives its n samples seed, seed + 1, ...), so that a prompt that comes
            # twice still gets different completions.
            base = hash((args.seed, self._tp_index, step)) % 2**31
            seeds = [base + i * args.num_generations for i in range(len(prompt_ids))]

        params = [
            SamplingParams(
                n=args.num_generations,
                max_tokens=args.max_completion_length,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k if args.top_k > 0 else -1,
                repetition_penalty=args.repetition_penalty,
                min_p=args.min_p or 0.0,
                structured_outputs=_structured_outputs(args.vllm_structured_outputs_regex),
                **(args.generation_kwargs or {}),
                logprobs=0,  # the sampled token's own log-prob
                seed=seed,
            )
            for seed in seeds
        ]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, lora_request=self.lora_request, use_tqdm=False)
        if self.tp_group is not None:
            first = dist.get_rank(self.tp_group) * mine
            outputs = outputs[first : first + mine]
        rollout = Rollout([], [], [])
        for request in outputs:
            for sample in request.outputs:
                ids = list(sample.token_ids)
                rollout.completion_ids.append(ids)
                rollout.logps.append([pos[tok].logprob for pos, tok in zip(sample.logprobs, ids, strict=True)])
                rollout.truncated.append(sample.finish_reason == "length")
        return rollout

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write checkpoint-named weights into the engine in one call; layers not named keep their weights.

        The model's own loaders translate checkpoint names and layouts (fused qkv / gate_up, transposed
        Conv1D, vocabulary padding, tied heads, dtype) and copy into the engine's tensors. Where the backend
        repacked its weights into a kernel layout, vLLM's in-place reload re-runs that processing instead.
        """
        if self.direct_load:
            self.llm.collective_rpc(_load_into_model, args=(weights,))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.stale = False

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: Any) -> None:
        """Serve this LoRA adapter (PEFT names and config) from the next generation on.

        The tensors go to a memory-backed folder that vLLM reads when the next request names the adapter;
        `load_inplace` makes it replace the previous version under the same id.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="colograd-adapter-", dir=_memory_dir())
            adapter_config.save_pretrained(self._adapter_dir.name)
        save_file(tensors, os.path.join(self._adapter_dir.name, "adapter_model.safetensors"))
        self.lora_request = LoRARequest("colograd", 1, self._adapter_dir.name, load_inplace=True)

    @contextmanager
    def awake(self, sync: Callable[[], None]) -> Iterator[None]:
        """Bring the engine up to date for one rollout, sleeping again afterwards when sleep mode is on.

        The order matters: weights memory back first, then `sync` writes the current weights into it, then
        the KV cache comes back. Weights written before waking would be lost, and the engine would sample
        from stale weights.
        """
        if not self.sleep_level:
            sync()
            yield
            return
        self.llm.wake_up(tags=["weights"])
        sync()
        self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            self.llm.sleep(level=self.sleep_level)
            self.stale = self.stale or self.sleep_level == 2

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV: it was computed with weights that have since changed."""
        self.llm.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """The engine's log-prob of each token of `token_ids` given the ones before it: shape [len - 1]."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        out = self.llm.generate(
            [{"prompt_token_ids": token_ids}], params, lora_request=self.lora_request, use_tqdm=False
        )
        steps = out[0].prompt_logprobs
        return torch.tensor([steps[i][token_ids[i]].logprob for i in range(1, len(token_ids))])


def _structured_outputs(regex: str | None) -> Any:
    """vLLM's constraint that a completion match `regex`, or None."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex) if regex is not None else None


def _tensor_parallel_group(tp_size: int, world: int) -> Any:
    """This rank's group of `tp_size` consecutive ranks (every rank must call this, in the same order)."""
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(start, start + tp_size)) for start in range(0, world, tp_size)]
    )
    return group


def free_port() -> int:
    """A TCP port on localhost that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _launcher_env() -> Iterator[None]:
    """Give vLLM's external launcher the torchrun-style variables it reads while it starts, when no launcher
    set them; removed afterwards, so that child processes do not inherit a port that is in use."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    added = {
        key: str(value)
        for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"))
        if key not in os.environ
    }
    if "MASTER_PORT" not in os.environ:
        added["MASTER_PORT"] = str(free_port())
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            del os.environ[key]


_ONEDNN_AVAILABLE: bool | None = None


def _set_cpu_repacking(enabled: bool) -> None:
    """Whether vLLM's CPU backend (for engines built from now on in this process) repacks linear weights into
    oneDNN handles, its default, or computes with the plain weights (torch's matmul).

    Repacking costs several times a copy of the same bytes, so a sync into a repacking engine is bound by it;
    with plain weights a sync is a copy, but generation is slower (`python -m colograd.bench sync` measures
    both engines side by side).
    If a vLLM version no longer reads this switch, the engine repacks and `Engine.direct_load` turns the sync
    back to the reload path, which stays correct.
    """
    global _ONEDNN_AVAILABLE
    import vllm._custom_ops as ops

    if _ONEDNN_AVAILABLE is None:
        _ONEDNN_AVAILABLE = bool(getattr(ops, "_supports_onednn", False))
    ops._supports_onednn = enabled and _ONEDNN_AVAILABLE


def _holds_plain_weights(worker: Any) -> bool:
    """Runs in the engine's worker: whether every parameter still holds its data (none repacked away)."""
    return all(p.numel() > 0 for p in worker.model_runner.model.parameters())


def _load_into_model(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in the engine's worker: copy checkpoint-named weights into the model's tensors."""
    worker.model_runner.model.load_weights(weights)


def _architecture(model: nn.Module) -> str:
    """The model's class name, seen through FSDP2, which re-classes a sharded module as `FSDP<Name>`."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _memory_dir() -> str | None:
    """A RAM-backed folder where the platform has one, so handing files to the engine never touches disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _engine_dtype(model: PreTrainedModel, args: GRPOConfig) -> str:
    """bf16 when training in bf16, else the trainer's own parameter dtype (fp32 keeps parity exact)."""
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    return str(next(model.parameters()).dtype).removeprefix("torch.")
