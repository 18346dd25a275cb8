"""Copy plans: a sync on the direct path as plain copies, recorded once from the model's own loaders.

On the direct path a sync hands checkpoint-named tensors to the engine's `model.load_weights`. vLLM maps each name,
finds the stacked tensor it goes into (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, an expert layer's
`gate_up_proj` [E, 2I, H] into `w13_weight`) and calls a weight loader per tensor and shard, and in an expert layer
per expert: tens of microseconds of Python a call, 3 × experts × layers calls for the experts of a Mixture-of-Experts
model (18,432 at Qwen3-30B-A3B). What the loaders do is copy slices of the given tensors into slices of the engine's,
and zero the padding rows of a vocabulary; for the same names and shapes they copy the same slices every time.

So the first call with a set of tensors runs the loader under a recorder that sees every write into the engine's
tensors (`_Recorder`). Each must be a copy from a view of a given tensor or a fill with a constant; the views become
a plan, with an expert layer's per-expert copies merged into one strided copy per engine tensor (`_merge`). Before it
is kept, the plan is replayed once against the loader's result, which it must give bit for bit. Later calls with the
same tensors replay it: `torch._foreach_copy_` per dtype pair, straight from the trainer's tensors into the engine's,
casting on the way (fp32 masters into a bf16 engine). No engine tensor moves: a plan writes into the storage the
engine's tensors hold (captured CUDA graphs read those addresses).

A call runs the loader instead where the names, shapes, layout or aliasing of the given tensors differ from the
plan's, or an engine tensor the plan writes holds other storage than it did (a new plan is recorded then), and for
good where the loader did more than copy (computed a tensor, wrote one in place otherwise, read a value, moved a
tensor) or the replay differs from it.

The `*_in_engine` functions run in the engine's worker (handed to `LLM.collective_rpc`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

Pairs = list[tuple[str, torch.Tensor]]

_COPY = torch.ops.aten.copy_.default
_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _View:
    """A strided view of a storage, in elements of the tensor it is taken of."""

    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.size, self.stride, self.offset)

    @staticmethod
    def at(tensor: torch.Tensor) -> "_View":
        return _View(tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


@dataclass(frozen=True)
class _Write:
    """One write the loader made into view `dst` of engine tensor `target`: a copy from view `src` of given tensor
    `source`, or (`source` None) a fill with `value`."""

    target: int
    dst: _View
    source: int | None = None
    src: _View | None = None
    value: float | int | bool | None = None


@dataclass
class _Target:
    """An engine tensor a plan writes into: its name, where its module holds it, a 1-D view of its whole storage
    (the writes are views of it), and its address when recorded."""

    name: str
    slots: dict[str, torch.Tensor | None]  # the module's `_parameters` or `_buffers`
    leaf: str
    whole: torch.Tensor
    address: int

    def moved(self) -> bool:
        tensor = self.slots.get(self.leaf)
        return tensor is None or tensor.data_ptr() != self.address


class CopyPlan:
    """The writes of one loader call, replayed as copies between views, one `torch._foreach_copy_` per dtype pair.

    Args:
        signature: `_signature` of the tensors the loader was given.
        targets: the engine tensors written.
        writes: the loader's writes, merged (`_merge`).
        loaded: what `model.load_weights` returned (the engine's names of the tensors it loaded).
    """

    def __init__(self, signature: tuple, targets: list[_Target], writes: list[_Write], loaded: Any) -> None:
        self.signature, self.targets, self.writes, self.loaded = signature, targets, writes, loaded
        groups: dict[tuple, tuple[list[torch.Tensor], list[tuple[int, _View]]]] = {}
        self.fills: list[tuple[torch.Tensor, Any]] = []
        for write in writes:
            dst = write.dst.of(targets[write.target].whole)
            if write.source is None:
                self.fills.append((dst, write.value))
                continue
            dsts, srcs = groups.setdefault((dst.dtype, signature[write.source][1]), ([], []))
            dsts.append(dst)
            srcs.append((write.source, write.src))
        self.groups = list(groups.values())

    @property
    def copies(self) -> int:
        return sum(len(dsts) for dsts, _ in self.groups)

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the plan writes what the loader would for `tensors`, into the engine's tensors as they are now."""
        return _signature(tensors) == self.signature and not any(target.moved() for target in self.targets)

    def replay(self, tensors: list[torch.Tensor]) -> None:
        """Write `tensors` (of the recorded signature) into the engine as the loader did."""
        for dsts, srcs in self.groups:
            torch._foreach_copy_(dsts, [src.of(tensors[source]) for source, src in srcs])
        for dst, value in self.fills:
            dst.fill_(value)


@torch.no_grad()
def load(model: nn.Module, weights: Pairs) -> Any:
    """Runs in the engine's worker: `model.load_weights(weights)`, through a copy plan where one fits.

    Plans are kept on the model, one per tuple of names (a bucketed sync makes one per bucket); a tuple whose plan the
    recording refused goes to the loader from then on.

    Args:
        model: the engine's model.
        weights: (checkpoint name, tensor) pairs, as `model.load_weights` takes them.

    Returns:
        What `model.load_weights` returns: the engine's names of the tensors loaded (shared with the plan: not to be
        changed).
    """
    plans = getattr(model, "_colograd_copy_plans", None)
    if plans is None:
        plans = model._colograd_copy_plans = {}
    if getattr(model, "_colograd_copy_plans_off", False):
        return model.load_weights(weights)
    names = tuple(name for name, _ in weights)
    tensors = [tensor for _, tensor in weights]
    plan = plans.get(names)
    if isinstance(plan, str):  # refused: why
        return model.load_weights(weights)
    if plan is not None and plan.fits(tensors):
        plan.replay(tensors)
        return plan.loaded
    loaded, plans[names] = _record(model, weights)
    return loaded


def _signature(tensors: list[torch.Tensor]) -> tuple:
    """What a plan's views of the given tensors rest on: each one's shape, dtype, device, strides and storage offset,
    and the first of them sharing its storage (tied weights, or views of one fused tensor)."""
    first: dict[int, int] = {}
    return tuple(
        (
            t.shape,
            t.dtype,
            t.device,
            t.stride(),
            t.storage_offset(),
            first.setdefault(t.untyped_storage().data_ptr(), i),
        )
        for i, t in enumerate(tensors)
    )


def _record(model: nn.Module, weights: Pairs) -> tuple[Any, "CopyPlan | str"]:
    """Run the loader on `weights` under a `_Recorder`, then make its writes a plan and check it (`_checked`).

    Returns:
        (what the loader returned, the plan; or why there is none)
    """
    tensors = [tensor for _, tensor in weights]
    signature = _signature(tensors)
    sources: dict[int, int] = {}
    for index, tensor in enumerate(tensors):
        sources.setdefault(tensor.untyped_storage().data_ptr(), index)
    engine = _engine_tensors(model)
    addresses = [entry[-1].data_ptr() for entry in engine.values()]
    recorder = _Recorder(engine, sources, tensors)
    with recorder:
        loaded = model.load_weights(weights)
        loaded = set(loaded) if loaded is not None else None
    if recorder.refused is None and addresses != [entry[-1].data_ptr() for entry in engine.values()]:
        recorder.refused = "the loader gave an engine tensor new storage"
    if recorder.refused is not None:
        return loaded, recorder.refused
    targets = [_target(*engine[storage]) for storage in recorder.targets]
    plan = CopyPlan(signature, targets, _merge(recorder.writes), loaded)
    return loaded, _checked(plan, model, weights)


def _engine_tensors(model: nn.Module) -> dict[int, tuple[str, dict, str, torch.Tensor]]:
    """Every parameter and buffer of the engine's model that holds data, by the address of its storage: (its name,
    the module's `_parameters` or `_buffers`, its key there, the tensor). A tied tensor is listed once."""
    tensors: dict[int, tuple[str, dict, str, torch.Tensor]] = {}
    for path, module in model.named_modules():
        for slots in (module._parameters, module._buffers):
            for leaf, tensor in slots.items():
                if tensor is not None and tensor.numel() > 0:
                    name = f"{path}.{leaf}" if path else leaf
                    tensors.setdefault(tensor.untyped_storage().data_ptr(), (name, slots, leaf, tensor))
    return tensors


def _target(name: str, slots: dict, leaf: str, tensor: torch.Tensor) -> _Target:
    return _Target(name, slots, leaf, _whole(tensor), tensor.data_ptr())


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the tensor's whole storage, in its dtype (a write's view has its offset in that storage)."""
    return tensor.detach().as_strided((tensor.untyped_storage().nbytes() // tensor.element_size(),), (1,), 0)


def _storage(tensor: Any) -> int | None:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) and tensor.numel() else None


class _Recorder(TorchDispatchMode):
    """Sees every tensor operation of a loader call (below autograd, so views and in-place writes alike) and keeps
    its writes into the engine's tensors, as views: copies from views of the given tensors, and fills with a
    constant (a padded vocabulary's rows). Any other write into an engine tensor, any write into a given tensor and
    any read of a given tensor's value into Python sets `refused`.

    Args:
        engine: the engine's tensors (`_engine_tensors`).
        sources: the first given tensor holding each storage, by its address.
        tensors: the given tensors.
    """

    def __init__(self, engine: dict[int, tuple], sources: dict[int, int], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.engine, self.sources, self.tensors = engine, sources, tensors
        self.targets: dict[int, int] = {}  # the storages written, in order: their index in the plan's targets
        self.writes: list[_Write] = []
        self.refused: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.refused is None:
            self.refused = self._see(func, args, kwargs)
        return func(*args, **kwargs)

    def _see(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """Keep the op's write into an engine tensor; None, or why the loader's writes cannot be a plan."""
        if func is _SCALAR_READ and _storage(args[0]) in self.sources:
            return "the loader read a value of a given tensor"
        for tensor in _written(func, args, kwargs):
            storage = _storage(tensor)
            if storage in self.sources:
                return f"the loader wrote into a given tensor ({func})"
            if storage not in self.engine:
                continue  # a temporary of the loader's own
            name, *_, whole = self.engine[storage]
            if tensor.dtype != whole.dtype:
                return f"the loader wrote into {name} through a view of another dtype"
            target = self.targets.setdefault(storage, len(self.targets))
            if func in _FILLS:
                value = args[1] if func is torch.ops.aten.fill_.Scalar else 0
                self.writes.append(_Write(target, _View.at(tensor), value=value))
            elif func is _COPY:
                reason = self._copy(target, tensor, args[1], name)
                if reason:
                    return reason
            else:
                return f"the loader wrote into {name} with {func}"
        return None

    def _copy(self, target: int, dst: torch.Tensor, src: Any, name: str) -> str | None:
        source = self.sources.get(_storage(src))
        if source is None:
            return f"the loader copied a tensor it computed into {name}"
        if src.dtype != self.tensors[source].dtype or src.is_conj() or src.is_neg():
            return f"the loader copied a reinterpreted view of a given tensor into {name}"
        src = src.expand(dst.shape)  # what copy_ broadcasts
        self.writes.append(_Write(target, _View.at(dst), source, _View.at(src)))
        return None


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an op writes into (in-place `self`, `out=`), by its schema."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            written.extend(value if isinstance(value, (list, tuple)) else [value])
    return [tensor for tensor in written if isinstance(tensor, torch.Tensor) and tensor.numel()]


def _merge(writes: list[_Write]) -> list[_Write]:
    """The writes with runs of like copies merged: copies of one shape from one given tensor into one engine tensor,
    at evenly spaced offsets in both (an expert layer's loader copies each expert on its own), become one copy with
    a leading dimension; then so do runs of those (gate, then up, into `w13_weight`). Writes are grouped by engine
    and given tensor first, which changes nothing where no two writes overlap (`_checked` refuses a plan where
    they do)."""
    merged = sorted(writes, key=lambda w: (w.target, w.source is None, w.source or 0))
    while True:
        out: list[_Write] = []
        for write in merged:
            joined = _joined(out[-1], write) if out and write.source is not None else None
            out[-1:] = [joined] if joined is not None else [*out[-1:], write]
        if len(out) == len(merged):
            return out
        merged = out


def _joined(run: _Write, write: _Write) -> _Write | None:
    """`run` and `write` as one copy, where `write` continues `run`: the next slice along `run`'s leading dimension,
    in the engine tensor and in the given one; or, of the same shape as `run`, a second copy that starts a leading
    dimension spaced by their offsets (as_strided takes no negative stride: a spacing in the engine tensor is
    positive, one in the given tensor non-negative)."""
    if run.source is None or (run.target, run.source) != (write.target, write.source):
        return None
    dst, src = run.dst, run.src
    if (write.dst.size, write.dst.stride, write.src.stride) == (dst.size[1:], dst.stride[1:], src.stride[1:]) and (
        write.dst.offset == dst.offset + dst.size[0] * dst.stride[0]
        and write.src.offset == src.offset + src.size[0] * src.stride[0]
    ):
        size = (dst.size[0] + 1, *write.dst.size)
        return _Write(run.target, _View(dst.offset, size, dst.stride), run.source, _View(src.offset, size, src.stride))
    if (write.dst.size, write.dst.stride, write.src.stride) == (dst.size, dst.stride, src.stride):
        step_dst, step_src = write.dst.offset - dst.offset, write.src.offset - src.offset
        if step_dst > 0 and step_src >= 0:
            size = (2, *dst.size)
            return _Write(run.target, _View(dst.offset, size, (step_dst, *dst.stride)),
                          run.source, _View(src.offset, size, (step_src, *src.stride)))  # fmt: skip
    return None


def _checked(plan: CopyPlan, model: nn.Module, weights: Pairs) -> "CopyPlan | str":
    """`plan`, if its replay gives what the loader wrote, bit for bit, in every engine tensor; else why not. Run right
    after the loader's call that `plan` was recorded from; the engine holds the loader's result again after it.

    Each element the plan writes must come out of its replay with the loader's bits (`_replays_exactly`), and no
    element outside them may be one the loader writes (`_writes_nothing_else`): a write the recorder could not see
    (a kernel that does not declare what it mutates) would leave the plan short.
    """
    tensors = [tensor for _, tensor in weights]
    for index, target in enumerate(plan.targets):
        writes = [write for write in plan.writes if write.target == index]
        reason = _replays_exactly(target, writes, tensors)
        if reason:
            return reason
    return _writes_nothing_else(plan, model, weights) or plan


def _coverage(writes: list[_Write], whole: torch.Tensor) -> torch.Tensor | None:
    """How many of `writes` write each element of `whole`; None where a write's view overlaps itself."""
    counts = torch.zeros(whole.shape, dtype=torch.uint8, device=whole.device)
    try:
        for write in writes:
            write.dst.of(counts).add_(1)
    except RuntimeError:
        return None
    return counts


def _replays_exactly(target: _Target, writes: list[_Write], tensors: list[torch.Tensor]) -> str | None:
    """None if the writes into `target`, replayed, give the loader's bits; else why not (the loader's result then
    put back). One copy of the tensor at a time. The writes must not overlap (a replay copies in no set order);
    each element they write is first set to the complement of the loader's bits, so that one the replay misses or
    gets wrong differs."""
    whole = target.whole
    counts = _coverage(writes, whole)
    if counts is None or counts.max().item() > 1:
        return f"the loader's writes into {target.name} overlap"
    del counts
    expected = whole.clone()
    bits, expected_bits = whole.view(_BITS[whole.element_size()]), expected.view(_BITS[whole.element_size()])
    for write in writes:
        write.dst.of(bits).copy_(write.dst.of(expected_bits).bitwise_not())
    for write in writes:
        dst = write.dst.of(whole)
        dst.copy_(write.src.of(tensors[write.source])) if write.source is not None else dst.fill_(write.value)
    if not torch.equal(bits, expected_bits):
        whole.copy_(expected)
        return f"a replay differs from the loader in {target.name}"
    return None


def _writes_nothing_else(plan: CopyPlan, model: nn.Module, weights: Pairs) -> str | None:
    """None if the loader, run again, writes no element of any engine tensor that the plan does not write; else
    where it did (the engine then holds the loader's result again).

    Those elements are set to the complement of their bits first, and summed; after the loader their sum must be
    the same (an element it wrote holds its bits again, which a sum tells from their complement unless the writes
    of a whole tensor happen to cancel out). The complement is then undone. One tensor of counts at a time."""
    targets = {target.whole.untyped_storage().data_ptr(): index for index, target in enumerate(plan.targets)}
    elsewhere = []  # (name, bits, index of the plan's target or None, sum of the complemented elements)
    for storage, (name, *_, tensor) in _engine_tensors(model).items():
        index = targets.get(storage)
        bits = _whole(tensor).view(_BITS[tensor.element_size()])
        outside = _outside(plan, index, bits)
        if outside is None:
            bits.bitwise_not_()
            elsewhere.append((name, bits, index, bits.sum(dtype=torch.int64)))
        elif outside.any():
            bits[outside] = bits[outside].bitwise_not()
            elsewhere.append((name, bits, index, bits[outside].sum(dtype=torch.int64)))
    model.load_weights(weights)
    written = []
    for name, bits, index, before in elsewhere:
        outside = _outside(plan, index, bits)
        if outside is None:
            after = bits.sum(dtype=torch.int64)
            bits.bitwise_not_()
        else:
            after = bits[outside].sum(dtype=torch.int64)
            bits[outside] = bits[outside].bitwise_not()
        if not torch.equal(before, after):
            written.append(name)
    if written:
        model.load_weights(weights)  # what the complement's undoing turned back
        return f"the loader wrote into {written[0]} where the plan does not"
    return None


def _outside(plan: CopyPlan, index: int | None, bits: torch.Tensor) -> torch.Tensor | None:
    """The elements of an engine tensor (`bits`, its whole storage) that the plan does not write, as a mask; None
    for all of them (a tensor the plan does not write into, `index` None)."""
    if index is None:
        return None
    return _coverage([write for write in plan.writes if write.target == index], bits) == 0


def set_enabled_in_engine(worker: Any, enabled: bool) -> None:
    """Runs in the engine's worker: whether its direct-path loads go through copy plans (the default) or always
    through the model's loader (a benchmark's comparison)."""
    worker.model_runner.model._colograd_copy_plans_off = not enabled


def summary_in_engine(worker: Any) -> dict[str, Any]:
    """Runs in the engine's worker: its copy plans (one per tuple of names loaded): how many, the copies and fills
    they replay, the tensors they take, and why any were refused."""
    plans = getattr(worker.model_runner.model, "_colograd_copy_plans", None) or {}
    kept = [plan for plan in plans.values() if isinstance(plan, CopyPlan)]
    return {
        "plans": len(kept),
        "tensors": sum(len(plan.signature) for plan in kept),
        "copies": sum(plan.copies for plan in kept),
        "fills": sum(len(plan.fills) for plan in kept),
        "refused": [reason for reason in plans.values() if isinstance(reason, str)],
    }
