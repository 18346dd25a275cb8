"""Architectures the engine and the trainer must see alike.

vLLM's Transformers backend (the architectures vLLM has no model of its own for: OLMo-2, Phi-2, GPT-NeoX ...)
decorates the transformers decoder class for compilation, in place, for the whole process; `own_classes` keeps the
trainer's models out of it. Checked here with vLLM's own decorator on a class of the test's own, so that no other
test's class is touched; the zoo (tests/zoo/test_zoo.py) trains OLMo-2 and Phi-2 through the real backend."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaModel

from colograd.engine.lifetime import own_classes


def decorated_model() -> tuple[LlamaForCausalLM, type]:
    """A tiny Llama whose decoder is of a fresh subclass (for the test to decorate as vLLM's backend does)."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    fresh = type("LlamaModel", (LlamaModel,), {"__module__": LlamaModel.__module__})
    model.model.__class__ = fresh
    return model, fresh


def test_a_class_vllm_decorates_keeps_calling_the_trainers_model_as_torch_does():
    from vllm.compilation.decorators import support_torch_compile

    model, fresh = decorated_model()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        before = model(ids).logits
    support_torch_compile(dynamic_arg_dims={"input_ids": 1})(fresh)  # what vLLM's backend does to the class
    with pytest.raises(AttributeError, match="do_not_compile"):  # the crash at the first training step
        model(ids)
    seen = []
    model.model.register_forward_hook(lambda module, args, out: seen.append(module))  # accelerate's, DeepSpeed's
    own_classes([model, None])
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after) and seen == [model.model]
    assert isinstance(model.model, fresh) and type(model.model).__name__ == "LlamaModel"
    other, _ = decorated_model()  # a class vLLM did not decorate is left as it is
    own_classes([other])
    assert type(other.model) is not type(model.model) and "__call__" not in vars(type(other.model))
