"""How accelerate prepares the policy on a CPU: two of its defaults there cost a run memory and time and buy nothing.

- Under a launcher the CPU device is indexed (`cpu:0`), and torch's `Module.to("cpu:0")` copies every parameter of a
  model already in memory: for a moment two models, and the process keeps the pages after. The model computes where
  it is, so it is not moved.
- A launch of one process (`torchrun --nproc_per_node 1`, `accelerate launch --num_processes 1`) sets the launcher's
  variables, from which accelerate takes a multi-process CPU run and wraps the model in DistributedDataParallel
  whatever the number of processes (it checks that number on a GPU only, accelerate 1.x `prepare_model`). A world of
  one has nothing to reduce, yet DDP keeps a second copy of every gradient in its buckets (the model's size in
  float32), copies each gradient there and back in every backward, and with `find_unused_parameters` (the Trainer's
  default) walks the autograd graph once more. colograd prepares such a model as a GPU run of one process is
  prepared: without the wrapper. Two processes or more are wrapped as before.
"""

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn


def prepare_on_cpu(accelerator: Accelerator, device: torch.device) -> None:
    """Set `accelerator` (the Trainer's, before it prepares the model) to leave a CPU run's model in place, and
    unwrapped in a world of one. Nothing on another device."""
    if device.type != "cpu":
        return
    accelerator.device_placement = False
    if accelerator.distributed_type != DistributedType.MULTI_CPU or accelerator.num_processes != 1:
        return
    prepare_model = accelerator.prepare_model

    def prepare_model_alone(model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        # In a multi-process CPU run, accelerate's evaluation mode differs only in leaving out the DDP wrapper:
        # mixed precision (autocast), placement and torch.compile are applied the same.
        return prepare_model(model, device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_model_alone
