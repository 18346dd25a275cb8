"""Whether training would step bf16/fp16 weights with no fp32 master copy, where small updates round away.

A bf16 number near 0.02 is 2**-13 ≈ 1.2e-4 from its neighbours. AdamW's early steps move each weight by about
the learning rate, so at lr 1e-6 an update is ~60× smaller than half that spacing and rounds back to the same
weight: training barely moves. Mixed precision avoids it by keeping fp32 weights and computing in bf16
(`bf16: true` with weights loaded in float32), or by keeping fp32 masters of bf16 weights (DeepSpeed and FSDP2
under `mixed_precision: bf16`). Plain DDP or a single process on bf16 weights keeps nothing.
"""

import torch
from torch import nn

_LOW = (torch.bfloat16, torch.float16)


def master_copy_warning(model: nn.Module, keeps_masters: bool) -> str | None:
    """The start-up warning for trainable bf16/fp16 parameters that nothing keeps an fp32 copy of.

    Args:
        model: the model about to be trained (unwrapped; a PEFT model's frozen base is not counted).
        keeps_masters: whether the optimizer steps fp32 masters (DeepSpeed or FSDP with mixed precision).

    Returns:
        One line naming the problem and the fix, or None when the updates are kept.
    """
    low = [p for p in model.parameters() if p.requires_grad and p.dtype in _LOW]
    if not low or keeps_masters:
        return None
    dtype = str(low[0].dtype).removeprefix("torch.")
    return (
        f"{len(low)} trainable parameter tensors are {dtype} and no fp32 master copy is kept, so updates smaller "
        f"than half a {dtype} step round away (at learning rate 1e-6 most weights never change); load the model "
        "in float32 (dtype: float32) and train with bf16: true, or use DeepSpeed / FSDP with mixed_precision: bf16."
    )
