"""The CPU backend's settings colograd makes before an engine starts (colograd/engine/cpu.py)."""

import pytest
import torch
from torch._dynamo.utils import counters

from colograd.engine import cpu as engine_cpu


def test_the_sampler_counts_ranks_eagerly_with_vllms_own_expression():
    """vLLM's sampler gets an uncompiled rank count; on ties and on every row it counts what vLLM's function
    (the expression under its `torch.compile`) counts, so a change of vLLM's expression would show here."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    before, compiled = sampler.batched_count_greater_than, logprobs.batched_count_greater_than
    sampler.batched_count_greater_than = compiled  # as vLLM binds it, whatever an engine of this process did
    try:
        assert engine_cpu.count_ranks_eagerly()
        eager = sampler.batched_count_greater_than
        assert eager is not compiled and not hasattr(eager, "_torchdynamo_orig_callable")
        assert engine_cpu.count_ranks_eagerly() and sampler.batched_count_greater_than is eager  # once is enough
        x = torch.tensor([[0.1, 0.5, 0.5, -1.0], [2.0, 2.0, 2.0, 2.0], [-3.0, -1.0, -2.0, -4.0]])
        values = x[:, 1:2]
        expected = logprobs.batched_count_greater_than._torchdynamo_orig_callable(x, values)
        assert eager(x, values).tolist() == expected.tolist() == [2, 4, 1]
        logits = torch.randn(64, 151936).log_softmax(-1)  # a rollout's rows over a Qwen vocabulary
        sampled = logits.gather(-1, torch.randint(0, 151936, (64, 1)))
        frames = dict(counters["frames"])
        ranks = eager(logits, sampled)
        assert dict(counters["frames"]) == frames  # nothing was handed to torch.compile
        assert torch.equal(ranks, logprobs.batched_count_greater_than._torchdynamo_orig_callable(logits, sampled))
    finally:
        sampler.batched_count_greater_than = before


def test_a_latent_attention_engine_gets_the_reference_cpu_backend():
    """vLLM's AMX kernels for latent attention refuse fp32 weights at start-up (tests/models/test_moe.py's deepseek_v2
    on a CPU with AMX tiles) and, in bf16, empty a weight the sync's reload writes back (tests/zoo/test_parity.py):
    an MLA engine asks for the reference backend in any precision, and starts without prefix caching, which vLLM's
    CPU platform turns off for MLA anyway (too late for a hybrid's state cache: tests/zoo/test_hybrids.py's
    Kimi-Linear); other attention keeps vLLM's."""
    from transformers import DeepseekV2Config, LlamaConfig

    from colograd.engine.cpu import mla_backend

    deepseek = DeepseekV2Config()  # kv_lora_rank 512, as DeepSeek-V2's
    assert mla_backend(deepseek) == {"attention_backend": "CPU_MLA", "enable_prefix_caching": False}
    assert mla_backend(LlamaConfig()) == {}


def test_the_rotary_kernel_gets_flat_heads_and_rotates_them_as_vllms_torch_path():
    """A rotary layer built after `rotate_flat_heads` rotates a [tokens, heads, head_dim] query as vLLM's own torch
    path does (LFM2's attention hands it per-head queries); without it the CPU kernel gets them as they are and
    rotates them wrongly (if this part fails, vLLM's kernel takes 3-D queries now and the switch can go)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.__dict__["forward_cpu"]
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(7)
    query = torch.randn(7, 4, 64, generator=generator)  # LFM2-1.2B's head size, a few heads
    key = torch.randn(7, 1, 64, generator=generator)

    def rotated(layer):
        native = layer.forward_native(positions, query.flatten(-2).clone(), key.flatten(-2).clone())
        return layer.forward_cpu(positions, query.clone(), key.clone()), native  # what the CPU engine dispatches

    try:
        with set_current_vllm_config(VllmConfig()):
            RotaryEmbedding.forward_cpu = getattr(kernel, "__wrapped__", kernel)  # the kernel as vLLM calls it
            (q, _), (native_q, _) = rotated(RotaryEmbedding(64, 64, 128000, 1e6, True, torch.float32))
            assert (q.flatten(-2) - native_q).abs().max() > 1  # the kernel's own handling of heads
            assert engine_cpu.rotate_flat_heads()
            assert engine_cpu.rotate_flat_heads()  # once is enough
            layer = RotaryEmbedding(64, 64, 128000, 1e6, True, torch.float32)
            assert layer.forward_cpu.__func__.flat_heads
            (q, k), (native_q, native_k) = rotated(layer)
            assert q.shape == query.shape and k.shape == key.shape
            assert (q.flatten(-2) - native_q).abs().max() < 1e-5 and (k.flatten(-2) - native_k).abs().max() < 1e-5
            flat_q, flat_k = layer.forward_cpu(positions, query.flatten(-2).clone(), key.flatten(-2).clone())  # 2-D
            assert torch.equal(flat_q, q.flatten(-2)) and torch.equal(flat_k, k.flatten(-2))
            # Latent attention writes the rotated part back into the query it came from (vLLM's mla.py): for one
            # token of a one-head model, as A.X K1's decode steps are, that view must come back as it went in.
            for tokens in (1, 7):
                q = torch.randn(tokens, 1, 192, generator=generator)  # nope 128 + rope 64, one head
                k_pe = torch.randn(tokens, 576, generator=generator).split([512, 64], dim=-1)[1].unsqueeze(1)
                native_q, native_k = layer.forward_native(positions[:tokens], q[..., 128:].flatten(-2).clone(),
                                                          k_pe.flatten(-2).clone())  # fmt: skip
                q[..., 128:], k = layer.forward_cpu(positions[:tokens], q[..., 128:], k_pe)
                assert (q[..., 128:].flatten(-2) - native_q).abs().max() < 1e-5
                assert (k.flatten(-2) - native_k).abs().max() < 1e-5
    finally:
        RotaryEmbedding.forward_cpu = kernel


def test_a_name_is_renamed_by_the_causal_lm_and_then_by_the_submodule_that_loads_it():
    """vLLM renames checkpoint names in the causal LM (`hf_to_vllm_mapper`) and, for some families, again in the
    decoder's own loader (LFM2-MoE's `expert_bias` becomes `gate.e_score_correction_bias` there): both apply, the
    outer first; a name either drops is dropped."""
    from torch import nn
    from vllm.model_executor.models.utils import WeightsMapper

    from colograd.engine.names import engine_name

    class Decoder(nn.Module):
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr={"expert_bias": "gate.e_score_correction_bias"})

    class CausalLM(nn.Module):
        hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr={".conv.": ".short_conv."},
                                          orig_to_new_prefix={"mtp.": None})  # fmt: skip

        def __init__(self):
            super().__init__()
            self.model = Decoder()

    model = CausalLM()
    assert engine_name(model, "model.layers.2.feed_forward.expert_bias") == (
        "model.layers.2.feed_forward.gate.e_score_correction_bias"
    )
    assert engine_name(model, "model.layers.0.conv.conv.weight") == "model.layers.0.short_conv.conv.weight"
    assert engine_name(model, "mtp.layers.0.weight") is None
    assert engine_name(nn.Linear(2, 2), "weight") == "weight"  # no renaming anywhere


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_noted_once_from_the_first_rank(monkeypatch, capsys):
    """An AVX2 CPU emulates bf16 (slower than float32): a run whose engine or trainer computes in bf16 is told so
    once, from the first rank, before the engine starts; nothing is said in float32 or where the CPU has bf16."""
    from colograd.engine import cpu

    monkeypatch.setattr(cpu, "_SAID", set())
    monkeypatch.setattr(cpu, "computes_bf16", lambda: False)
    cpu.note_emulated_bf16(False, False, 0)  # float32
    cpu.note_emulated_bf16(True, True, 1)  # another rank
    assert capsys.readouterr().err == ""
    cpu.note_emulated_bf16(True, True, 0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("colograd: note: bf16 (the engine's and the trainer's autocast) is")
    assert "bf16: false" in err
    cpu.note_emulated_bf16(True, False, 0)  # said once per process
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cpu, "_SAID", set())
    monkeypatch.setattr(cpu, "computes_bf16", lambda: True)
    cpu.note_emulated_bf16(True, True, 0)
    assert capsys.readouterr().err == ""


def test_a_prepacked_convolutions_view_follows_each_reload_on_any_cpu(monkeypatch):
    """vLLM's Mamba-2 layer computes from `conv_weights`, a view of `conv1d.weight` taken when it is built; where the
    CPU backend prepacks that weight (AVX-512 bf16 or Arm bf16: `dispatch_cpu_unquantized_gemm` moves the weight to
    the packed copy and keeps the plain one as `_cpu_unpacked_conv_weight`), the view keeps the first load's storage.
    `refresh_convolution_views` copies the plain weight of each reload into it. Run here through vLLM's own prepack
    code with the CPU's bf16 support and the packing op stood in for (this machine may have neither), the layer laid
    out as vLLM's `MambaMixer2.__init__` lays it: without the refresh the view keeps the start-up values."""
    from torch import nn
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils

    from colograd.engine.weights import refresh_convolution_views

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(ops, "causal_conv1d_weight_pack", lambda w: w.t().contiguous().flip(0), raising=False)

    class Mixer(nn.Module):  # MambaMixer2's convolution and its view, as vLLM 0.32 builds them
        def __init__(self):
            super().__init__()
            self.conv1d = nn.Module()
            self.conv1d.weight = nn.Parameter(torch.randn(16, 4, dtype=torch.bfloat16), requires_grad=False)
            self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)
            view = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
            self.register_buffer("conv_weights", view, persistent=False)

    model = nn.Sequential(Mixer(), Mixer())
    for mixer in model:
        utils.dispatch_cpu_unquantized_gemm(mixer.conv1d, remove_weight=False)  # the start-up load's prepack
        assert hasattr(mixer.conv1d, "_cpu_unpacked_conv_weight")
    loaded = [mixer.conv_weights.clone() for mixer in model]
    for mixer in model:  # a reload: new values into the plain weight's place, packed again
        mixer.conv1d.weight.data = torch.randn(16, 1, 4, dtype=torch.bfloat16)
        utils.dispatch_cpu_unquantized_gemm(mixer.conv1d, remove_weight=False)
    assert all(torch.equal(m.conv_weights, before) for m, before in zip(model, loaded, strict=True))  # stale
    assert refresh_convolution_views(model) == 2
    for mixer in model:
        assert torch.equal(mixer.conv_weights, mixer.conv1d._cpu_unpacked_conv_weight)
        assert mixer.conv_weights.data_ptr() != mixer.conv1d._cpu_unpacked_conv_weight.data_ptr()


def route(router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's experts per token, in ascending order, and their weights in that order."""
    ids, order = router[1].sort(-1)
    return ids.long(), router[0].gather(-1, order).float()


def test_the_cpu_router_chooses_experts_as_the_trainer_does_with_a_bias_and_with_sigmoid_scores():
    """vLLM's CPU router has only softmax top-k for a router without groups: Ernie-4.5-MoE's correction bias was
    dropped (other experts than the trainer's), and Laguna's sigmoid scores stopped at an assertion. Routed through
    the router's own grouped top-k with one group, both choose and weigh experts as transformers' routers of those
    families do; routing the router already did (softmax, no bias) is its own, bit for bit."""
    from types import SimpleNamespace

    from transformers import Ernie4_5_MoeConfig, LagunaConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from transformers.models.laguna.modeling_laguna import LagunaTopKRouter
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    assert engine_cpu.route_every_scoring_as_vllms_gpu_build()
    vllms = CPURouter._compute_routing.__wrapped__
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=generator)
    for config, family in [
        (Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=64, moe_k=6), Ernie4_5_MoeTopKRouter),
        (LagunaConfig(hidden_size=32, num_experts=64, num_experts_per_tok=8), LagunaTopKRouter),
    ]:
        trainer = family(config)
        with torch.no_grad():
            trainer.weight.normal_(generator=generator)
            bias = trainer.moe_statics if hasattr(trainer, "moe_statics") else trainer
            bias.e_score_correction_bias.normal_(generator=generator)
        logits, weights, experts = trainer(hidden)
        scoring = "sigmoid" if family is LagunaTopKRouter else "softmax"
        engine = SimpleNamespace(use_grouped_topk=False, custom_routing_function=None, scoring_func=scoring,
                                 top_k=experts.shape[-1], renormalize=True, routed_scaling_factor=1.0,
                                 e_score_correction_bias=bias.e_score_correction_bias.detach().flatten())  # fmt: skip
        ids, engine_weights = route(CPURouter._compute_routing(engine, hidden, logits, None), logits)
        expected_ids, order = experts.sort(-1)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(engine_weights, weights.gather(-1, order).float())
        if scoring == "softmax":  # vLLM's own router chose by the scores alone
            assert not torch.equal(route(vllms(engine, hidden, logits, None), logits)[0], expected_ids)
        else:  # ... and refused sigmoid scores
            with pytest.raises(AssertionError):
                vllms(engine, hidden, logits, None)
    plain = SimpleNamespace(use_grouped_topk=False, custom_routing_function=None, scoring_func="softmax", top_k=6,
                            renormalize=True, routed_scaling_factor=1.0, e_score_correction_bias=None)  # fmt: skip
    logits = torch.randn(64, 64, generator=generator)
    ours, own = CPURouter._compute_routing(plain, hidden, logits, None), vllms(plain, hidden, logits, None)
    assert all(torch.equal(a, b) for a, b in zip(ours, own, strict=True))


def test_a_tensor_kept_below_the_engines_precision_is_raised_to_it_in_place():
    """vLLM's xIELU (Apertus) makes its parameters and constants in bfloat16 whatever the engine's dtype: in a float32
    engine they are held in float32, the same Parameter objects (their `weight_loader` kept), so that a sync copies
    the trainer's float32 values whole; a float32 tensor, and a bfloat16 engine's, are left as they are. (The zoo's
    Apertus test trains through it: tests/zoo/test_parity.py.)"""
    from torch import nn

    from colograd.engine.weights import at_engine_precision

    class Activation(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha_p = nn.Parameter(torch.tensor([0.8], dtype=torch.bfloat16))
            self.alpha_p.weight_loader = "the loader vLLM attached"
            self.weight = nn.Parameter(torch.ones(2))
            self.register_buffer("eps", torch.tensor(-1e-6, dtype=torch.bfloat16))

    model = Activation()
    parameter = model.alpha_p
    assert at_engine_precision(model, torch.bfloat16) == [] and parameter.dtype == torch.bfloat16
    assert at_engine_precision(model, torch.float32) == ["alpha_p", "eps"]
    assert model.alpha_p is parameter and parameter.weight_loader == "the loader vLLM attached"
    assert parameter.dtype == model.eps.dtype == model.weight.dtype == torch.float32
    with torch.no_grad():
        parameter.copy_(torch.tensor([0.123456789]))
    assert parameter.item() == torch.tensor(0.123456789).item()  # not rounded to bfloat16's 0.1235


@pytest.mark.parametrize("on_gpu, eager, quantized", [(False, False, False), (True, True, False), (True, False, False),
                                                      (False, False, True)])  # fmt: skip
def test_the_precision_raise_is_skipped_where_graphs_or_quantization_need_the_tensors_as_they_are(
    on_gpu, eager, quantized, monkeypatch
):
    """In the engine's worker the raise runs on the CPU and on an eager GPU engine; not where the engine replays CUDA
    graphs (captured at its start, they read each tensor where it was: a moved tensor would be read stale), nor on a
    quantized model."""
    from types import SimpleNamespace

    from torch import nn

    from colograd.engine.weights import _raise_to_engine_precision

    model = nn.Module()
    model.alpha_p = nn.Parameter(torch.tensor([0.8], dtype=torch.bfloat16))
    config = SimpleNamespace(quant_config=object() if quantized else None,
                             model_config=SimpleNamespace(dtype=torch.float32, enforce_eager=eager))  # fmt: skip
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model, vllm_config=config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    raises = not quantized and (not on_gpu or eager)
    assert _raise_to_engine_precision(worker) == (["alpha_p"] if raises else [])
    assert model.alpha_p.dtype == (torch.float32 if raises else torch.bfloat16)
