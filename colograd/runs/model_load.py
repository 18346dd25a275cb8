"""A resumed run's model weights, loaded from its checkpoint as `from_pretrained` would load them, every tensor.

transformers' `Trainer` loads a checkpoint's `model.safetensors` with `load_state_dict(strict=False)`, and only
warns about what it did not load. transformers 5 saves a model as the Hub publishes it, reverting the conversions it
applies at load: a Mixture-of-Experts model's fused experts (`experts.gate_up_proj`, one `[experts, 2 × width,
hidden]` tensor) are written one expert at a time (`experts.0.gate_proj.weight`, ...), names the model does not have.
So every resumed MoE run trained on with its experts as the run began (the base model's, or the last sync's before
the resume), the rest of the model resumed: quietly another run. Here a checkpoint whose names are not the model's
own is loaded through `from_pretrained` (its conversions), and any tensor of the model that a checkpoint does not hold
stops the resume in one line, for every family: a name check, not a list of families.
"""

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from colograd.errors import ConfigError


def saved_names(checkpoint: str) -> set[str] | None:
    """The tensor names of a checkpoint's model saved whole in safetensors (one file or an index of shards), or None
    where it holds none (an adapter, DeepSpeed's or FSDP's own files, PyTorch's `.bin`)."""
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def load_model_weights(model: nn.Module, checkpoint: str, names: set[str]) -> None:
    """Copy `checkpoint`'s weights (`names`: `saved_names`) into `model` in place (its parameters stay the objects the
    optimizer holds): read as saved where the names are the model's own, else through `type(model).from_pretrained`,
    which applies the conversions the save reverted (a second copy of the weights in memory, while it loads).

    Raises:
        ConfigError: a tensor of the model is in neither form in the checkpoint.
    """
    own = model.state_dict()
    if set(own) <= names | _tied(own, names):
        state = _read(checkpoint)
    else:
        dtype = next(model.parameters()).dtype
        try:
            loaded, info = type(model).from_pretrained(
                checkpoint, config=model.config, dtype=dtype, output_loading_info=True
            )
        except Exception as err:  # noqa: BLE001 (the conversions raise what their operations raise)
            said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"The checkpoint {checkpoint} does not load as this model ({said}). Resume from a checkpoint this "
                "model saved, or start the run afresh."
            ) from None
        # A tensor from_pretrained did not find, it initialised: left out, so that it is reported missing below.
        state = {name: t for name, t in loaded.state_dict().items() if name not in set(info["missing_keys"])}
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    missing -= _tied(own, set(own) - missing)
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(
            f"The checkpoint {checkpoint} does not hold the model's {shown}: resuming from it would train them from "
            "the values the run began with. Resume from a checkpoint this model saved, or start the run afresh."
        )


def _tied(own: dict[str, torch.Tensor], loaded: set[str]) -> set[str]:
    """The model's names whose tensor is one of the `loaded` names' (tied weights: a checkpoint keeps one of them)."""
    storage = {own[name].data_ptr() for name in loaded if name in own and own[name].numel()}
    return {name for name, tensor in own.items() if tensor.numel() and tensor.data_ptr() in storage}


def _read(checkpoint: str) -> dict[str, torch.Tensor]:
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        return load_file(os.path.join(checkpoint, SAFE_WEIGHTS_NAME), device="cpu")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return {name: tensor for shard in shards for name, tensor in load_file(os.path.join(checkpoint, shard)).items()}
