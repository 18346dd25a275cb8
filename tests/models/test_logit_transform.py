"""What a model does to its logits after its output layer (`colograd.models.logit_transform`): learnt from the model,
applied
to each chunk of log-probs, so that the trainer's log-probs are those of the model's own distribution. Checked against
each model's plain forward, with sharp weights (a flat random model hides a missing transform), and shown to fail
when the transform is dropped."""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from colograd.errors import ConfigError
from colograd.forward import attention
from colograd.forward.logps import completion_logps
from colograd.models import logit_transform

VOCAB, PROMPT, COMPLETION = 256, 5, 7
# Granite's, Command-R's and Gemma-2's published values (their 2b / 35b / 2b configs).
FAMILIES = {
    "granite": {"logits_scaling": 8.0},
    "cohere": {"logit_scale": 0.0625},
    "gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 64},
    "llama": {},
}


def sharp(model_type: str, **extra) -> nn.Module:
    """A tiny model of `model_type` with weights drawn at std 0.5 and its norms perturbed: logits far from flat."""
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                  **FAMILIES.get(model_type, {}) | extra)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    return model


def batch(n: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, PROMPT + COMPLETION), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(PROMPT + COMPLETION).expand(n, -1).clone()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions,
            "completion_ids": ids[:, PROMPT:]}  # fmt: skip


def eager(model: nn.Module) -> nn.Module:
    """A copy of `model` on transformers' reference attention, which applies every option (soft caps included)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return reference


def plain(model: nn.Module, b: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs and entropies of the model's own forward (on its eager copy): its whole logits, as it returns
    them."""
    logits = eager(model)(input_ids=b["input_ids"]).logits[:, PROMPT - 1 : -1].float() / temperature
    logps = torch.log_softmax(logits, -1)
    return logps.gather(-1, b["completion_ids"][..., None])[..., 0], -(logps.exp() * logps).sum(-1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding_free", [True, False])
def test_log_probs_are_the_models_own(family, padding_free):
    model, b = sharp(family), batch()
    attention.honour_softcaps([model])  # as the trainer does: Gemma-2's attention soft-cap, which SDPA ignores
    ours, entropy = completion_logps(model, b, 0.7, padding_free, chunk_tokens=4, entropy="detached")
    with torch.no_grad():
        expected, expected_entropy = plain(model, b, 0.7)
    # SDPA and the eager reference round differently: ~1e-4 at these sharp weights (a dropped transform: > 0.1).
    assert (ours.detach() - expected).abs().max() < 5e-4
    assert (entropy - expected_entropy).abs().max() < 5e-4


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_gradients_are_the_models_own(family):
    model, b = sharp(family), batch()
    attention.honour_softcaps([model])
    completion_logps(model, b, 0.7, chunk_tokens=4).sum().backward()
    ours = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = eager(model)
    logits = reference(input_ids=b["input_ids"]).logits[:, PROMPT - 1 : -1].float() / 0.7
    torch.log_softmax(logits, -1).gather(-1, b["completion_ids"][..., None]).sum().backward()
    for mine, theirs in zip(ours, [p.grad for p in reference.parameters()], strict=True):
        assert (mine is None) == (theirs is None)
        assert mine is None or torch.allclose(mine, theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_without_the_transform_the_log_probs_are_wrong(family, monkeypatch):
    # The check has power: dropping what the model does after its head moves the log-probs by far more than 1e-3.
    model, b = sharp(family), batch()
    attention.honour_softcaps([model])
    monkeypatch.setattr(logit_transform, "of", lambda m: logit_transform.LogitTransform())
    with torch.no_grad():
        gap = (completion_logps(model, b, 0.7) - plain(model, b, 0.7)[0]).abs().max()
    assert gap > 0.1


def test_the_attention_soft_cap_is_applied():
    model, b = sharp("gemma2"), batch()
    with torch.no_grad():
        expected = plain(model, b, 1.0)[0]
        ignored = completion_logps(model, b)  # SDPA as transformers runs it drops the soft cap
        attention.honour_softcaps([model])
        honoured = completion_logps(model, b)
    assert (ignored - expected).abs().max() > 0.01 and (honoured - expected).abs().max() < 5e-4


def test_what_is_learnt_is_read_off_the_forward():
    assert logit_transform.of(sharp("granite")).describe() == "div"
    assert logit_transform.of(sharp("cohere")).describe() == "mul"
    assert logit_transform.of(sharp("gemma2")).describe() == "div then tanh then mul"
    assert not logit_transform.of(sharp("llama"))


class _Forwarding(nn.Module):
    """As DeepSpeed's engine wraps a model: its module's attributes answer through it, its `config` is its own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.config = module, {"train_batch_size": 2}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def test_a_wrapped_model_gives_its_modules_transform():
    # A partitioned reference copy reaches the probe wrapped in DeepSpeed's engine, which answers for the model's
    # `get_output_embeddings` but whose `config` is DeepSpeed's dict.
    assert logit_transform.of(_Forwarding(sharp("granite"))).describe() == "div"


def test_a_transform_across_positions_is_refused_in_one_line():
    model = sharp("llama")
    forward = type(model).forward

    def centred(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits - out.logits.mean(1, keepdim=True)
        return out

    model.forward = centred.__get__(model)
    with pytest.raises(ConfigError) as err:
        logit_transform.logit_transform(model)
    assert "cannot apply a chunk of positions" in str(err.value) and "\n" not in str(err.value)


def test_a_forward_that_transforms_otherwise_than_probed_fails_loudly():
    # Learnt from Granite's forward (divide by logits_scaling); then the forward stops dividing: the log-probs the
    # head computed, divided, would no longer be the model's, and the call says so rather than return them.
    model, b = sharp("granite"), batch()
    logit_transform.of(model)

    def unscaled(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        return type("Out", (), {"logits": self.lm_head(hidden)})()

    model.forward = unscaled.__get__(model)
    with pytest.raises(RuntimeError, match="otherwise than when colograd probed it"):
        completion_logps(model, b)


class _DetachedForBackward(torch.autograd.Function):
    """What DeepSpeed ZeRO-3's forward hook does to every module's output (`PreBackwardFunctionForModule`, to fetch
    the module's partitions again before its backward): the output detached, through an autograd function."""

    @staticmethod
    def forward(ctx, output: torch.Tensor) -> torch.Tensor:
        return output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2"])
def test_the_transform_passes_a_hook_that_replaces_the_heads_output(family):
    # Under ZeRO-3 every module's output is replaced by a detached alias of it on its way out of the module's call;
    # the forward's transform must still find the log-probs the head computed, and leave them as they are. (Falcon-H1
    # and Granite-4.0-H stopped at their first step under ZeRO-3: "forward transformed its logits otherwise".)
    model, b = sharp(family), batch()
    attention.honour_softcaps([model])
    logit_transform.of(model)  # learnt before the hooks are installed, as the trainer learns it before DeepSpeed's
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: _DetachedForBackward.apply(out))
    ours = completion_logps(model, b, 0.7, chunk_tokens=4)
    ours.sum().backward()
    with torch.no_grad():
        expected = plain(model, b, 0.7)[0]
    assert (ours.detach() - expected).abs().max() < 5e-4
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
