"""Segment attention (`colograd.forward.attention`): padding-free passes, shared prompts included, without a mask.

The varlen kernels exist on CUDA only; here the `reference` kernel (a loop of masked SDPA calls over the same
segments) stands in for them, so what is proven on a CPU is the layout: which keys each query segment gathers,
in which order, and that a model whose attention is switched trains exactly as SDPA trains it, through
gradient checkpointing and PEFT. The `gpu` test at the end compares the CUDA kernels with that reference."""

import copy

import peft
import pytest
import torch
from test_logps import _assert_same_training, _batch, _grouped_batch
from torch.nn.attention import SDPBackend
from transformers import Qwen2Config, Qwen2ForCausalLM

from colograd import GRPOTrainer
from colograd.forward import attention, packing
from colograd.forward.attention import Segments, segments_of
from colograd.forward.logps import PromptSharing, completion_logps, pack_for_forward
from colograd.forward.packing import prompt_sharing, use_segments
from colograd.models import tiny


def test_a_completion_gathers_its_prompt_then_itself():
    # One row: unit 0 = prompt (3) + completions of 2 and 1; unit 1 = one sequence alone (2); then padding (2).
    unit_of = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, -1, -1])
    branch = torch.tensor([0, 0, 0, 1, 1, 2, 0, 0, 0, 0])
    s = segments_of(unit_of, branch, "reference")
    assert s.cu_q.tolist() == [0, 3, 5, 6, 8, 10]  # prompt, completion 1, completion 2, the sequence, padding
    assert s.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9]
    assert s.cu_k.tolist() == [0, 3, 8, 12, 14, 16]
    assert (s.max_q, s.max_k) == (3, 5)
    assert s.cu_q.dtype == s.cu_k.dtype == torch.int32  # what the varlen kernels take


def test_packing_for_segments_puts_every_sequence_in_one_row_without_padding():
    batch = _grouped_batch()
    real = int(batch["attention_mask"].sum())
    for sharing in (None, PromptSharing(0.0)):
        packed = pack_for_forward(batch, sharing, row_tokens=10, segments="reference")
        assert packed.input_ids.shape[0] == 1 and packed.input_ids.shape[1] == packed.tokens
        assert packed.attention_mask.shape == (1, 1, 1, 1)  # a marker: no [L, L] mask exists
        layout = packed.attention_mask.segments
        assert layout.cu_q[-1] == packed.tokens
    # Shared: each of rows 1-3 and 5-6 skips its prompt copy, so the row holds fewer tokens than the sequences.
    assert packed.tokens < real
    assert len(layout.cu_q) - 1 == 3 + 8  # three prompts, eight completions


def _switched(model):
    switched = copy.deepcopy(model)
    attention.install(switched)
    return switched


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1024, 3])
def test_segment_attention_trains_as_sdpa_with_and_without_shared_prompts(tied, chunk_tokens):
    model = tiny.build_model(tie_word_embeddings=tied)
    batch = _grouped_batch()
    switched = _switched(model)
    assert attention.installed(switched) and not attention.installed(model)
    reference = {"padding_free": True}
    for sharing in (None, PromptSharing(0.0)):
        kwargs = {"padding_free": True, "chunk_tokens": chunk_tokens, "share_prompts": sharing}
        expected = completion_logps(model, batch, **reference)
        got = completion_logps(switched, batch, segments="reference", **kwargs)
        mask = batch["completion_mask"].bool()
        assert (got - expected)[mask].abs().max() < 1e-5
        # Same loss and gradients, parameter by parameter (the switched copy has the same weights).
        _assert_same_training(switched, batch, reference, segments="reference", **kwargs)


def test_grouped_query_heads_and_gradient_checkpointing():
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    batch = _grouped_batch(seed=3)
    switched = _switched(model)
    switched.gradient_checkpointing_enable({"use_reentrant": False})
    switched.train()
    # The layers are recomputed in the backward pass: the recomputation must see the segments again.
    _assert_same_training(
        switched,
        batch,
        {"padding_free": True},
        padding_free=True,
        share_prompts=PromptSharing(0.0),
        segments="reference",
    )


def test_under_autocast_the_kernel_gets_queries_keys_and_values_in_the_autocast_dtype(monkeypatch):
    # The rotary embedding leaves queries and keys in float32 beside bfloat16 values; CUDA's varlen kernels take
    # one dtype, and are not under autocast's casting rules as SDPA is.
    seen = []

    def one_dtype(q, k, v, s, scale, dropout=0.0):
        seen.append({q.dtype, k.dtype, v.dtype})
        return attention._reference(q, k, v, s, scale)

    monkeypatch.setitem(attention.KERNELS, "reference", one_dtype)
    model = tiny.build_model()
    batch = _grouped_batch()
    switched = _switched(model)
    with torch.autocast("cpu", torch.bfloat16):
        expected = completion_logps(model, batch, padding_free=True)
        got = completion_logps(
            switched, batch, padding_free=True, share_prompts=PromptSharing(0.0), segments="reference"
        )
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen)
    mask = batch["completion_mask"].bool()
    assert (got - expected)[mask].abs().max() < 0.1  # bf16 rounding, different kernels


def test_a_peft_model_through_its_wrapper():
    model = peft.get_peft_model(tiny.build_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    batch = _batch(seed=1)
    expected = completion_logps(model, batch, padding_free=True)
    attention.install(model)
    assert attention.installed(model)
    got = completion_logps(model, batch, padding_free=True, share_prompts=PromptSharing(0.0), segments="reference")
    mask = batch["completion_mask"].bool()
    assert (got - expected)[mask].abs().max() < 1e-5


def test_a_switched_model_without_segments_is_sdpa_and_an_unswitched_one_ignores_them():
    model = tiny.build_model()
    batch = _batch(seed=2)
    switched = _switched(model)
    mask = batch["completion_mask"].bool()
    for kwargs in ({"padding_free": False}, {"padding_free": True}, {"padding_free": True, "share_prompts": 0.01}):
        expected = completion_logps(model, batch, **kwargs)
        assert (completion_logps(switched, batch, **kwargs) - expected)[mask].abs().max() < 1e-6
    # Segments asked of a model whose attention is SDPA (a reference model left as it was): the plain packing.
    got = completion_logps(model, batch, padding_free=True, segments="reference")
    assert (got - completion_logps(model, batch, padding_free=True))[mask].abs().max() == 0


def test_segments_are_used_only_on_cuda_and_then_share_whenever_that_saves_tokens(monkeypatch):
    model = tiny.build_model()
    cpu = torch.device("cpu")
    assert attention.varlen_kernel(2, 2, 64, torch.bfloat16, cpu) is None
    assert use_segments([model], cpu, torch.float32) is None and not attention.installed(model)
    # On a GPU whose probe finds a kernel: both the policy and the reference copy are switched.
    monkeypatch.setattr(attention, "varlen_kernel", lambda *a: "flash")
    frozen = copy.deepcopy(model)
    assert use_segments([model, None, frozen], torch.device("cuda"), torch.bfloat16) == "flash"
    assert attention.installed(model) and attention.installed(frozen)
    gpu = torch.device("cuda")
    assert prompt_sharing(model, "auto", gpu, torch.bfloat16, "flash") == PromptSharing(0.0)
    assert prompt_sharing(model, True, gpu, torch.bfloat16, "flash") == PromptSharing(0.0)
    assert prompt_sharing(model, False, gpu, torch.bfloat16, "flash") is None
    # An attention that cannot be cut into segments (sliding windows) gets none.
    config = tiny.build_model().config
    config.layer_types = ["sliding_attention", "full_attention"]
    windowed = Qwen2ForCausalLM(config)
    assert packing.segment_kernel(windowed, gpu, torch.bfloat16) is None


def test_buckets_keep_each_run_within_twice_its_tokens_and_cover_every_segment():
    # A 40-token prompt, then completions of 3, 4, 50, 5 and 6 tokens (each gathering the prompt's keys).
    lengths = [40, 3, 4, 50, 5, 6]
    unit_of = torch.zeros(sum(lengths), dtype=torch.long)
    branch = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    s = segments_of(unit_of, branch, "efficient")
    runs = s.buckets
    assert [run.q_lengths for run in runs] == [(40, 3), (4, 50), (5, 6)]
    for run in runs:
        assert len(run.q_lengths) * run.max_q <= 2 * sum(run.q_lengths)
        assert run.cu_q[0] == 0 and run.cu_q[-1] == sum(run.q_lengths) and run.cu_k[-1] == sum(run.k_lengths)
    assert sum((run.k_lengths for run in runs), ()) == s.k_lengths


def test_the_efficient_kernel_runs_bucket_by_bucket_on_its_own_slices(monkeypatch):
    """`_efficient`'s slicing and grouped-head repetition, with CUDA's op replaced by the reference loop on what it
    is given: each call must see whole segments, offsets from its own first token."""
    calls = []

    def op(q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout, mask_type, lse, scale):
        assert mask_type == 2 and q.size(2) == k.size(2)  # causal from the bottom right, heads repeated
        run = Segments(cu_q, cu_k, torch.empty(0), max_q, max_k, "efficient")
        calls.append(cu_q.tolist())
        return (attention._reference(q[0], k[0], v[0], run, scale)[None],)

    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_forward", op)
    lengths = [40, 3, 4, 50, 5, 6]
    s = segments_of(torch.zeros(sum(lengths), dtype=torch.long),
                    torch.repeat_interleave(torch.arange(6), torch.tensor(lengths)), "efficient")  # fmt: skip
    q = torch.randn(sum(lengths), 4, 8, requires_grad=True)
    kv = torch.randn(sum(lengths), 2, 8)
    k = kv.index_select(0, s.kv_index)
    got = attention._efficient(q, k, k, s, 0.3)
    assert calls == [[0, 40, 43], [0, 4, 54], [0, 5, 11]]
    assert torch.allclose(got, attention._reference(q, k, k, s, 0.3), atol=1e-6)


def test_a_float32_model_under_flash_segments_runs_the_efficient_kernel(monkeypatch):
    """A model that computes in float32 (a reference copy outside autocast) given flash segments: flash takes
    fp16 / bf16 only, so the call goes to the memory-efficient kernel."""
    ran = []

    def flash(q, k, v, s, scale, dropout=0.0):
        assert q.dtype in attention.HALF, "flash refuses float32"
        ran.append("flash")
        return attention._reference(q, k, v, s, scale)

    def efficient(q, k, v, s, scale, dropout=0.0):
        ran.append("efficient")
        return attention._reference(q, k, v, s, scale)

    monkeypatch.setitem(attention.KERNELS, "flash", flash)
    monkeypatch.setitem(attention.KERNELS, "efficient", efficient)
    switched = _switched(tiny.build_model())
    completion_logps(switched, _grouped_batch(), padding_free=True, share_prompts=PromptSharing(0.0), segments="flash")
    assert set(ran) == {"efficient"}
    with torch.autocast("cpu", torch.bfloat16):
        completion_logps(switched, _grouped_batch(), padding_free=True, segments="flash")
    assert ran[-1] == "flash"


def test_a_model_whose_attention_cannot_be_switched_gets_no_segments(monkeypatch, caplog):
    monkeypatch.setattr(packing, "segment_kernel", lambda *a: "flash")
    monkeypatch.setattr(attention, "install", lambda model: None)  # as transformers does for some remote code
    model = tiny.build_model()
    assert use_segments([model], torch.device("cuda"), torch.bfloat16) is None
    assert "could not be switched to segment attention" in caplog.text


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("FlashAttention only supports Ampere GPUs or newer."),
        TypeError("_flash_attention_forward() got an unexpected keyword argument 'scale'"),  # another torch's op
    ],
)
def test_the_kernel_probe_takes_the_first_kernel_that_runs_forward_and_backward(error, monkeypatch):
    tried = []

    def fails(*args):
        tried.append("flash")
        raise error

    def runs(q, k, v, s, scale):
        tried.append("efficient")
        assert isinstance(s, Segments) and s.cu_q.tolist() == [0, 16, 32, 48]
        return attention._reference(q, k, v, s, scale)

    monkeypatch.setitem(attention.KERNELS, "flash", fails)
    monkeypatch.setitem(attention.KERNELS, "efficient", runs)
    # The probe runs on the device it is given: the CPU, taken for a GPU here.
    monkeypatch.setattr(attention, "_is_cuda", lambda device: True)
    assert attention.varlen_kernel(4, 2, 16, torch.float32, torch.device("cpu")) == "efficient"
    assert tried == ["flash", "efficient"]


def test_the_kernel_probe_refuses_a_kernel_that_runs_but_computes_other_attention(monkeypatch, caplog):
    def top_left(q, k, v, s, scale):  # causality from the top left: a completion sees only part of its prompt
        out = []
        for i in range(len(s.q_lengths)):
            a, z, ka, kz = *s.cu_q[i : i + 2].tolist(), *s.cu_k[i : i + 2].tolist()
            qs, ks, vs = q[a:z].transpose(0, 1), k[ka:kz].transpose(0, 1), v[ka:kz].transpose(0, 1)
            allowed = torch.ones(z - a, kz - ka, dtype=torch.bool).tril()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            out.append(sdpa(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True).transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setitem(attention.KERNELS, "flash", top_left)
    monkeypatch.setitem(attention.KERNELS, "efficient", top_left)
    monkeypatch.setattr(attention, "_is_cuda", lambda device: True)
    assert attention.varlen_kernel(4, 2, 16, torch.float32, torch.device("cpu")) is None
    assert "the flash varlen kernel differs from the reference" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("kernel, dtype", [("flash", torch.bfloat16), ("efficient", torch.bfloat16),
                                           ("efficient", torch.float32)])  # fmt: skip
def test_cuda_varlen_kernels_equal_the_reference(kernel, dtype):
    """Output and gradients (queries, and keys and values through the gathered prompt keys), three query heads
    per KV head, a prompt shared by two completions, a sequence alone, padding."""
    device = torch.device("cuda")
    unit_of = torch.tensor([0] * 20 + [1] * 9 + [-1] * 3)
    branch = torch.tensor([0] * 7 + [1] * 5 + [2] * 8 + [0] * 9 + [0] * 3)
    s = segments_of(unit_of, branch, kernel).to(device)
    q = torch.randn(32, 6, 64, device=device).to(dtype).requires_grad_()
    kv = torch.randn(32, 2, 64, device=device).to(dtype).requires_grad_()
    got = attention._probe(attention.KERNELS[kernel], q, kv, s, 0.125)
    expected = attention._probe(attention._reference, q, kv, s, 0.125)
    for a, b in zip(got, expected, strict=True):
        assert ((a - b).abs().max() / b.abs().max().clamp(min=1)).item() <= attention.PROBE_TOLERANCE[dtype]


@pytest.mark.slow
def test_a_run_with_segment_attention_matches_the_engine(tmp_path, monkeypatch):
    # The GPU path on a CPU: the probe's answer stubbed to the reference kernel, the engine and training real.
    monkeypatch.setattr(packing, "segment_kernel", lambda *a: "reference")
    args = tiny.run_config(str(tmp_path), 2, per_device_train_batch_size=16, num_generations=4, beta=0.04,
                           logging_steps=1, gradient_checkpointing=True)  # fmt: skip
    trainer = GRPOTrainer(
        model=tiny.build_model(),
        reward_funcs=tiny.letters_reward,
        args=args,
        train_dataset=tiny.letters_dataset(32),
        processing_class=tiny.build_tokenizer(),
    )
    assert attention.installed(trainer.model) and attention.installed(trainer.reference.frozen)
    assert trainer.forward.prompt_cost == PromptSharing(0.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    # The trainer's log-probs (segments, prompts shared) against the engine's of the same tokens, before any update.
    assert logs[0]["sampling/sampling_logp_difference/max"] < 1e-3
    # Before the first update the reference copy (its attention switched too) gives the policy's log-probs.
    assert abs(logs[0]["kl"]) < 1e-6
    assert logs[0]["tokens/forwarded"] < logs[0]["tokens/trained"]  # the prompts were shared


def test_forward_packing_follows_padding_free_and_torch_compile(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(packing, "segment_kernel", lambda *a: "flash")  # a GPU whose probe found flash
    monkeypatch.setattr(packing, "masked_attention_kernel", lambda *a: SDPBackend.EFFICIENT_ATTENTION)  # and its mask
    settings = dict(padding_free=True, torch_compile=False, device=torch.device("cuda"), share_prompts="auto")
    model = tiny.build_model()
    assert packing.forward_packing([model], SimpleNamespace(**settings), torch.bfloat16) == (
        "flash",
        PromptSharing(0.0),
    )
    compiled = packing.forward_packing([tiny.build_model()], SimpleNamespace(**settings | {"torch_compile": True}),
                                     torch.bfloat16)  # fmt: skip
    assert compiled[0] is None and compiled[1] is not None and compiled[1].additive_mask  # the mask packing
    padded = SimpleNamespace(**settings | {"padding_free": False})
    assert packing.forward_packing([tiny.build_model()], padded, torch.bfloat16) == (None, None)
