"""What a model does to its logits after its output layer, read off the model itself.

Some models transform the output layer's logits in their forward before returning them: Granite divides them by
`logits_scaling`, Command-R multiplies them by `logit_scale`, Gemma-2 soft-caps them (`cap * tanh(z / cap)`). The
trainer's log-probs must be those of the transformed logits, the distribution the engine samples. colograd never
builds the whole [tokens × vocabulary] logit matrix: its output layer computes the log-probs of the wanted tokens a
chunk at a time (`colograd.forward.logps`). So the transform is learnt once per model, by running the model's own
forward around a stand-in: its decoder returns zeros without computing anything, its output layer returns a recording
tensor, and every torch operation the forward then applies to that tensor is kept (`logit_transform`). The output
layer applies the kept operations to each chunk's logits, and the forward's own operations, applied to the log-probs
it returns, are let through unchanged (`passthrough`).

The kept operations must act on each position's logits alone (scales, soft-caps, a bias over the vocabulary); an
operation that mixes positions, or one the forward applies to two values derived from the logits, is refused in one
line, naming it. No list of config keys is involved: a model that scales its logits in a way no other does is
handled the same way.
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colograd.errors import ConfigError


class _Logits:
    """Where the logits go in a kept operation's arguments."""


LOGITS = _Logits()


@dataclass(frozen=True)
class LogitTransform:
    """The operations a model's forward applies to its output layer's logits, in order; none for most models."""

    ops: tuple[tuple[Callable, tuple, dict], ...] = ()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply the model's operations to `logits` ([..., V]: a chunk of positions, or all of them)."""
        for func, args, kwargs in self.ops:
            logits = func(*_placed(args, logits), **dict(zip(kwargs, _placed(kwargs.values(), logits), strict=True)))
        return logits

    def __bool__(self) -> bool:
        return bool(self.ops)

    def describe(self) -> str:
        return " then ".join(_name(func) for func, _, _ in self.ops) or "none"


def _placed(values, logits: torch.Tensor) -> list:
    return [logits if value is LOGITS else value for value in values]


class _Recorder(torch.Tensor):
    """Stands in for the logits during the probe: each torch operation on it is computed and kept."""

    _ops: tuple = ()
    _mixed: str | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, _Recorder)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or not inputs:
            return out
        recorded = out.as_subclass(_Recorder)
        source = inputs[0]
        recorded._mixed = source._mixed
        if len({id(a) for a in inputs}) > 1 or any(a is not source for a in inputs):
            recorded._mixed = recorded._mixed or f"{_name(func)} of two values computed from the logits"
        place = lambda a: LOGITS if a is source else a  # noqa: E731
        recorded._ops = (*source._ops, (func, tuple(map(place, args)), {k: place(v) for k, v in kwargs.items()}))
        return recorded


class _Stub:
    """What the stand-in decoder returns: hidden states of zeros, nothing else."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> Any:
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name: str) -> None:
        return None


def logit_transform(model: nn.Module) -> LogitTransform:
    """The operations `model`'s forward applies to its logits after its output layer (see the module's docstring).
    Runs the forward once with its decoder and output layer stood in for: no weight is read, nothing is computed.

    Raises:
        ConfigError: an operation on the logits that does not act on each position alone, or a forward whose
            logits are not computed from its output layer's.
    """
    model = _unwrapped(model)
    head = model.get_output_embeddings()
    decoder = model.base_model if model.base_model is not model else None
    if head is None or decoder is None:
        return LogitTransform()
    # A ZeRO-3 partitioned weight keeps its full shape as `ds_shape`; nothing here reads the weights.
    positions, vocabulary = 3, getattr(head.weight, "ds_shape", head.weight.shape)[0]
    hidden = torch.zeros(1, positions, model.config.get_text_config().hidden_size)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, positions, vocabulary, generator=generator) * 8  # far from flat: a transform shows

    def stand_in_head(hidden_states: torch.Tensor) -> torch.Tensor:
        return sample.clone().as_subclass(_Recorder)

    own = {module: module.__dict__.get("forward") for module in (head, decoder)}  # an instance's own (hooks')
    head.forward = stand_in_head
    decoder.forward = lambda *args, **kwargs: _Stub(hidden)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.zeros(1, positions, dtype=torch.long), use_cache=False).logits
    finally:
        for module, forward in own.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward
    name = type(model).__name__
    if not isinstance(logits, _Recorder):
        raise ConfigError(f"{name}'s forward does not return logits computed from its output layer's; colograd "
                          "computes the log-probs from that layer and cannot train it.")  # fmt: skip
    if logits._mixed:
        raise ConfigError(f"{name} transforms its logits after its output layer with {logits._mixed}, which "
                          "colograd cannot apply a chunk of positions at a time.")  # fmt: skip
    transform = LogitTransform(logits._ops)
    with torch.no_grad():
        whole = logits.as_subclass(torch.Tensor).reshape(positions, vocabulary)
        rows = sample.reshape(positions, vocabulary)
        try:
            by_chunk = torch.cat([transform(rows[i : i + 1]) for i in range(positions)])
        except Exception as err:  # an operation written for [batch, positions, vocabulary]
            raise ConfigError(f"{name} transforms its logits after its output layer ({transform.describe()}) in a "
                              f"way colograd cannot apply to a chunk of positions ({err}).") from None  # fmt: skip
    if by_chunk.shape != whole.shape or not torch.allclose(by_chunk, whole, rtol=1e-5, atol=1e-5):
        raise ConfigError(f"{name} transforms its logits after its output layer ({transform.describe()}) across "
                          "positions; colograd computes them a chunk of positions at a time and cannot train "
                          "it.")  # fmt: skip
    return transform


_LEARNT: "weakref.WeakKeyDictionary[nn.Module, LogitTransform]" = weakref.WeakKeyDictionary()


def of(model: nn.Module) -> LogitTransform:
    """`model`'s transform, learnt once per model (`logit_transform`); through DDP, DeepSpeed and PEFT wrappers the
    same model gives the same one. Learn it before DeepSpeed wraps the model: the probe then runs no hook."""
    inner = _unwrapped(model)
    if inner not in _LEARNT:
        _LEARNT[inner] = logit_transform(inner)
    return _LEARNT[inner]


class _Passthrough(torch.Tensor):
    """What the output layer returns while it computes log-probs: the forward's own operations on the logits, already
    applied to each chunk, leave it unchanged, in their order (`_left`, shared by the tensors they pass through); any
    other operation computes as usual. One whose result is the tensor itself under another name (an alias of its
    data, shape and dtype: DeepSpeed ZeRO-3's hook on every module's output detaches it through an autograd function
    on its way out of the output layer) passes it on, still held."""

    _left: list

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        held = next((a for a in (*args, *kwargs.values()) if isinstance(a, _Passthrough)), None)
        if held is not None and held._left and held._left[0] is func:
            held._left.pop(0)
            return held
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            alias = (
                held is not None
                and isinstance(out, torch.Tensor)
                and not isinstance(out, _Passthrough)
                and (out.data_ptr(), out.shape, out.dtype) == (held.data_ptr(), held.shape, held.dtype)
            )
        if alias:
            out = out.as_subclass(_Passthrough)
            out._left = held._left
        return out


def passthrough(out: torch.Tensor, transform: LogitTransform, left: list) -> torch.Tensor:
    """`out` (the log-probs the output layer computed, the transform already applied) as the forward will see it;
    `left` is filled with the transform's operations, and emptied as the forward applies them (`returned` checks)."""
    left[:] = [func for func, _, _ in transform.ops]
    if not left:
        return out
    held = out.as_subclass(_Passthrough)
    held._left = left
    return held


def returned(out: torch.Tensor, left: list, transform: LogitTransform, model: nn.Module) -> torch.Tensor:
    """The forward's logits back as a plain tensor, once every operation of `transform` went through (`left` is
    empty).

    Raises:
        RuntimeError: the forward transformed its logits otherwise than when it was probed.
    """
    if left:
        raise RuntimeError(
            f"{type(_unwrapped(model)).__name__}'s forward transformed its logits otherwise than when colograd "
            f"probed it ({transform.describe()}; not applied: {', '.join(map(_name, left))}): the log-probs "
            "would be wrong."
        )
    return out.as_subclass(torch.Tensor) if isinstance(out, _Passthrough) else out


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed (`.module`) and PEFT wrappers. DeepSpeed's engine answers
    for its module's attributes (`get_output_embeddings` included) but not for its `config`, so a wrapper is told
    by the module it holds."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))
