"""The reference policy: a frozen copy, or (with LoRA) the same model with its adapters disabled."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

from colograd import GRPOConfig, GRPOTrainer, tiny
from colograd.batch import pad_rollout
from colograd.config import ConfigError
from colograd.engine import Rollout, free_port
from colograd.loss import policy_loss
from colograd.reference import ReferencePolicy

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_frozen_copy_keeps_the_initial_weights():
    model = tiny.build_model()
    initial = logits(model)
    reference = ReferencePolicy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)  # as an optimizer step would
    with reference.model(model) as ref:
        assert ref is not model and not any(p.requires_grad for p in ref.parameters())
        assert torch.equal(logits(ref), initial)
    assert not torch.allclose(logits(model), initial)


def test_lora_reference_is_the_base_model_without_a_copy():
    base = tiny.build_model()
    base_logits = logits(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    reference = ReferencePolicy(model)
    assert reference.frozen is None  # nothing copied
    assert not torch.allclose(logits(model), base_logits)  # the adapters change the policy...
    with reference.model(model) as ref:
        assert torch.allclose(logits(ref), base_logits, atol=1e-6)  # ...and are off for the reference
    assert not torch.allclose(logits(model), base_logits)  # back on afterwards


def test_trainer_reference_stage_with_lora_gives_base_logps_and_a_kl_gradient_on_adapters_only(tmp_path):
    # The trainer's own `rollout_logps` and `completion_logps` stages on a stand-in `self` (no engine needed),
    # then the loss with the KL term. tests/test_grpo_family.py runs the same path end to end.
    policy = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, beta=0.1,
                      report_to="none")  # fmt: skip
    stand_in = SimpleNamespace(
        args=args,
        model=policy,
        reference=ReferencePolicy(policy),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        compute_loss_context_manager=contextlib.nullcontext,
    )
    stand_in.completion_logps = lambda model, inputs: GRPOTrainer.completion_logps(stand_in, model, inputs)
    rollout = Rollout(completion_ids=[[7, 8], [9], [10, 11], [12, 1]], logps=[[0.0] * 2, [0.0], [0.0] * 2, [0.0] * 2],
                      truncated=[False] * 4)  # fmt: skip
    batch = pad_rollout([[5, 6, 5], [6]], rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), 2, pad_token_id=0)

    ref_logps = GRPOTrainer.rollout_logps(stand_in, batch)["ref_logps"]
    assert torch.allclose(ref_logps, stand_in.completion_logps(tiny.build_model(), batch), atol=1e-6)

    logps = stand_in.completion_logps(policy, batch)
    mask = batch["completion_mask"]
    out = policy_loss(logps, logps.detach(), batch["advantages"], mask, loss_type="bnpo", ref_logps_NT=ref_logps,
                      beta=args.beta)  # fmt: skip
    assert (out.kl_NT * mask).sum() > 0  # the adapters moved the policy away from the reference
    out.loss.backward()
    grads = {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in name for name in grads)


def test_fsdp_ram_efficient_loading_with_a_copied_reference_is_refused(monkeypatch):
    """Under FSDP with fsdp_cpu_ram_efficient_loading, transformers fills the weights of every process but each
    machine's first with zeros until accelerate broadcasts them, after the reference copy is taken: refused.
    A LoRA reference (the base with adapters off) copies nothing and is read after the broadcast: allowed."""
    # What `accelerate launch` exports for such a config; transformers reads it only inside a process group.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="fsdp_cpu_ram_efficient_loading: false"):
            ReferencePolicy(tiny.build_model())
        lora = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"]))
        assert ReferencePolicy(lora).frozen is None
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
        assert ReferencePolicy(tiny.build_model()).frozen is not None
    finally:
        dist.destroy_process_group()
