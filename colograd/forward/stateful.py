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

A layer given sequences of very different lengths computes them in groups of similar length (`groups`), each
padded to its own longest, not all to the longest of the pass: transformers' Gated DeltaNet computes every padded
column, in chunks of 64, and most of a hybrid's training pass is in those layers.

The layout travels as a keyword argument of the model's call (`KWARG`), which the families' decoder layers hand on to
their mixers, so that a layer recomputed in the backward (gradient checkpointing) lays out its input as its forward
did. A family that does not hand it on is found before training (`colograd.forward.core.packed_apart`), and its
passes then run padded.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    # `parts` by multiple: every layer of a pass (and its recomputation in the backward) groups the same sequences.
    _parts: dict[int, list["Sequences"]] = field(default_factory=dict, init=False, repr=False)

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

    def pack(self, out_NLH: torch.Tensor, rows: int, columns: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """[count, width, ...] back to packed rows [rows, columns, ...], zeros on their padding (or, `into`, on top
        of another layout's output over the same rows)."""
        flat = out_NLH.new_zeros((rows * columns, *out_NLH.shape[2:])) if into is None else into.flatten(0, 1)
        flat = flat.index_put((self.dest,), out_NLH[self.sequence, self.position])
        return flat.view(rows, columns, *out_NLH.shape[2:])

    def parts(self, multiple: int = 1) -> list["Sequences"]:
        """These sequences in groups of similar length (`groups`, for a layer that pads a sequence to a `multiple` of
        tokens), each a layout of its own over the same rows; worked out once per multiple."""
        if multiple not in self._parts:
            self._parts[multiple] = self._grouped(multiple)
        return self._parts[multiple] or [self]

    def _grouped(self, multiple: int) -> list["Sequences"]:
        """The groups' layouts, or none where all are one group (kept apart from `self`: no reference cycle)."""
        lengths = torch.bincount(self.sequence, minlength=self.count)
        found = groups(lengths.tolist(), multiple)
        if len(found) == 1:
            return []
        parts = []
        for members in found:
            index = torch.full((self.count,), -1, dtype=torch.long, device=self.sequence.device)
            index[members] = torch.arange(len(members), device=index.device)
            kept = (index[self.sequence] >= 0).nonzero().squeeze(1)
            width = int(lengths[members].max())
            parts.append(
                Sequences(self.dest[kept], index[self.sequence[kept]], self.position[kept], len(members), width)
            )
        return parts


def groups(lengths: list[int], multiple: int = 1, saving: float = 0.15, most: int = 4) -> list[list[int]]:
    """The sequences (by index) in at most `most` groups of similar length, for a layer that computes each group
    padded to its longest, rounded up to a `multiple` of tokens (a Mamba-2 layer's chunk): split where a split cuts
    the padded tokens (members × padded longest, summed over the groups) by at least `saving` of them, the best split
    first. Each call of the layer costs more than its tokens, so a group is not split for a few tokens."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)

    def area(a: int, b: int) -> int:  # the sorted sequences a..b-1, padded to the longest (the last)
        return (b - a) * -(-lengths[order[b - 1]] // multiple) * multiple

    spans = [(0, len(order))]
    while len(spans) < most:
        total = sum(area(a, b) for a, b in spans)
        best = max(
            ((area(a, b) - area(a, c) - area(c, b), i, c) for i, (a, b) in enumerate(spans) for c in range(a + 1, b)),
            default=None,
        )
        if best is None or best[0] < saving * total:
            break
        _, i, c = best
        a, b = spans[i]
        spans[i : i + 1] = [(a, c), (c, b)]
    return [order[a:b] for a, b in spans]


def mixers(model: nn.Module) -> list[nn.Module]:
    """The model's layers that carry state along the sequence: each module that owns a depthwise 1-d convolution
    (Gated DeltaNet's and Mamba-2's `conv1d`, LFM2's `conv`), once."""
    found = []
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.Conv1d) and child.groups == child.in_channels > 1 and module not in found:
                found.append(module)
    return found


def padded_to(layer: nn.Module) -> int:
    """The multiple of tokens `layer` pads a sequence to: a Mamba-2 layer's chunk (`chunk_size`, transformers' torch
    path pads to it), else 1 (Gated DeltaNet's chunks of 64 are not an attribute of its layer, nor counted)."""
    chunk = getattr(layer, "chunk_size", 1)
    return chunk if isinstance(chunk, int) and chunk > 0 else 1


class Apart:
    """The model's layers with state, their `forward` wrapped to take their input unpacked and give their output
    packed when the model is called with `KWARG` (once per group of similar length); each call counted, so that a
    pass can check every layer took the layout."""

    def __init__(self, *models: nn.Module) -> None:
        found = [mixers(model) for model in models]
        self.layers = [layer for layers in found for layer in layers]
        self.per_model = len(found[0]) if found else 0  # the layers one pass of one model calls
        self.calls = 0
        # The layer's own `forward` attribute, if it had one (another wrapper), to put back on `remove`.
        self._before = [layer.__dict__.get("forward") for layer in self.layers]
        for layer in self.layers:  # an attribute of the instance, ahead of the class's: inside the module's hooks
            layer.forward = self._apart(layer, layer.forward)

    def remove(self) -> None:
        for layer, before in zip(self.layers, self._before, strict=True):
            if before is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = before

    def _apart(self, layer: nn.Module, forward: Any) -> Any:
        multiple = padded_to(layer)

        def apart(*args: Any, **kwargs: Any) -> Any:
            sequences = kwargs.pop(KWARG, None)
            if sequences is None:
                return forward(*args, **kwargs)
            if args:
                hidden, args = args[0], args[1:]
            else:
                hidden = kwargs.pop("hidden_states")
            rows, columns = hidden.shape[:2]
            self.calls += 1
            if "attention_mask" in kwargs:  # the packed rows' (or None): the unpacked rows' padding trails every token
                kwargs["attention_mask"] = None
            packed, rest = None, None  # rest: what follows the output in a tuple (the first group's)
            # Under ZeRO-3 each call of the layer's modules gathers their weights from every rank, and ranks group
            # their own sequences: one call each, so that every rank gathers the same number of times.
            partitioned = any(hasattr(p, "ds_id") for p in layer.parameters())
            for part in [sequences] if partitioned else sequences.parts(multiple):
                output = forward(part.unpack(hidden), *args, **kwargs)
                if isinstance(output, tuple):
                    output, rest = output[0], output[1:] if rest is None else rest
                packed = part.pack(output, rows, columns, into=packed)
            return packed if rest is None else (packed, *rest)

        return apart

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
