"""Weight sync: the trainer's updated weights go into the colocated engine, in place.

The engine lives in this process, so a sync is a memory pass: weights are handed over by reference in
checkpoint naming and the engine copies (and, on CPU, repacks) them. Never one engine call per tensor:

- full weights on every rank (single process, DDP): one engine call with every tensor;
- sharded weights (DeepSpeed ZeRO-3, FSDP2): parameters are gathered a bucket at a time — one coalesced
  collective per bucket (ZeRO-3) or per shard group (FSDP2), buckets cut at decoder-layer boundaries and
  sized in bytes — written into the engine, and freed, so the extra memory is bounded by the bucket size;
- PEFT LoRA, merged: each adapted weight is built as base + B·A and sent under the base model's names, a bucket
  at a time (only one bucket of built weights exists at once); a `modules_to_save` copy is sent in place of
  the module it replaces;
- PEFT LoRA, adapter only: the frozen base weights are sent once, then only the adapter tensors move and the
  engine applies them itself (vLLM's LoRA support).

`WeightPlan` works out once which tensors go under which names and in which buckets; each sync then only
gathers and hands over.
"""

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from torch import nn

from colograd.engine import moe
from colograd.engine.core import Engine
from colograd.vision.core import engine_weight_name

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")  # PEFT's `lm_head.modules_to_save.default.weight`


@dataclass
class _Unit:
    """One tensor to send, under every name it has in the checkpoint (tied weights have two)."""

    names: list[str]
    path: str  # where the model holds it: FSDP2 swaps in a new, unsharded parameter while gathered
    param: nn.Parameter
    lora: nn.Module | None = None  # the PEFT LoRA layer whose delta is added to this base weight
    gather: list[nn.Parameter] = field(default_factory=list)  # what must be gathered to build it
    buffer: bool = False  # a persistent buffer: never sharded, sent where the engine's model holds it

    @property
    def nbytes(self) -> int:
        if self.buffer:
            return self.param.numel() * self.param.element_size()
        # A ZeRO-3-partitioned parameter reports numel() == 0 on every rank; ds_numel is its real size.
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in self.gather)


class WeightPlan:
    """Which tensors the engine receives, under which names, grouped into buckets of about `bucket_bytes`.

    Args:
        model: the trained model, unwrapped (no DDP / DeepSpeed engine around it); may be a PEFT model.
        bucket_bytes: the most bytes gathered or built at once; None sends everything in one engine call,
            which is right when every rank holds the whole model and no weight is built (see `is_sharded`).
        adapter_only: for a PEFT model served by an engine started with LoRA enabled: send the base weights
            at the first sync only and the adapter at every sync.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int | None = None, adapter_only: bool = False) -> None:
        self.model = model
        self.adapter_only = adapter_only
        units = _units(model, merge_lora=not adapter_only)
        self.buckets = _bucketize(units, bucket_bytes) if bucket_bytes else [units]
        self.nbytes = sum(u.nbytes for u in units)
        lora = [_Unit([name], name, p, gather=[p]) for name, p in model.named_parameters() if "lora_" in name]
        self._lora_buckets = _bucketize(lora, bucket_bytes) if bucket_bytes else [lora]
        # The FSDP2 shard groups each bucket must unshard (none without FSDP2), worked out once: the module
        # tree does not change, and walking it for every tensor at every sync would cost milliseconds.
        self._groups = [_fsdp_groups(model, bucket) for bucket in self.buckets]
        self._lora_groups = [_fsdp_groups(model, bucket) for bucket in self._lora_buckets]
        self._base_sent = False
        self._names_checked = False
        # Names of a Mixture-of-Experts model that the engine's model does not take: sent in its checkpoints' layout on
        # disk (Mixtral's and DeepSeek-V2's engines take only per-expert expert names), converted at the first sync
        # and given as views of the trainer's tensors after it (`moe.DiskLayout`).
        self._on_disk: set[str] = set()
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        self._experts = moe.expert_count(base.config) is not None
        self._to_disk_layout = moe.on_disk_names(base)

    def sync(self, engine: Engine) -> int:
        """Bring `engine` up to date with the model. The engine's cached prompt KV of the old weights is not reused
        after it: requests carry the weights' version as their cache salt (`Engine.prompt`).

        Returns:
            The number of bytes handed over.
        """
        sent = 0
        if not self._names_checked:  # what the engine's model takes, asked once
            units = [unit for bucket in self.buckets for unit in bucket]
            # A tied tensor's second name, only where the engine's model has that module (Gemma-2's has no lm_head);
            # a MoE model's names it does not take go in the checkpoints' layout on disk.
            names = [name for unit in units for name in (unit.names if self._experts else unit.names[1:])]
            known = set(engine.known_names(names)) if names else set()
            for unit in units:
                unit.names[1:] = [name for name in unit.names[1:] if name in known]
            # Persistent buffers go where the engine's model holds them as tensors of its own (most it computes).
            buffers = [unit for unit in units if unit.buffer]
            held = set(engine.held_names([unit.names[0] for unit in buffers])) if buffers else set()
            saved = self._held_under_saved_names(engine, [unit for unit in buffers if unit.names[0] not in held])
            for bucket in self.buckets:
                bucket[:] = [unit for unit in bucket if not unit.buffer or unit.names[0] in held | saved]
            self.nbytes = sum(unit.nbytes for bucket in self.buckets for unit in bucket)
            if self._experts:
                self._on_disk = {name for unit in units for name in unit.names} - known
            self._on_disk |= saved
            self._names_checked = True
        # The frozen base goes once, and again whenever the engine dropped its weights (a level-2 sleep).
        if not (self.adapter_only and self._base_sent and not engine.stale):
            for bucket in self:
                engine.load_weights(bucket)
                # Drop this bucket's gathered or merged tensors before the next bucket is built, not after.
                bucket.clear()
            sent, self._base_sent = self.nbytes, True
        if self.adapter_only:
            sent += self._sync_adapter(engine)
        return sent

    def _held_under_saved_names(self, engine: Engine, buffers: list[_Unit]) -> set[str]:
        """Those of `buffers` that the engine's model holds under the name transformers saves them by, not the one
        it loads them as (EXAONE-MoE's router bias is `mlp.e_score_correction_bias` on disk and in vLLM's model,
        `mlp.gate.e_score_correction_bias` in the trainer's): they are sent in the checkpoints' layout (`_on_disk`).
        Asked once, at the first sync."""
        saved = {unit.names[0]: self._to_disk_layout.convert([(unit.names[0], unit.param)]) for unit in buffers}
        renamed = {name: pairs[0][0] for name, pairs in saved.items() if len(pairs) == 1 and pairs[0][0] != name}
        held = set(engine.held_names(list(renamed.values()))) if renamed else set()
        return {name for name, on_disk in renamed.items() if on_disk in held}

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket as (name, tensor) pairs; sharded buckets are gathered only while in use."""
        for bucket, groups in zip(self.buckets, self._groups, strict=True):
            with _gathered(bucket, groups):
                pairs = [(name, _tensor(self.model, u, reread=bool(groups))) for u in bucket for name in u.names]
                if self._on_disk:
                    on_disk = [pair for pair in pairs if pair[0] in self._on_disk]
                    pairs = [pair for pair in pairs if pair[0] not in self._on_disk] + self._to_disk_layout(on_disk)
                yield pairs

    def _sync_adapter(self, engine: Engine) -> int:
        """Hand the engine the active adapter's tensors under PEFT's saved names (adapter name left out)."""
        adapter = self.model.active_adapter
        tensors = {}
        for bucket, groups in zip(self._lora_buckets, self._lora_groups, strict=True):
            with _gathered(bucket, groups):
                for unit in bucket:
                    if f".{adapter}." in unit.path:
                        weight = _tensor(self.model, unit, reread=bool(groups)).clone()
                        tensors[unit.path.replace(f".{adapter}.", ".")] = weight
        engine.load_adapter(tensors, self.model.peft_config[adapter])
        return sum(t.numel() * t.element_size() for t in tensors.values())


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are partitioned across ranks (DeepSpeed ZeRO-3 or FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in model.parameters())


def _units(model: nn.Module, merge_lora: bool) -> list[_Unit]:
    """Every parameter the engine needs, once per tensor, with all its checkpoint names."""
    lora_layers = _lora_layers(model) if merge_lora else {}
    # PEFT's modules_to_save: a trained copy per adapter replaces the frozen original; the active one is sent.
    active = model.active_adapter if isinstance(model, PeftModel) else None
    by_tensor: dict[int, _Unit] = {}
    # The engine's name of a checkpoint name (a flat LLaVA vision tower is wrapped there, `colograd.vision.core`).
    rename = engine_weight_name(model.get_base_model() if isinstance(model, PeftModel) else model)
    # remove_duplicate=False lists a tied tensor under both names: the engine needs `lm_head.weight` as well
    # (vLLM's CPU backend keeps its own processed copy of the output projection, refreshed only when it
    # arrives; without it the engine samples from a stale head). Gemma-2's has no such layer: `sync` drops the name.
    for name, param in model.named_parameters(remove_duplicate=False):
        if "lora_" in name:
            continue  # adapters reach the engine merged into their base weights, or on their own
        if ".original_module." in name or (".modules_to_save." in name and f".modules_to_save.{active}." not in name):
            continue
        ckpt_name = rename(_checkpoint_name(name))
        if id(param) in by_tensor:
            by_tensor[id(param)].names.append(ckpt_name)
            continue
        module_name = name.rsplit(".", 2)[0] if name.endswith(".base_layer.weight") else None
        lora = lora_layers.get(module_name) if module_name else None
        extra = [p for n, p in lora.named_parameters() if "lora_" in n] if lora is not None else []
        by_tensor[id(param)] = _Unit([ckpt_name], name, param, lora, [param, *extra])
    # Persistent buffers are in the checkpoint too, and some hold trained values the engine's model loads like
    # weights (DeepSeek-V3-style routers' score-correction bias, xIELU's learned constants): an engine started from
    # dummy weights keeps dummy values there unless they are sent.
    for name, buffer in _persistent_buffers(model):
        if id(buffer) not in by_tensor and buffer.is_floating_point():
            by_tensor[id(buffer)] = _Unit([rename(_checkpoint_name(name))], name, buffer, buffer=True)
    # Each layer's tensors together (a bucket never splits a layer, see `_bucketize`): buffers beside their layer's.
    order: dict[str, int] = {}
    units = list(by_tensor.values())
    for unit in units:
        order.setdefault(_layer_key(unit.names[0]), len(order))
    return sorted(units, key=lambda unit: order[_layer_key(unit.names[0])])


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's buffers that its state dict (so its checkpoint) holds, by name; PEFT's `original_module` copies
    left out, as their parameters are."""
    for path, module in model.named_modules():
        for leaf, buffer in module._buffers.items():
            name = f"{path}.{leaf}" if path else leaf
            if buffer is None or leaf in module._non_persistent_buffers_set or ".original_module." in name:
                continue
            yield name, buffer


def _checkpoint_name(name: str) -> str:
    """The base model's checkpoint name of a (possibly PEFT-wrapped) parameter."""
    return _SAVED_COPY.sub(".", name.removeprefix("base_model.model.").replace(".base_layer.", "."))


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _tensor(model: nn.Module, unit: _Unit, reread: bool) -> torch.Tensor:
    """The unit's tensor as the engine should receive it. `reread`: look the parameter up again by its path,
    because FSDP2 swapped in an unsharded one while gathered."""
    weight = (model.get_parameter(unit.path) if reread and not unit.buffer else unit.param).data
    if unit.lora is None:
        return weight
    for adapter in unit.lora.active_adapters:
        if adapter in unit.lora.lora_A:
            weight = weight + unit.lora.get_delta_weight(adapter).to(weight.dtype)
    return weight


def _bucketize(units: list[_Unit], bucket_bytes: int) -> list[list[_Unit]]:
    """Pack consecutive decoder layers into buckets of at most `bucket_bytes` (or one layer, if larger).

    A layer is never split: vLLM re-processes a layer once all its (possibly fused: qkv, gate_up) weights
    have arrived in one call, so they must travel together.
    """
    layers: list[list[_Unit]] = []
    for unit in units:
        if layers and _layer_key(unit.names[0]) == _layer_key(layers[-1][0].names[0]):
            layers[-1].append(unit)
        else:
            layers.append([unit])
    buckets: list[list[_Unit]] = []
    size = 0
    for layer in layers:
        layer_bytes = sum(u.nbytes for u in layer)
        if not buckets or size + layer_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(layer)
        size += layer_bytes
    return buckets


def _layer_key(name: str) -> str:
    """`model.layers.3` for anything inside decoder layer 3; the module path otherwise."""
    match = _LAYER_INDEX.search(name)
    return name[: match.end()] if match else name.rsplit(".", 1)[0]


@contextlib.contextmanager
def _gathered(units: list[_Unit], fsdp_groups: list[nn.Module]) -> Iterator[None]:
    """Make the units' whole parameters available for the duration of the block, one collective per group.

    ZeRO-3: one coalesced all-gather of the bucket's partitioned parameters. FSDP2: each shard group (a
    decoder layer, or the root's embeddings / norm / head) owning them is unsharded with one all-gather,
    then resharded.
    """
    params = [p for u in units for p in u.gather]
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
        return
    for group in fsdp_groups:
        group.unshard()
    try:
        yield
    finally:
        for group in fsdp_groups:
            group.reshard()


def _fsdp_groups(model: nn.Module, units: list[_Unit]) -> list[nn.Module]:
    """The distinct FSDP2 shard groups holding the units' parameters; empty for a model without FSDP2."""
    owners = (_fsdp_owner(model, u.path) for u in units)
    return list({id(m): m for m in owners if m is not None}.values())


def _fsdp_owner(model: nn.Module, path: str) -> nn.Module | None:
    """The FSDP2 module whose shard group holds the parameter at `path`: its nearest `fully_shard`-ed parent."""
    from torch.distributed.fsdp import FSDPModule

    parts = path.split(".")[:-1]
    for end in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if isinstance(module, FSDPModule):
            return module
    return None


class _QuietPartialReload(logging.Filter):
    """vLLM warns for every layer a reload call leaves out; a bucketed sync leaves layers out on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "Failed to load weights" not in message and "Following weights were not loaded" not in message


# Where each vLLM release colograd runs on warns about a partial reload: 0.32's layerwise reload, 0.32 / 0.33's
# in-place one, 0.26's model runner.
for _logger in ("reload.layerwise", "reload.inplace"):
    logging.getLogger(f"vllm.model_executor.model_loader.{_logger}").addFilter(_QuietPartialReload())
logging.getLogger("vllm.v1.worker.gpu_model_runner").addFilter(_QuietPartialReload())
