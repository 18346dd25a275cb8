"""vLLM's layerwise reload (the sync's path into a CPU engine with repacked weights) reads each tensor's weight loader
by `__name__`: a loader bound with `functools.partial` (MiniMax-M2's sharded RMSNorm) failed the first sync. Held
against vLLM's own wrapping function."""

from functools import partial

import pytest
import torch
from torch import nn
from vllm.model_executor.model_loader.reload import layerwise

from colograd.engine.weights import name_loaders


class ShardedNorm(nn.Module):
    """A layer whose weight's loader is a partial, as vLLM's MiniMaxText01RMSNormTP binds its shard."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.weight.weight_loader = partial(self.load, shard=0)

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        param.data.copy_(loaded)


def reload_begins(model: nn.Module) -> None:
    """The first half of vLLM's layerwise reload, as `reload_weights` runs it: record, then wrap every loader."""
    layerwise.record_metadata_for_reloading(model)
    layerwise.initialize_layerwise_reload(model)


def test_a_partial_loader_is_named_so_vllms_reload_can_wrap_it():
    with pytest.raises(AttributeError, match="'functools.partial' object has no attribute '__name__'"):
        reload_begins(nn.Sequential(ShardedNorm()))  # what the first sync met
    model = nn.Sequential(ShardedNorm())
    name_loaders(model)
    assert model[0].weight.weight_loader.__name__ == "load"
    reload_begins(model)
    assert model[0].weight.weight_loader.__name__ == "online_process_loader"
    assert layerwise._get_original_loader(model[0].weight).func == model[0].load  # unwrapped to the model's own
