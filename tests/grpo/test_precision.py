"""Training precision: bf16 weights without fp32 masters lose small updates; the engine follows mixed precision."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from colograd import GRPOConfig
from colograd.engine.launch import _local_rank
from colograd.engine.settings import engine_dtype_name
from colograd.models import tiny
from colograd.models.precision import master_copy_warning


def adamw_step(weight: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """One AdamW step at lr 1e-6 (the flagship recipe's) on `weight`, after a backward in bf16 if `autocast`.

    Returns:
        The fraction of weights the step left exactly as they were.
    """
    torch.manual_seed(1)
    param = torch.nn.Parameter(weight.clone())
    x = torch.randn(32, weight.shape[1], dtype=weight.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = (x @ param.T).square().mean()
    loss.backward()
    torch.optim.AdamW([param], lr=1e-6).step()
    return (param.detach() == weight).float().mean().item()


def test_bf16_weights_lose_a_1e6_adamw_step_that_fp32_weights_keep():
    """|w| ≈ 0.02 is spaced 2**-13 ≈ 1.2e-4 apart in bf16; Adam's first step is lr-sized (1e-6), ~60× smaller
    than the half spacing, so it rounds back to the same bf16 number; only the few weights within ~5e-4 of zero
    (~2% of them) move. fp32 weights (the recipe's fix: float32 weights with bf16 autocast) take it."""
    torch.manual_seed(0)
    weight = torch.randn(256, 256) * 0.02
    assert adamw_step(weight.bfloat16()) > 0.97
    assert adamw_step(weight) == 0.0
    assert adamw_step(weight, autocast=True) == 0.0


def test_warning_names_bf16_weights_without_masters():
    model = tiny.build_model().bfloat16()
    warning = master_copy_warning(model, keeps_masters=False)
    assert "bfloat16" in warning and "dtype: float32" in warning and "\n" not in warning
    assert master_copy_warning(model, keeps_masters=True) is None  # DeepSpeed / FSDP masters
    assert master_copy_warning(tiny.build_model(), keeps_masters=False) is None  # fp32 weights


def test_no_warning_for_lora_on_a_bf16_base():
    # PEFT keeps the trained adapters in float32 on a bf16 base (grpo_qwen_lora.yaml relies on it).
    model = get_peft_model(tiny.build_model().bfloat16(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    assert master_copy_warning(model, keeps_masters=False) is None


@pytest.mark.parametrize(
    "launch_precision, bf16, expected",
    [("no", False, "float32"), ("bf16", False, "bfloat16"), ("fp16", False, "float16"), ("no", True, "bfloat16")],
)
def test_engine_dtype_follows_the_launch_configs_mixed_precision(
    launch_precision, bf16, expected, monkeypatch, tmp_path
):
    # `accelerate launch` passes the config's mixed_precision as ACCELERATE_MIXED_PRECISION.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launch_precision)
    args = GRPOConfig(output_dir=str(tmp_path), bf16=bf16, report_to="none")
    assert engine_dtype_name(tiny.build_model(), args) == expected


def test_local_rank_counts_within_a_machine(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _local_rank(rank=11, world=16) == 3  # second machine of two 8-process machines
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _local_rank(rank=0, world=1) == 0
