"""The reference policy: a frozen copy, or (with LoRA) the same model with its adapters disabled."""

import torch
from peft import LoraConfig, get_peft_model

from colograd import tiny
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
