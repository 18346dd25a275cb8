"""The reference policy: a frozen copy, or (with LoRA) the same model with its adapters disabled."""

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from trl.trainer import callbacks as trl_callbacks
from trl.trainer.callbacks import SyncRefModelCallback

from colograd import GRPOConfig, GRPOTrainer
from colograd.config.core import ConfigError
from colograd.engine.launch import free_port
from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout
from colograd.forward.core import Forward
from colograd.forward.packing import prompt_sharing_cost
from colograd.grpo.loss import policy_loss
from colograd.grpo.reference import ReferencePolicy
from colograd.models import tiny

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
NO_SYNC = SimpleNamespace(sync_ref_model=False)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_frozen_copy_keeps_the_initial_weights():
    model = tiny.build_model()
    initial = logits(model)
    reference = ReferencePolicy(model, NO_SYNC)
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
    reference = ReferencePolicy(model, NO_SYNC)
    assert reference.frozen is None  # nothing copied
    assert not torch.allclose(logits(model), base_logits)  # the adapters change the policy...
    with reference.model(model) as ref:
        assert torch.allclose(logits(ref), base_logits, atol=1e-6)  # ...and are off for the reference
    assert not torch.allclose(logits(model), base_logits)  # back on afterwards


def test_trainer_reference_stage_with_lora_gives_base_logps_and_a_kl_gradient_on_adapters_only(tmp_path):
    # The trainer's own `rollout_logps` and `completion_logps` stages on a stand-in `self` (no engine needed),
    # then the loss with the KL term. tests/launch/test_grpo_family.py runs the same path end to end.
    policy = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, beta=0.1,
                      report_to="none")  # fmt: skip
    stand_in = SimpleNamespace(
        args=args,
        model=policy,
        reference=ReferencePolicy(policy, NO_SYNC),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        compute_loss_context_manager=contextlib.nullcontext,
        # Packed under a mask, as on a CPU; each prompt's 2 completions share it, as in the trainer.
        forward=Forward(args, prompt_cost=prompt_sharing_cost(policy)),
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
    # An in-process engine built by an earlier test in this process may have left its (one-process) group.
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="fsdp_cpu_ram_efficient_loading: false"):
            ReferencePolicy(tiny.build_model(), NO_SYNC)
        lora = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"]))
        assert ReferencePolicy(lora, NO_SYNC).frozen is None
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
        assert ReferencePolicy(tiny.build_model(), NO_SYNC).frozen is not None
    finally:
        if own_group:
            dist.destroy_process_group()


def test_sync_ref_model_mixes_the_policy_in_as_trls_callback_on_its_schedule(monkeypatch):
    # Outside a launch there is no accelerate state to ask about ZeRO-3: there is none.
    monkeypatch.setattr(trl_callbacks, "AcceleratorState", lambda: SimpleNamespace(deepspeed_plugin=None))
    policy = tiny.build_model(seed=1)
    args = SimpleNamespace(sync_ref_model=True, ref_model_mixup_alpha=0.6, ref_model_sync_steps=3)
    reference = ReferencePolicy(policy, args)
    reference.prepare(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), device=torch.device("cpu"),
                                      unwrap_model=lambda m: m))  # fmt: skip
    trl_reference = copy.deepcopy(reference.frozen)
    trl_callback = SyncRefModelCallback(ref_model=trl_reference, accelerator=None)
    initial = [p.clone() for p in reference.frozen.parameters()]
    updated_at = []
    for step in range(1, 8):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * step)  # as an optimizer step would
        before = [p.clone() for p in reference.frozen.parameters()]
        state = SimpleNamespace(global_step=step)
        reference.on_step_end(None, state, None, model=policy)
        trl_callback.on_step_end(args, state, None, model=policy)
        for ours, theirs in zip(reference.frozen.parameters(), trl_reference.parameters(), strict=True):
            assert torch.equal(ours, theirs)
        if any(not torch.equal(a, b) for a, b in zip(before, reference.frozen.parameters(), strict=True)):
            updated_at.append(step)
        if step == 3:  # by hand: 0.6 × the policy + 0.4 × the initial weights
            mixed = [0.6 * p + 0.4 * p0 for p, p0 in zip(policy.parameters(), initial, strict=True)]
            assert all(
                torch.allclose(m, r, atol=1e-6) for m, r in zip(mixed, reference.frozen.parameters(), strict=True)
            )
    assert updated_at == [3, 6]


def test_sync_ref_model_is_refused_with_lora_and_without_a_kl_term(tmp_path):
    lora = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="sync_ref_model with a LoRA model"):
        ReferencePolicy(lora, SimpleNamespace(sync_ref_model=True))
    with pytest.raises(ConfigError, match="sync_ref_model with beta=0"):
        GRPOConfig(output_dir=str(tmp_path), sync_ref_model=True, beta=0.0)


def test_the_frozen_copy_computes_under_the_accelerators_autocast():
    """accelerate wraps the policy's forward in autocast; the copy, made before, computes as the policy does only
    inside the same autocast (else a bf16 run compares bf16 log-probs with float32 ones, and a GPU's flash
    kernel refuses the copy's float32 attention)."""
    seen = []
    reference = ReferencePolicy(tiny.build_model(), NO_SYNC)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=None),
        device=torch.device("cpu"),
        autocast=lambda: torch.autocast("cpu", torch.bfloat16),
    )
    reference.prepare(accelerator)
    with reference.model(policy=None) as model:
        seen.append(torch.is_autocast_enabled("cpu"))
        assert model is reference.frozen
    assert seen == [True] and not torch.is_autocast_enabled("cpu")
