"""A resumed run's model weights, loaded from its checkpoint as `from_pretrained` would load them, every tensor.

transformers' `Trainer` loads a checkpoint's `model.safetensors` with `load_state_dict(strict=False)`, and only
warns about what it did not load. transformers 5 saves a model as the Hub publishes it, reverting the conversions it
applies at load: a Mixture-of-Experts model's fused experts (`experts.gate_up_proj`, one `[experts, 2 × width,
hidden]` tensor) are written one expert at a time (`experts.0.gate_proj.weight`, ...), names the model does not have.
So every resumed MoE run trained on with its experts as the run began, the rest of the model resumed: quietly another
run; and a vision-language model saved under the Hub's names (Qwen2-VL's and Qwen2.5-VL's `model.embed_tokens`,
`visual.*`, held as `model.language_model.*`, `model.visual.*`) resumed its `lm_head` alone. Here a checkpoint whose
names are not the model's own is loaded through `from_pretrained` (its conversions), and any tensor of the model that
a checkpoint does not hold stops the resume in one line, for every family: a name check, not a list of families.
"""

import json
import logging
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from colograd.errors import ConfigError

logger = logging.getLogger("colograd.trainer")


def saved_names(checkpoint: str) -> set[str] | None:
    """The tensor names of a checkpoint's model saved whole in safetensors (one file or an index of shards), or None
    where it holds none (an adapter, DeepSpeed's or FSDP's own files, PyTorch's `.bin`)."""
    shards = _shards(checkpoint)
    if shards is None:
        return None
    if isinstance(shards, dict):
        return set(shards)
    with safe_open(shards, framework="pt") as f:
        return set(f.keys())


def load_model_weights(model: nn.Module, checkpoint: str, names: set[str]) -> None:
    """Copy `checkpoint`'s weights (`names`: `saved_names`) into `model` in place (its parameters stay the objects the
    optimizer holds): read as saved where the names are the model's own, else through `type(model).from_pretrained`,
    which applies the conversions the save reverted (a second copy of the weights in memory, while it loads).

    Raises:
        ConfigError: a tensor of the model is in neither form in the checkpoint.
    """
    own = model.state_dict()
    optional = _optional(model, own)
    if set(own) <= names | _tied(own, names) | optional and not _converts_values(model):
        loaded: set[str] = set()
        for shard in _shard_files(checkpoint):  # one shard in memory at a time, as transformers loads them
            state = load_file(shard, device="cpu")
            model.load_state_dict(state, strict=False)
            loaded |= state.keys() & own.keys()
            del state
    else:
        dtype = next(model.parameters()).dtype
        try:
            converted, info = type(model).from_pretrained(
                checkpoint, config=model.config, dtype=dtype, output_loading_info=True
            )
        except Exception as err:  # noqa: BLE001 (the conversions raise what their operations raise)
            said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"The checkpoint {checkpoint} does not load as this model ({said}). Resume from a checkpoint this "
                "model saved, or start the run afresh."
            ) from None
        # What from_pretrained did not find it initialised: never copied over the run's own values.
        absent = set(info["missing_keys"]) | optional
        state = {name: t for name, t in converted.state_dict().items() if name not in absent}
        model.load_state_dict(state, strict=False)
        loaded = state.keys() & own.keys()
        del converted, state
        _say_where_saving_again_differs(model, checkpoint)
    missing = set(own) - loaded - optional
    missing -= _tied(own, loaded)
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(
            f"The checkpoint {checkpoint} does not hold the model's {shown}: resuming from it would train them from "
            "the values the run began with. Resume from a checkpoint this model saved, or start the run afresh."
        )


def saved_again_differs(model: nn.Module, checkpoint: str) -> dict[str, float]:
    """The checkpoint's tensors that `model`, saved now, would write otherwise, each with its largest difference:
    the model's state reverted as `save_pretrained` reverts it (`revert_weight_conversion`), compared with what the
    checkpoint holds under the same name, a shard at a time. Empty where a converted load gave back the checkpoint's
    values exactly, as every conversion that only moves values (experts merged, projections fused or split) does."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, dict(model.state_dict()))
    differs = {}
    for shard in _shard_files(checkpoint):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                ours = reverted.get(name)
                if ours is None:
                    continue
                theirs = f.get_tensor(name).to(ours.dtype)
                if ours.shape != theirs.shape:
                    differs[name] = float("inf")
                elif not torch.equal(ours, theirs):
                    differs[name] = (ours.double() - theirs.double()).abs().max().item()
    return differs


def _say_where_saving_again_differs(model: nn.Module, checkpoint: str) -> None:
    """Warn, naming the tensors, where a converted load did not give back the checkpoint's values exactly (a
    conversion of this family that is not undone exactly by the save): the run resumes, from weights that far from
    the ones it saved, and so is not the uninterrupted run to the bit."""
    differs = saved_again_differs(model, checkpoint)
    if differs:
        worst = sorted(differs, key=differs.get, reverse=True)
        shown = ", ".join(f"{name} ({differs[name]:.3g})" for name in worst[:3])
        more = f" and {len(worst) - 3} more" if len(worst) > 3 else ""
        logger.warning(
            "colograd: the weights loaded from %s through transformers' conversions for %s do not save back to the "
            "same values: %s%s differ (largest difference in brackets). The run resumes from these weights, not bit "
            "for bit the ones it saved.",
            checkpoint, type(model).__name__, shown, more,
        )  # fmt: skip


def _optional(model: nn.Module, own: dict[str, torch.Tensor]) -> set[str]:
    """The model's names its class says a checkpoint may lack (`_keys_to_ignore_on_load_missing`, patterns): kept as
    the run holds them, neither required nor overwritten."""
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    return {name for name in own if any(re.search(pattern, name) for pattern in patterns)}


def _tied(own: dict[str, torch.Tensor], loaded: set[str]) -> set[str]:
    """The model's names whose tensor is one of the `loaded` names' (tied weights: a checkpoint keeps one of them)."""
    storage = {own[name].data_ptr() for name in loaded if name in own and own[name].numel()}
    return {name for name, tensor in own.items() if tensor.numel() and tensor.data_ptr() in storage}


def _shards(checkpoint: str) -> dict[str, str] | str | None:
    """Where a checkpoint's model is in safetensors: its index's map of each tensor to its shard's path, the one file's
    path, or None."""
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(checkpoint, shard) for name, shard in json.load(f)["weight_map"].items()}
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    return single if os.path.isfile(single) else None


def _shard_files(checkpoint: str) -> list[str]:
    """The files of a checkpoint's model saved whole in safetensors, each once, to read a shard at a time."""
    shards = _shards(checkpoint)
    return sorted(set(shards.values())) if isinstance(shards, dict) else [shards]


def _converts_values(model: nn.Module) -> bool:
    """Whether transformers transforms some of the model's tensors between its checkpoint and the model (a
    `WeightConverter`: experts merged, a projection chunked, transposed or permuted), which a name may survive: such a
    checkpoint is read through `from_pretrained` whatever its names. A renaming alone shows in the names. The same
    conversions transformers' save reverts (`revert_weight_conversion`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    return any(isinstance(conversion, WeightConverter) for conversion in conversions or [])
