"""Padding-free passes through a model whose layers carry state along the sequence (`colograd.models.hybrid`): the
sequences packed in rows for every other layer, and each layer with state given them apart.

transformers' torch path of these layers (Gated DeltaNet, Mamba-2, short convolutions) reads no sequence boundary:
packed end to end, a sequence would start from the state its neighbour left. Their kernels that read one (the
flash-linear-attention and causal-conv1d kernels' `cu_seqlens` / `seq_idx`) are GPU code. Here each such layer
(`mixers`: the module that owns a depthwise causal convolution, as every one of these families' layers does) takes
its input unpacked, one sequence per row from column 0 and zeros after it, and gives its output back packed, in the
same pass (`apart`). Right padding is exact for a causal layer: a sequence's outputs never read the columns after
it. Everything else (projections of the other layers, attention with packed position ids, the MLPs, the output
layer) computes the real tokens only.

The layout travels as a keyword argument of the model's call (`KWARG`), which the families' decoder layers hand on to
their mixers, so that a layer recomputed in the backward (gradient checkpointing) lays out its input as its forward
did. A family that does not hand it on is found before training (`Apart.probe`), and its passes then run padded.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The keyword argument of the model's call that carries the layout to the layers with state.
KWARG = "colograd_sequences"


@dataclass
class Sequences:
    """Where each real token of packed rows [R, W] sits: its flat position in the rows (`dest`), its sequence and
    its position there; `count` sequences, the longest `width` tokens."""

    dest: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    count: int
    width: int

    @classmethod
    def of(cls, position_ids: torch.Tensor, weights: torch.Tensor) -> "Sequences":
        """The layout of packed rows (`colograd.forward.logps.pack`): `weights` [R, W] is 0 on padding, the position
        ids restart at 0 at each sequence (a prompt shared by several sequences is not this layout)."""
        dest = weights.flatten().nonzero().squeeze(1)
        position = position_ids.flatten()[dest]
        sequence = (position == 0).cumsum(0) - 1
        count, width = int(sequence[-1]) + 1, int(position.max()) + 1
        return cls(dest, sequence, position, count, width)

    def unpack(self, hidden_RWH: torch.Tensor) -> torch.Tensor:
        """[R, W, ...] packed rows to [count, width, ...]: one sequence per row from column 0, zeros after it."""
        flat = hidden_RWH.flatten(0, 1)
        out = flat.new_zeros((self.count, self.width, *flat.shape[1:]))
        return out.index_put((self.sequence, self.position), flat[self.dest])

    def pack(self, out_NLH: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """[count, width, ...] back to packed rows [rows, columns, ...], zeros on their padding."""
        flat = out_NLH.new_zeros((rows * columns, *out_NLH.shape[2:]))
        flat = flat.index_put((self.dest,), out_NLH[self.sequence, self.position])
        return flat.view(rows, columns, *out_NLH.shape[2:])


def mixers(model: nn.Module) -> list[nn.Module]:
    """The model's layers that carry state along the sequence: each module that owns a depthwise 1-d convolution
    (Gated DeltaNet's and Mamba-2's `conv1d`, LFM2's `conv`), once."""
    found = []
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.Conv1d) and child.groups == child.in_channels > 1 and module not in found:
                found.append(module)
    return found


class Apart:
    """The hooks on a model's layers with state that unpack their input and pack their output when the model is
    called with `KWARG`; each call counted, so that a pass can check every layer took the layout."""

    def __init__(self, *models: nn.Module) -> None:
        found = [mixers(model) for model in models]
        self.layers = [layer for layers in found for layer in layers]
        self.per_model = len(found[0]) if found else 0  # the layers one pass of one model calls
        self.calls = 0
        self._open: dict[int, tuple[Sequences, int, int]] = {}
        self.handles = [
            handle
            for layer in self.layers
            for handle in (
                layer.register_forward_pre_hook(self._before, with_kwargs=True),
                layer.register_forward_hook(self._after, with_kwargs=True),
            )
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _before(self, layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        sequences = kwargs.pop(KWARG, None)
        if sequences is None:
            return args, kwargs
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        rows, columns = hidden.shape[:2]
        self._open[id(layer)] = (sequences, rows, columns)
        self.calls += 1
        if "attention_mask" in kwargs:  # the packed rows' (or None): the unpacked rows' padding trails every token
            kwargs["attention_mask"] = None
        return (sequences.unpack(hidden), *args), kwargs

    def _after(self, layer: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        opened = self._open.pop(id(layer), None)
        if opened is None:
            return None
        sequences, rows, columns = opened
        if isinstance(output, tuple):
            return (sequences.pack(output[0], rows, columns), *output[1:])
        return sequences.pack(output, rows, columns)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Around one packed pass: every layer with state took the layout at least once, or this raises (a
        family whose decoder layers do not hand the keyword on would leak state between packed sequences)."""
        before = self.calls
        yield
        if self.calls - before < self.per_model:
            raise RuntimeError(
                f"colograd: {self.per_model - (self.calls - before)} of the model's {self.per_model} layers with "
                "state were called without the packed sequences' layout; set padding_free: false"
            )
