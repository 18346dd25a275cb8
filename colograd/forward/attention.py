"""Attention over packed segments without a mask: CUDA's variable-length (varlen) attention kernels.

A padding-free forward pass (`colograd.forward.logps`) holds many sequences end to end. With SDPA, transformers tells
them apart by a 4D mask, and shared prompts (`pack_shared`) need one too: an [L, L] tensor per pass, and a masked call
that runs in the slower memory-efficient kernel. Here the pass is cut into *segments* instead, each a run of query
tokens with the keys it may see:

- a sequence computed alone, or a prompt computed once for its completions: its own tokens, causally;
- a completion that shares its prompt: the prompt's tokens, then its own, causally.

One varlen kernel call computes every segment (the memory-efficient kernel: one per bucket of segments of
similar length): the flash kernel (fp16 / bf16) or the memory-efficient one (any dtype), both with causality
aligned to the bottom right (query i of a segment of q queries and k keys sees keys 0 … k - q + i), which is
exactly "the whole prompt, then the completion up to itself". Keys and values are gathered per segment: a
completion's prompt keys are copied once per completion (heads_kv × head_dim values per token and layer: a few
percent of what computing that prompt again would cost in hidden states). No [L, L] tensor exists, and a shared
pass runs the same kernel as an unshared one.

The model's attention is switched to `ATTENTION` (`install`): a function that takes this path when its mask is a
`segment_mask` and otherwise is transformers' SDPA attention unchanged, so any other call (generation in an
evaluation, a pass without segments) behaves as before; except that a layer that soft-caps its attention scores
(Gemma-2's `attn_logit_softcapping`, passed as `softcap`), which SDPA would silently ignore, runs the model's own
eager attention, which applies it. Every SDPA model a trainer trains is switched to it (`honour_softcaps`), so that
its attention is the engine's. The kernels exist on CUDA only; `varlen_kernel` probes
which one runs and agrees with the reference loop. On a CPU the boolean-mask packing stays (CPU SDPA takes a
mask in its flash kernel), and the `"reference"` kernel, a loop of masked SDPA calls over the same segments, lets
tests check the layout there.
"""

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "colograd_segments"  # the attention implementation's name in transformers' registry
HALF = (torch.float16, torch.bfloat16)  # what the flash kernel takes
# The probe's agreement with the reference loop, relative to the largest value compared: bf16 / fp16 rounding.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segments:
    """A packed row stream cut into segments, for one varlen kernel call.

    cu_q, cu_k: int32 [S + 1]: where each segment's queries (in the stream) and gathered keys start.
    kv_index: [K]: the stream position of each gathered key, segment after segment.
    max_q, max_k: the longest segment's queries and keys.
    kernel: "flash", "efficient" or "reference" (`KERNELS`).
    q_lengths, k_lengths: each segment's queries and keys, on the host.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_index: torch.Tensor
    max_q: int
    max_k: int
    kernel: str
    q_lengths: tuple[int, ...] = ()
    k_lengths: tuple[int, ...] = ()

    def to(self, device: torch.device) -> "Segments":
        """The same segments with their tensors on `device`."""
        moved = (self.cu_q.to(device), self.cu_k.to(device), self.kv_index.to(device))
        return Segments(*moved, self.max_q, self.max_k, self.kernel, self.q_lengths, self.k_lengths)

    @functools.cached_property
    def buckets(self) -> list["Segments"]:
        """These segments as consecutive runs whose count × longest queries is at most twice their queries.

        A varlen kernel that sizes its buffers by segments × the longest segment (the memory-efficient kernel's
        log-sum-exp and backward workspace) then needs about twice what the tokens themselves need, instead of
        every short segment padded to the longest of the pass. Worked out once per pass (every layer asks)."""
        runs, start, widest, tokens = [], 0, 0, 0
        for end, length in enumerate(self.q_lengths, 1):
            if end - 1 > start and (end - start) * max(widest, length) > 2 * (tokens + length):
                runs.append((start, end - 1))
                start, widest, tokens = end - 1, 0, 0
            widest, tokens = max(widest, length), tokens + length
        runs.append((start, len(self.q_lengths)))
        return [self._run(a, z) for a, z in runs]

    def _run(self, a: int, z: int) -> "Segments":
        """Segments a … z - 1 alone, their offsets from their own first query and key."""
        q_lengths, k_lengths = self.q_lengths[a:z], self.k_lengths[a:z]
        return Segments(
            self.cu_q[a : z + 1] - self.cu_q[a],
            self.cu_k[a : z + 1] - self.cu_k[a],
            self.kv_index,  # not read by the kernels
            max(q_lengths),
            max(k_lengths),
            self.kernel,
            q_lengths,
            k_lengths,
        )


def segments_of(unit_of: torch.Tensor, branch: torch.Tensor, kernel: str) -> Segments:
    """The segments of a flat token stream, from each token's unit and branch (as `pack_shared` labels them).

    Args:
        unit_of: [L]: the unit (a sequence, or a prompt with the completions that share it) of each token; -1 for
            padding. A unit's tokens are contiguous, its prompt first.
        branch: [L]: 0 for a prompt token (or a token of a sequence computed alone), b for the unit's b-th
            completion.
        kernel: the kernel that will run them (`KERNELS`).
    """
    key = unit_of.cpu().long() * (int(branch.max()) + 1 if len(branch) else 1) + branch.cpu().long()
    _, counts = torch.unique_consecutive(key, return_counts=True)
    starts = (counts.cumsum(0) - counts).tolist()
    units, branches = unit_of.cpu()[starts].tolist(), branch.cpu()[starts].tolist()
    prompt_span: dict[int, tuple[int, int]] = {}
    keys, q_lens, k_lens = [], [], []
    for start, count, unit, b in zip(starts, counts.tolist(), units, branches, strict=True):
        own = torch.arange(start, start + count)
        if b == 0 or unit < 0:  # a prompt, a sequence alone, or padding: itself
            prompt_span[unit] = (start, count)
            keys.append(own)
        else:  # a completion: its unit's prompt, then itself
            first, length = prompt_span[unit]
            keys += [torch.arange(first, first + length), own]
        q_lens.append(count)
        k_lens.append(len(own) + (0 if b == 0 or unit < 0 else prompt_span[unit][1]))
    cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *k_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Segments(cu_q, cu_k, torch.cat(keys), max(q_lens), max(k_lens), kernel, tuple(q_lens), tuple(k_lens))


def segment_mask(segments: Segments, rows: int, device: torch.device) -> torch.Tensor:
    """What a packed pass gives the model as `attention_mask` to run on `segments`: a [rows, 1, 1, 1] marker.

    transformers passes a 4D mask through unchanged, to every layer and into gradient checkpointing's
    recomputation; `segment_attention` reads the segments from it. It holds no mask values."""
    marker = torch.zeros(rows, 1, 1, 1, dtype=torch.bool, device=device)
    marker.segments = segments.to(device)
    return marker


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for `ATTENTION`: the segments' varlen kernel where `attention_mask` is a
    `segment_mask`, else SDPA as transformers runs it.

    Args:
        query: [B, heads, L, head_dim]; key, value: [B, kv_heads, L, head_dim] (after rotary embeddings).
    Returns:
        The attention output [B, L, heads, head_dim] and no weights, as `sdpa_attention_forward` returns them.
    """
    segments: Segments | None = getattr(attention_mask, "segments", None)
    if segments is None and kwargs.get("softcap") is not None:  # SDPA has no soft cap; the model's eager has
        return _eager(module)(module, query, key, value, _additive(attention_mask, query, key), dropout, scaling,
                              **kwargs)  # fmt: skip
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("segment attention has no sliding window or soft cap; set padding_free: false")
    b, heads, length, head_dim = query.shape
    # Under autocast the rotary embedding leaves queries and keys in float32 beside bfloat16 values; SDPA's autocast
    # rule casts all three to the autocast dtype, which the varlen kernels (not under autocast) need done here.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    q = query.transpose(1, 2).reshape(b * length, heads, head_dim).to(dtype)
    k = key.transpose(1, 2).reshape(b * length, key.size(1), head_dim).index_select(0, segments.kv_index).to(dtype)
    v = value.transpose(1, 2).reshape(b * length, value.size(1), head_dim).index_select(0, segments.kv_index).to(dtype)
    scale = scaling if scaling is not None else head_dim**-0.5
    kernel = segments.kernel
    if kernel == "flash" and dtype not in HALF:  # a model that computes in float32 (no autocast): flash has no fp32
        kernel = "efficient"
    out = KERNELS[kernel](q, k, v, segments, scale, dropout)
    return out.view(b, length, heads, head_dim), None


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Segments, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """CUDA's flash kernel, varlen, fp16 / bf16: [Tq, heads, d] queries, [Tk, kv_heads, d] keys (grouped heads
    natively); `is_causal` there is bottom-right aligned when a segment has more keys than queries. Its
    log-sum-exp is per token, so one call serves segments of any lengths."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, s.cu_q, s.cu_k, s.max_q, s.max_k, dropout, True, False, scale=scale
    )[0]


def _efficient(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Segments, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """CUDA's memory-efficient kernel, varlen (any float dtype): mask type 2 is causal from the bottom right. It
    has no grouped heads, so keys and values are repeated per query head; and it sizes buffers by segments × the
    longest segment, so it runs on buckets of segments of similar length (`Segments.buckets`)."""
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # its backward needs the log-sum-exp
    out, q_at, k_at = [], 0, 0
    for run in s.buckets:
        q_end, k_end = q_at + sum(run.q_lengths), k_at + sum(run.k_lengths)
        part = torch.ops.aten._efficient_attention_forward(
            *(t[None] for t in (q[q_at:q_end], k[k_at:k_end], v[k_at:k_end])),
            None, run.cu_q, run.cu_k, run.max_q, run.max_k, dropout, 2, lse, scale=scale,
        )[0]  # fmt: skip
        out.append(part[0])
        q_at, k_at = q_end, k_end
    return torch.cat(out)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Segments, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """The same computation as a loop of masked SDPA calls, one per segment: any device, for tests and the probe."""
    cu_q, cu_k, out = s.cu_q.tolist(), s.cu_k.tolist(), []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (
            t[a:z].transpose(0, 1) for t, a, z in ((q, *cu_q[i : i + 2]), (k, *cu_k[i : i + 2]), (v, *cu_k[i : i + 2]))
        )
        allowed = torch.ones(qs.size(1), ks.size(1), dtype=torch.bool, device=q.device).tril(ks.size(1) - qs.size(1))
        part = nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=allowed, dropout_p=dropout, scale=scale, enable_gqa=True
        )
        out.append(part.transpose(0, 1))
    return torch.cat(out)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {"flash": _flash, "efficient": _efficient, "reference": _reference}


def varlen_kernel(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """The varlen kernel that runs here for queries of `dtype` with these heads, forward and backward, and agrees
    with the reference loop: "flash", else "efficient", else None (not CUDA, or neither). A small probe per kernel
    (a prompt and two completions of 16 tokens), so a build or GPU without one (older architectures, head sizes
    the flash kernel does not take) or one whose causality is aligned otherwise is found before training."""
    if not _is_cuda(device):
        return None
    segments = segments_of(torch.zeros(48, dtype=torch.long), torch.tensor([0] * 16 + [1] * 16 + [2] * 16), "")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(48, heads, head_dim, generator=generator).to(device, dtype).requires_grad_()
    kv = torch.randn(48, kv_heads, head_dim, generator=generator).to(device, dtype).requires_grad_()
    expected = _probe(_reference, q, kv, segments.to(device), head_dim**-0.5)
    for name in ("flash", "efficient"):
        try:
            got = _probe(KERNELS[name], q, kv, segments.to(device), head_dim**-0.5)
        except (RuntimeError, NotImplementedError, TypeError):  # no kernel here, or a torch whose op differs
            continue
        gap = max(
            ((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in zip(got, expected, strict=True)
        )
        if gap <= PROBE_TOLERANCE.get(dtype, 5e-2):
            return name
        logger.warning(f"the {name} varlen kernel differs from the reference by {gap:.1e} here: not used")
    return None


def _probe(kernel: Callable[..., torch.Tensor], q: torch.Tensor, kv: torch.Tensor, s: Segments, scale: float):
    """`kernel`'s output on the probe's segments (the keys and values gathered from `kv`), and the gradients of its
    sum for the queries and `kv`, all in float32."""
    k = kv.index_select(0, s.kv_index)
    out = kernel(q, k, k, s, scale)
    grads = torch.autograd.grad(out.float().sum(), (q, kv))
    return [t.detach().float() for t in (out, *grads)]


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _eager(module: nn.Module) -> Callable:
    """The eager attention function of `module`'s modeling file (each transformers model file defines one)."""
    import sys

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} soft-caps its attention but its model file has no eager attention")
    return eager


def _additive(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """SDPA's mask (None: causal; boolean: True where a query may attend) as eager attention takes it: 0 where a
    query may attend, the dtype's lowest value elsewhere, [B or 1, 1, queries, keys]."""
    if mask is None:
        q, k = query.size(-2), key.size(-2)
        mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, torch.finfo(query.dtype).min
    )


def honour_softcaps(models: list[nn.Module | None]) -> None:
    """Switch `models` (None entries skipped) whose attention is transformers' SDPA to `ATTENTION`, which is SDPA
    but for layers that soft-cap their attention scores (see the module's docstring)."""
    for model in models:
        pretrained = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None) if model else None
        if pretrained is not None and getattr(pretrained.config, "_attn_implementation", None) == "sdpa":
            install(model)


def install(model: nn.Module) -> None:
    """Switch `model`'s attention (through DDP / DeepSpeed / PEFT wrappers) to `ATTENTION`: segment attention
    where a pass gives segments, SDPA otherwise. Its saved config is unchanged (transformers does not write the
    attention implementation)."""
    AttentionInterface.register(ATTENTION, segment_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # passes without segments build SDPA's masks
    pretrained = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    pretrained.set_attn_implementation(ATTENTION)


def installed(model: nn.Module) -> bool:
    """Whether `model`'s attention is `ATTENTION` (`install`)."""
    pretrained = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return pretrained is not None and getattr(pretrained.config, "_attn_implementation", None) == ATTENTION
