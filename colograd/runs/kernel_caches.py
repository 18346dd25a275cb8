"""The CPU kernels' per-shape caches, bounded in a training process.

PyTorch computes much of a CPU step through oneDNN (the matmuls under bf16 autocast among it), and keeps what it
builds for each input shape in two caches: oneDNN's primitive cache and the LRU cache of ideep, PyTorch's wrapper
around oneDNN, each holding its 1,024 most recent shapes by default. An entry can hold a reordered copy of the
weight it was built for: one linear layer of 256 × 512, run forward and backward on 300 row counts under bf16
autocast, grew the allocator's memory in use by 482 MiB (8.7 MiB with 64 entries).

A serving process meets a few shapes. A training process meets new ones at every step: packed rows of another
width, a hybrid's layers with state given their sequences in groups of other sizes
(`colograd.forward.stateful`), a Mixture-of-Experts' experts given other token counts. Each adds entries that live
until 1,024 others came after them, and that sit in the allocator's heap among the step's activations, which they
fragment. On the shrunk Qwen3.5 of the step benchmark (bf16, `python -m colograd.bench step --model qwen3.5`) the
memory in use grew 15-20 MiB a step and the resident memory from 1.5 to 3.0 GiB in 22 steps; with 64 entries the
memory in use stays flat, the peak of the benchmark's 12 steps falls from 2.4 to 2.0 GiB and the steps take as
long (docs/benchmarks.md). PyTorch's issue: pytorch/pytorch#27971.

64: room for the shapes a model's repeated layers share within a pass (forward, and the backward's two products
per linear layer), so its later layers reuse what the first built; the dense and MoE step benchmarks kept their
rates with it. Too small a bound misses on every call: a cycle of 8 linear shapes (24 entries) took 2.9 ms a
forward + backward with 16 entries, 0.9-1.2 ms with 64 or 1,024.

Each library reads its variable when it first builds a kernel (ideep once per thread) and never again, so the bound
is set when colograd is imported, before any. A value already in the environment is kept.
"""

import os

CAPACITY = 64
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
LIBRARY_DEFAULT = "1024"  # both libraries' capacity where the variable is unset
_set_here: list[str] = []  # the variables colograd set (not the user)


def bound_kernel_caches(capacity: int = CAPACITY) -> dict[str, str]:
    """Bound both caches to `capacity` shapes for this process, where the environment does not set them already.

    Returns:
        Each variable's value now.
    """
    for name in VARIABLES:
        if name not in os.environ:
            os.environ[name] = str(capacity)
            _set_here.append(name)
    return {name: os.environ[name] for name in VARIABLES}


def as_the_libraries_leave_them() -> dict[str, str]:
    """The environment for a child process that should run with the libraries' own capacities (a benchmark's TRL
    side), in place of the bound colograd set here; a value the user set stays theirs."""
    return dict.fromkeys(_set_here, LIBRARY_DEFAULT)


bound_kernel_caches()
