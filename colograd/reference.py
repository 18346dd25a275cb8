"""The reference policy the KL penalty (`beta` > 0) holds the trained model near.

With a LoRA (PEFT) model the reference is the same model with its adapters switched off, so nothing is copied.
Otherwise it is a frozen copy of the initial model, made before the trainer wraps or shards it. Under
DeepSpeed ZeRO-3 the copy is partitioned like the policy (each rank holds a shard; its forward gathers layers
as the policy's does); otherwise every rank holds it whole and nothing is gathered. A copy cannot be taken
under FSDP's `fsdp_cpu_ram_efficient_loading`, where only one process per machine has read the weights yet.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager

from accelerate import Accelerator
from peft import PeftModel
from torch import nn
from transformers.integrations import is_fsdp_enabled

from colograd.config import ConfigError


class ReferencePolicy:
    """The model the KL is measured against.

    Args:
        model: the policy as it starts training (unwrapped).
    """

    def __init__(self, model: nn.Module) -> None:
        self.frozen: nn.Module | None = None
        if isinstance(model, PeftModel):
            return
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError(
                "beta > 0: the model was loaded already partitioned by ZeRO-3 (zero3_init_flag), so it cannot be "
                "copied as the reference; set zero3_init_flag: false in the accelerate config."
            )
        if is_fsdp_enabled():
            # transformers then reads the weights on each machine's first process only and fills the others
            # with zeros until accelerate broadcasts them, long after this copy: it would be a zero model.
            raise ConfigError(
                "beta > 0: under FSDP with fsdp_cpu_ram_efficient_loading only one process per machine reads the "
                "weights, so the reference copy would be zeros elsewhere; set fsdp_cpu_ram_efficient_loading: false "
                "in the accelerate config, train LoRA (use_peft), or set beta: 0."
            )
        self.frozen = copy.deepcopy(model).eval().requires_grad_(False)

    def prepare(self, accelerator: Accelerator) -> None:
        """Place the copy: partitioned by DeepSpeed under ZeRO-3, else whole on this rank's device."""
        if self.frozen is None:
            return
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            from trl.models.utils import prepare_deepspeed

            self.frozen = prepare_deepspeed(self.frozen, accelerator)
        else:
            self.frozen.to(accelerator.device)

    @contextmanager
    def model(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The module whose forward gives reference log-probs, given the current (unwrapped) policy."""
        if self.frozen is not None:
            yield self.frozen
            return
        with policy.disable_adapter():
            yield policy
