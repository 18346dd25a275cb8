"""How a run packs its padding-free passes, decided once at start-up from the model, the device and the dtype.

`colograd.forward.logps` packs and runs each pass; this module says how: whether the model's attention can share a
prompt and what that costs (`prompt_sharing_cost`), whether a GPU runs the passes as segments in a varlen kernel
(`segment_kernel`, `use_segments`, `colograd.forward.attention`), and when a pass shares its prompts (`prompt_sharing`:
on a GPU that masks, only where that saves enough tokens to pay for the masked kernel). `forward_packing` is the
trainer's one call.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from colograd.forward import attention
from colograd.forward.logps import PromptSharing


def keeps_packed_sequences_apart(model: nn.Module, layout: str | None = None) -> bool:
    """Whether `model`'s forward keeps sequences packed end to end in one row apart when it is given no mask, only
    position ids that restart at each sequence (transformers finds the sequences from them, `masking_utils`), as the
    padding-free passes without a mask need. Some families build their mask without the position ids (gpt-oss in
    transformers 5.19): their packed sequences attend to each other. Probed: two sequences of 8 tokens, packed and the
    second alone, must give the second the same logits (to 5% of their scale: rounding in 16 bits is far below it,
    a sequence that sees its neighbour is far above it). With `layout` (`colograd.forward.stateful.KWARG`), the packed
    call also gets the rows' `Sequences` under that keyword, as a hybrid's packed passes do."""
    weight = next(model.parameters(), None)
    config = _config(model)
    partitioned = weight is not None and hasattr(weight, "ds_id")  # ZeRO-3: gathered a block at a time below
    if weight is None or config is None or weight.device.type == "meta" or (weight.numel() == 0 and not partitioned):
        return True  # nothing to probe with here: the parity gate still compares every pass
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, 1000), (1, 16), generator=torch.Generator().manual_seed(0)).to(weight.device)
    positions = torch.arange(8, device=weight.device).repeat(2)[None]
    training = model.training
    model.eval()  # no dropout between the two
    try:
        with torch.no_grad(), gathered_in_forward(model):
            extra = {}
            if layout is not None:
                from colograd.forward.stateful import Sequences

                extra[layout] = Sequences.of(positions, torch.ones_like(positions))
            packed = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits[0, 8:].float()
            alone = model(input_ids=ids[:, 8:], position_ids=positions[:, 8:], use_cache=False).logits[0].float()
    except Exception:  # a forward this probe cannot make: the parity gate still compares every pass
        return True
    finally:
        model.train(training)
    return (packed - alone).abs().max().item() <= 0.05 * (1.0 + alone.abs().max().item())


@contextmanager
def gathered_in_forward(model: nn.Module) -> Iterator[None]:
    """For a forward of `model` in the block, where ZeRO-3 has partitioned its weights and DeepSpeed's engine (whose
    hooks gather them) does not run it yet, as at start-up: each layer of a layer list (`nn.ModuleList`, outermost)
    gathered whole around its own call, and the weights outside every such layer (embeddings, norms, the output
    layer) for the block, so that no rank holds more than those and one layer at a time. A collective: every rank
    must make the same calls. Elsewhere (weights whole, or DeepSpeed's hooks in place) a no-op.

    Raises:
        RuntimeError: the model has no layer list, so gathering the rest would gather the whole model.
    """
    params = list(model.parameters())
    if not any(hasattr(p, "ds_id") and p.numel() == 0 for p in params):
        yield
        return
    import deepspeed

    layers = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    outermost = []
    inside: set[int] = set()
    for layer in layers:
        if id(layer) not in inside:
            outermost.append(layer)
            inside.update(id(m) for m in layer.modules())
    held = {id(p) for layer in outermost for p in layer.parameters()}
    rest = [p for p in params if id(p) not in held]
    if not outermost:
        # No layer list (layers kept in another container): gathering the rest at once is the whole model on every
        # rank. Not probed (the caller's fallback: padded passes, exact; the parity gate).
        raise RuntimeError("the model has no layer list: its weights are not gathered a layer at a time")
    opened: list[Any] = []

    def gather(layer: nn.Module, _args: Any) -> None:
        context = deepspeed.zero.GatheredParameters(list(layer.parameters()), modifier_rank=None)
        context.__enter__()
        opened.append(context)

    def release(_layer: nn.Module, _args: Any, _output: Any) -> None:
        opened.pop().__exit__(None, None, None)

    handles = [hook(layer) for layer in outermost for hook in (
        lambda m: m.register_forward_pre_hook(gather), lambda m: m.register_forward_hook(release)
    )]  # fmt: skip
    try:
        with deepspeed.zero.GatheredParameters(rest, modifier_rank=None):
            yield
    finally:
        for handle in handles:
            handle.remove()
        while opened:  # a forward that raised inside a layer
            opened.pop().__exit__(None, None, None)


def prompt_sharing_cost(model: nn.Module) -> float | None:
    """What sharing a prompt weighs (`pack_shared`'s `attention_cost`) for `model`, or None where it cannot be
    shared: attention other than sdpa (flash kernels ignore a 4D mask), a layer with sliding-window attention
    (the mask would widen its window), ALiBi position biases (built from a 2D mask), or a config without the
    sizes.

    The cost is one query-key pair's attention (scores and weighted values: 4 × heads × head_dim FLOPs per
    layer) in tokens' worth of a decoder layer's matrix products (2 FLOPs per weight per token)."""
    config = _config(model)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", attention.ATTENTION):
        return None
    config = config.get_text_config()
    if getattr(config, "is_heterogeneous", False):  # sizes kept per layer (transformers' `per_layer_config`)
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return None
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        return None
    h, heads, inner = (
        getattr(config, name, None) for name in ("hidden_size", "num_attention_heads", "intermediate_size")
    )
    if not (isinstance(h, int) and isinstance(heads, int) and isinstance(inner, int)):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    weights = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inner  # q, o; k, v; the MLP
    return 4 * heads * head_dim / (2 * weights)


def _config(model: nn.Module) -> object | None:
    """The model's config, seen through DDP / DeepSpeed (`.module`) wrappers."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


# A masked SDPA call (cuDNN with a bias) costs ~13% more per token than the maskless causal kernel on an H100
# (1.5B Qwen2 shape, bf16 autocast): sharing pays where it saves clearly more than that.
GPU_MIN_SAVING = 0.2


def segment_kernel(model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """The varlen kernel that runs `model`'s padding-free passes as segments (`colograd.forward.attention`) on
    `device`, or None: not on CUDA, an attention that cannot be cut into segments (`prompt_sharing_cost`), or no varlen
    kernel for its heads in `compute_dtype` (`attention.varlen_kernel`)."""
    if device.type != "cuda" or prompt_sharing_cost(model) is None:
        return None
    config = _config(model).get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return attention.varlen_kernel(heads, kv_heads, head_dim, compute_dtype, device)


def use_segments(models: list[nn.Module | None], device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Switch the attention of `models` (the policy first; None entries skipped) to segment attention where
    `segment_kernel` finds a kernel for the first; returns that kernel, or None (models left as they are)."""
    kernel = segment_kernel(models[0], device, compute_dtype)
    for model in models if kernel is not None else ():
        if model is not None:
            attention.install(model)
    if kernel is not None and not attention.installed(models[0]):  # transformers kept its own (remote code)
        logging.getLogger("colograd.trainer").warning(
            "the model's attention could not be switched to segment attention: packed passes use a mask"
        )
        return None
    return kernel


def forward_packing(
    models: list[nn.Module | None], args: Any, compute_dtype: torch.dtype
) -> tuple[str | None, "PromptSharing | None"]:
    """How a run's padding-free passes are packed: the segment kernel (`use_segments`, on the policy then the
    reference copy in `models`) and the prompt sharing (`prompt_sharing`); neither with `padding_free` false.
    Not segments under `torch_compile`: torch's meta function of the memory-efficient kernel's backward cannot
    be traced."""
    if not args.padding_free:
        return None, None
    segments = None if args.torch_compile else use_segments(models, args.device, compute_dtype)
    return segments, prompt_sharing(models[0], args.share_prompts, args.device, compute_dtype, segments)


def prompt_sharing(
    model: nn.Module,
    setting: bool | str,
    device: torch.device,
    compute_dtype: torch.dtype,
    segments: str | None = None,
) -> PromptSharing | None:
    """How the trainer shares prompts for `share_prompts` = `setting` (True, False or "auto"), or None.

    None where the model's attention cannot take a shared mask (`prompt_sharing_cost`). With `segments` (a GPU
    whose varlen kernel runs the passes, `segment_kernel`) a shared pass costs no mask and no other kernel, and a
    completion attends to exactly the keys it has alone: sharing is used whenever it saves tokens, in units as
    large as a pass. On a CPU too: CPU SDPA takes the 4D mask in its flash kernel. On a GPU without a varlen
    kernel the mask is additive, and "auto" shares a pass only where it saves `GPU_MIN_SAVING` of its tokens;
    where SDPA would run a masked call in its math kernel (O(L²) memory per layer: fp32 without autocast, older
    GPUs, odd head sizes) "auto" does not share, with a warning, and True shares with the same warning.
    """
    if setting is False:
        return None
    cost = prompt_sharing_cost(model)
    if cost is not None and segments is not None:
        return PromptSharing(0.0)  # no masked pairs: a unit's attention is its members' own
    if cost is None or device.type != "cuda":
        return None if cost is None else PromptSharing(cost)
    config = _config(model).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kernel = masked_attention_kernel(config.num_attention_heads, head_dim, compute_dtype, device)
    if kernel == SDPBackend.MATH:
        logging.getLogger("colograd.trainer").warning(
            f"share_prompts: a masked attention call in {compute_dtype} with head size {head_dim} runs in SDPA's "
            "math kernel here (memory quadratic in the row's length); "
            + ("prompts are not shared." if setting == "auto" else "sharing anyway, as share_prompts: true asks.")
        )
        if setting == "auto":
            return None
    return PromptSharing(cost, GPU_MIN_SAVING if setting == "auto" else 0.0, additive_mask=True)


def masked_attention_kernel(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> SDPBackend:
    """The kernel `scaled_dot_product_attention` picks on `device` for queries of `dtype` with an additive mask,
    gradients needed (a small probe; torch's own choice, which respects `torch.backends.cuda` settings)."""
    q = torch.zeros(1, heads, 64, head_dim, dtype=dtype, device=device, requires_grad=True)
    mask = torch.zeros(1, 1, 64, 64, dtype=dtype, device=device)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, attn_mask=mask, dropout_p=0.0, is_causal=False))
