"""The reference policy the KL penalty (`beta` > 0) holds the trained model near.

With a LoRA (PEFT) model the reference is the same model with its adapters switched off, so nothing is copied.
Otherwise it is a frozen copy of the initial model, made before the trainer wraps or shards it: every rank
holds a full copy and computes its reference log-probs in-rank, with nothing gathered.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from peft import PeftModel
from torch import nn


class ReferencePolicy:
    """The model the KL is measured against.

    Args:
        model: the policy as it starts training (unwrapped).
    """

    def __init__(self, model: nn.Module) -> None:
        self.frozen: nn.Module | None = None
        if not isinstance(model, PeftModel):
            self.frozen = copy.deepcopy(model).eval().requires_grad_(False)

    def to(self, device) -> "ReferencePolicy":
        if self.frozen is not None:
            self.frozen.to(device)
        return self

    @contextmanager
    def model(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The module whose forward gives reference log-probs, given the current (unwrapped) policy."""
        if self.frozen is not None:
            yield self.frozen
            return
        with policy.disable_adapter():
            yield policy
