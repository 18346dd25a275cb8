"""What an in-process engine does to the process beyond its own memory, undone where a training process needs it
undone: vLLM's imports keep their importers' frames, its start-up freezes the heap against garbage collection, a
collected engine tears down the process-wide parallel groups, and its reload records keep every layer alive.
Together they kept every trainer a process dropped (measured: 2.9 GB for one of a 120M-parameter model);
tests/engine/test_engine_memory.py checks that a dropped trainer, its optimizer and its engine's layers are freed. And
for architectures vLLM runs through its Transformers backend, that backend rewrites the transformers classes
themselves, for the whole process (`own_classes` keeps the trainer's models out of it)."""

import gc
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

# vLLM marks each class it decorates for compilation with this attribute (vllm/compilation/decorators.py).
VLLM_DECORATED = "_ignore_compile_vllm"


def keep_parallel_groups_when_dropped(llm: Any) -> None:
    """Let `llm` be freed like any object, without the shutdown vLLM runs when its engine client is collected.

    That shutdown tears down vLLM's process-wide parallel groups, which every engine of the process shares: a
    dropped trainer's engine, collected while a later trainer's engine starts or runs, left that one without its
    world group ("world group is not initialized"). What the engine holds (weights, KV cache) is freed with it
    all the same. On a GPU the process keeps one engine for its lifetime (`Engine.acquire`) and vLLM's shutdown
    is left as it is."""
    client = getattr(llm.llm_engine, "engine_core", None)  # (vLLM 0.26 to 0.33 keep the finalizer there)
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def add_expert_group(tp_size: int) -> None:
    """Give vLLM's process-wide parallel groups the expert-parallel group an MoE engine needs, where an earlier engine
    of this process (a dense model's) made the groups without one.

    vLLM makes that group with the others, only for an MoE model, and a later engine reuses the groups it finds
    (`ensure_model_parallel_initialized`): an MoE engine after a dense one then fails at its first forward ("expert
    parallel group is not initialized"). It is made here as vLLM makes it for these engines (no data, context or
    pipeline parallelism): one group per engine, the engine's tensor-parallel ranks. Every rank calls this at the
    same point (making a group is a collective).

    Args:
        tp_size: consecutive ranks that share one engine (vLLM's external launcher groups them so).
    """
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return
    world = parallel_state.get_world_group()
    ranks = [list(range(start, start + tp_size)) for start in range(0, world.world_size, tp_size)]
    backend = dist.get_backend(world.device_group)
    parallel_state._EP = parallel_state.init_model_parallel_group(ranks, world.local_rank, backend, group_name="ep")


def layer_refs(worker: Any) -> list[weakref.ref]:
    """Runs in the engine's worker: a weak reference to each module of its model."""
    return [weakref.ref(module) for module in worker.model_runner.model.modules()]


def forget_reload_records(layers: list[weakref.ref]) -> None:
    """Drop what vLLM recorded for reloading each of `layers` (a dropped engine's), so that they can be freed.

    vLLM keeps, for every module it loads, a record in a weak-keyed dictionary; the record holds copies of the
    module's parameters whose `weight_loader` is the module's own bound method, so each record holds its key and
    no module of any engine was ever freed: the whole model and its KV cache, every engine of the process
    (measured: 0.4 to 2 GB for each zoo model a test process trained and dropped)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # a vLLM without these records (0.26) keeps nothing to forget
        return
    for ref in layers:
        if (layer := ref()) is not None:
            LAYERWISE_INFO.pop(layer, None)


def import_off_stack(*modules: str) -> None:
    """Import `modules` (vLLM's) in a thread of their own, so that no caller's frame is kept by what they keep.

    Some vLLM modules keep an import error at module level (`vllm.multimodal.media.audio` keeps torchcodec's, which
    every import of `vllm.sampling_params` reaches). Its traceback holds the module's frame, and that frame the
    frames that imported it, for the life of the process. Imported from a trainer's `__init__`, those are the
    trainer's own frames: the first trainer of a process, its model, optimizer and datasets were never freed
    (measured: 2.9 GB for a 120M-parameter model). From a thread, the frames kept are the thread's.

    Raises:
        the import's own error, where one fails.
    """
    missing = [m for m in modules if m not in sys.modules]
    if not missing:
        return
    failed: list[BaseException] = []

    def load() -> None:
        import importlib

        try:
            for module in missing:
                importlib.import_module(module)
        except BaseException as err:  # re-raised in the caller's thread
            failed.append(err)

    thread = threading.Thread(target=load, name="colograd-import")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


@contextmanager
def frozen_heap(collect: bool = False) -> Iterator[None]:
    """Keep the objects alive now out of garbage collection inside the block (`gc.freeze`), and none after it.

    vLLM's engine freezes the heap at the end of its start-up, so that later garbage collections skip it: in a
    serving process, a gain. In a training process that heap holds the trainer being built, its model and callbacks,
    all in reference cycles: frozen for good, they were never collected, nor anything they reached later (the
    optimizer and its state), so every trainer a notebook or a test suite dropped stayed in memory (measured: 2.9 GB
    per dropped trainer of a 120M-parameter model); vLLM unfreezes only when its engine shuts down, which an
    in-process engine never does. The engine therefore starts inside this block, which undoes vLLM's freeze with
    its own, and whose collections vLLM's five at start-up then skip (1.4 s a start over a heap of torch,
    transformers and vLLM, measured on the CPU).

    Training keeps its heap frozen this way too (`GRPOTrainer.train`): the collections that follow its allocations
    then skip the ~800k objects of torch, transformers, vLLM and the trainer itself (a launched pair of two-rank runs
    took 79 s with the heap unfrozen, 70 s frozen for good as vLLM leaves it, 73 s with this, on the CPU); a trainer
    dropped after `train` is collected as any object. Where the process had frozen objects itself (or an enclosing
    block has), the block changes nothing.

    Args:
        collect: collect first, so that garbage waiting for a collection (a trainer dropped before this one was
            built) is freed rather than kept for the whole block."""
    if gc.get_freeze_count():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def own_classes(models: list[nn.Module | None]) -> None:
    """Give the modules of `models` (None entries skipped) whose class vLLM decorated a class of their own that calls
    them as torch does.

    vLLM's Transformers backend (the architectures it has no model of its own for: OLMo-2, Phi-2, GPT-NeoX ...)
    decorates the transformers decoder class it builds for compilation: it rewrites the class's `__call__` and
    `__init__` and adds a base, in place, for the whole process. A trainer's model of that class, built before the
    engine, then goes through vLLM's `__call__`, which fails on attributes only vLLM's `__init__` sets
    (`do_not_compile`), and would skip the module's hooks (accelerate's, DeepSpeed's) where it does not fail. The
    class each such module gets derives from its own (isinstance holds, the name and module are the same) and calls
    it as `torch.nn.Module` does."""
    for model in models:
        for module in model.modules() if model is not None else ():
            cls = type(module)
            if VLLM_DECORATED in vars(cls) and "__call__" in vars(cls):
                module.__class__ = _undecorated(cls)


_UNDECORATED: dict[type, type] = {}


def _undecorated(cls: type) -> type:
    if cls not in _UNDECORATED:
        _UNDECORATED[cls] = type(cls.__name__, (cls,), {"__call__": nn.Module.__call__, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})  # fmt: skip
    return _UNDECORATED[cls]
