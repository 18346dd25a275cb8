"""Weight sync: the trainer's updated weights go into the colocated engine, in place, in one call.

The engine lives in this process, so a sync is a memory pass: the weights are handed over by reference in
checkpoint naming and the engine copies (and, on CPU, repacks) them. Never one engine call per tensor.
"""

import torch
from torch import nn

from colograd.engine import Engine


def engine_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as (checkpoint name, tensor) pairs, tied aliases included.

    `state_dict()` rather than `named_parameters()`: the latter lists a tied tensor once (as the input
    embedding), and vLLM's CPU backend keeps its own processed copy of the output projection that is only
    refreshed when `lm_head.weight` arrives too. Without it the engine samples from a stale head.
    """
    return list(model.state_dict().items())


def sync_weights(model: nn.Module, engine: Engine) -> int:
    """Load `model`'s current weights (an unwrapped model, not a DDP wrapper) into `engine`.

    Returns:
        The number of bytes handed over.
    """
    weights = engine_weights(model)
    engine.load_weights(weights)
    return sum(t.numel() * t.element_size() for _, t in weights)
