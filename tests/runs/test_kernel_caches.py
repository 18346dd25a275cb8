"""`import colograd` bounds the CPU kernels' per-shape caches (`colograd.runs.kernel_caches`): a bf16 layer run on
new shapes step after step leaves a bounded amount of memory behind, and a value the user set is kept."""

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from colograd.runs.kernel_caches import CAPACITY, VARIABLES

SHAPES = 150

# A linear layer of a small model's width, forward and backward under bf16 autocast as the trainer computes on a
# CPU, on one new row count after another (packed rows of another width at every step); the allocator's memory in
# use after, against before (malloc's own count: no page or timing in it).
GROWTH = textwrap.dedent(f"""
    import ctypes, json, os
    import colograd  # noqa: F401
    import torch

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info

    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 512)

    def step(rows):
        x = torch.randn(rows, 256, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
        layer.zero_grad(set_to_none=True)

    for rows in range(1, 17):  # the first shapes, and whatever the libraries allocate once
        step(rows)
    before = in_use()
    for rows in range(17, 17 + {SHAPES}):
        step(rows)
    print(json.dumps({{"growth_mib": (in_use() - before) / 2**20,
                      "set": {{name: os.environ.get(name) for name in {VARIABLES!r}}}}}))
""")


def _libc_counts_its_heap() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


pytestmark = [
    pytest.mark.skipif(not _libc_counts_its_heap(), reason="needs glibc's mallinfo2 (glibc 2.33+) to count the heap"),
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"),
]


def _run(preset: dict[str, str]) -> dict:
    """The script in a fresh process whose environment sets none of the variables but `preset` (this process
    imported colograd, which set them here)."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES} | preset
    proc = subprocess.run([sys.executable, "-c", GROWTH], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_bounds_the_caches_and_new_shapes_leave_little_behind():
    bounded = _run({})
    assert bounded["set"] == dict.fromkeys(VARIABLES, str(CAPACITY))
    # Measured: 8.7 MiB at 64 entries (the entries of 64 shapes), where 1,024 entries keep growing (below).
    assert bounded["growth_mib"] < 32, bounded


def test_a_value_the_user_set_is_kept_and_without_the_bound_the_memory_grows():
    """The control: the libraries' default capacity, set by hand (and kept by colograd), keeps every shape's entries:
    what the bound above prevents, so that test fails where the bound is lost (482 MiB for 300 shapes, measured)."""
    unbounded = _run(dict.fromkeys(VARIABLES, "1024"))
    assert unbounded["set"] == dict.fromkeys(VARIABLES, "1024")
    assert unbounded["growth_mib"] > 128, unbounded
