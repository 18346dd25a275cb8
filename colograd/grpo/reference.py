"""The reference policy the KL penalty (`beta` > 0) holds the trained model near.

With a LoRA (PEFT) model the reference is the same model with its adapters switched off, so nothing is copied.
Otherwise it is a frozen copy of the initial model, made before the trainer wraps or shards it. Under
DeepSpeed ZeRO-3 the copy is partitioned like the policy (each rank holds a shard; its forward gathers layers
as the policy's does); otherwise every rank holds it whole and nothing is gathered. A copy cannot be taken
under FSDP's `fsdp_cpu_ram_efficient_loading`, where only one process per machine has read the weights yet.

With `sync_ref_model` (TR-DPO, TRL's `SyncRefModelCallback`), the copy moves toward the policy every
`ref_model_sync_steps` optimizer steps: reference ← α × policy + (1 - α) × reference.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from peft import PeftModel
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from transformers.integrations import is_fsdp_enabled

from colograd.config.core import ConfigError, GRPOConfig


def mix_into(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """reference ← alpha × policy + (1 - alpha) × reference, parameter by parameter (TRL's update).

    Args:
        reference: the frozen copy, partitioned under ZeRO-3 like the policy, else whole.
        policy: the unwrapped policy; under FSDP2 its parameters are shards (DTensors), gathered one at a time.
    """
    if not any(isinstance(p, DTensor) for p in policy.parameters()):
        # Imported here: trl.trainer.callbacks imports wandb, a second of every launch's start-up.
        from trl.trainer.callbacks import SyncRefModelCallback

        SyncRefModelCallback.sync_target_model(policy, reference, alpha)  # gathers both under ZeRO-3
        return
    with torch.no_grad():
        for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            ref_param.mul_(1.0 - alpha).add_(whole.to(ref_param.dtype), alpha=alpha)


class ReferencePolicy(TrainerCallback):
    """The model the KL is measured against; as a callback, it applies `sync_ref_model`'s updates.

    Args:
        model: the policy as it starts training (unwrapped).
        args: the run's `GRPOConfig` (`sync_ref_model` and its schedule).
    """

    def __init__(self, model: nn.Module, args: GRPOConfig) -> None:
        self.frozen: nn.Module | None = None
        self.args = args
        self.accelerator: Accelerator | None = None
        if isinstance(model, PeftModel):
            if args.sync_ref_model:
                raise ConfigError(
                    "sync_ref_model with a LoRA model: its reference is the model with the adapters switched off, "
                    "so there is no copy to update (TRL refuses it too); set sync_ref_model: false, or train the "
                    "full model."
                )
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
        self.accelerator = accelerator
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
            # The copy was made before accelerate wrapped the policy's forward in autocast: it computes as the
            # policy does only inside the same autocast (TRL prepares its reference model for that).
            with self.accelerator.autocast() if self.accelerator is not None else nullcontext():
                yield self.frozen
            return
        with policy.disable_adapter():
            yield policy

    def on_step_end(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        """With `sync_ref_model`, every `ref_model_sync_steps` optimizer steps, mix the policy into the copy."""
        if self.args.sync_ref_model and state.global_step % self.args.ref_model_sync_steps == 0:
            mix_into(self.frozen, self.accelerator.unwrap_model(model), self.args.ref_model_mixup_alpha)
