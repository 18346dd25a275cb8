"""Completion log-probs: packed (padding-free) and padded forward passes agree, in loss and in gradients."""

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BloomConfig, BloomForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import selective_log_softmax

from colograd.config.core import GRPOConfig
from colograd.errors import ConfigError
from colograd.forward import packing
from colograd.forward.logps import (
    PromptSharing,
    completion_logps,
    pack,
    pack_for_forward,
    pack_rows,
    pack_shared,
    share_units,
)
from colograd.forward.packing import masked_attention_kernel, prompt_sharing, prompt_sharing_cost
from colograd.grpo.loss import policy_loss
from colograd.models import tiny

N, P, T = 8, 6, 9


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout as `pad_rollout` lays it out, with prompt and completion lengths that vary a lot."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (N, P + T), generator=gen)
    mask = torch.zeros(N, P + T, dtype=torch.long)
    for i in range(N):
        prompt = int(torch.randint(1, P + 1, (1,), generator=gen))
        completion = T if i == 0 else int(torch.randint(1, T + 1, (1,), generator=gen))
        mask[i, P - prompt : P + completion] = 1
    ids = ids * mask  # padding is token 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": ids[:, P:],
        "completion_mask": mask[:, P:],
        "advantages": torch.randn(N, generator=gen),
    }


def _loss_and_grads(model, batch, **kwargs):
    model.zero_grad()
    logps = completion_logps(model, batch, temperature=0.7, **kwargs)
    out = policy_loss(logps, logps.detach() + 0.05, batch["advantages"], batch["completion_mask"], loss_type="grpo")
    out.loss.backward()
    return logps.detach(), out.loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same_training(model, batch, reference: dict, **kwargs):
    """`completion_logps` with `kwargs` gives the log-probs, loss and gradients that `reference` (its keywords)
    gives, and 0 where there is no completion token."""
    mask = batch["completion_mask"].bool()
    expected_logps, expected_loss, expected_grads = _loss_and_grads(model, batch, **reference)
    logps, loss, grads = _loss_and_grads(model, batch, **kwargs)
    assert (logps - expected_logps)[mask].abs().max() < 1e-5
    assert (logps[~mask] == 0).all()
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    for name, grad in expected_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5), name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("row_tokens, chunk_tokens", [(None, 1024), (4096, 1024), (24, 5)])
def test_packed_and_padded_give_the_same_loss_and_gradients(tied, row_tokens, chunk_tokens):
    model = tiny.build_model(tie_word_embeddings=tied)
    packed = {"padding_free": True, "row_tokens": row_tokens, "chunk_tokens": chunk_tokens}
    _assert_same_training(model, _batch(), {"padding_free": False}, **packed)


def test_padded_logps_equal_a_full_logit_softmax():
    model = tiny.build_model()
    batch = _batch(seed=1)
    with torch.no_grad():
        logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
        expected = selective_log_softmax(logits[:, P - 1 : -1] / 0.7, batch["completion_ids"])
        ours = completion_logps(model, batch, temperature=0.7, padding_free=False, chunk_tokens=7)
    assert torch.allclose(ours, expected, atol=1e-5)


def test_packing_keeps_sequences_apart():
    # Two sequences packed in one row must not see each other: the second's log-probs equal those it gets alone.
    model = tiny.build_model()
    batch = _batch(seed=2)
    packed = pack(batch, row_tokens=4096)
    assert packed.input_ids.size(0) == 1 and packed.input_ids.size(1) == batch["attention_mask"].sum()
    with torch.no_grad():
        together = completion_logps(model, batch, padding_free=True)
        alone = torch.cat([completion_logps(model, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(N)])
    assert torch.allclose(together, alone, atol=1e-5)


def test_rows_hold_whole_sequences_within_the_budget():
    lengths = [7, 3, 9, 2, 5, 12, 1]
    rows = pack_rows(lengths, row_tokens=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:
        assert sum(lengths[i] for i in row) <= 10 or len(row) == 1  # a 12-token sequence gets its own row
    assert rows == [[5], [2, 6], [0, 1], [4, 3]]  # first fit, longest first: 12 | 9+1 | 7+3 | 5+2
    assert pack_rows([4, 4, 4], row_tokens=100) == [[0, 1, 2]]


def test_the_output_layer_is_restored():
    model = tiny.build_model()
    head = model.get_output_embeddings()
    completion_logps(model, _batch())
    assert "forward" not in head.__dict__
    assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, model.config.vocab_size)


def _grouped_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """`_batch` with GRPO's groups: rows 0-3 share row 0's prompt, rows 5-6 row 4's, row 7 has its own."""
    batch = _batch(seed)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for source, copies in ((0, (1, 2, 3)), (4, (5, 6))):
        for i in copies:
            ids[i, :P], mask[i, :P] = ids[source, :P], mask[source, :P]
    return {
        **batch,
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": ids[:, P:],
        "completion_mask": mask[:, P:],
    }


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("row_tokens, chunk_tokens", [(None, 1024), (4096, 3), (10, 1024)])
def test_shared_prompts_give_the_same_loss_and_gradients(tied, row_tokens, chunk_tokens):
    model = tiny.build_model(tie_word_embeddings=tied)
    batch = _grouped_batch()
    cost = prompt_sharing_cost(model)
    shared = pack_shared(batch, cost, row_tokens)
    if row_tokens is None or row_tokens > 2 * (P + T):
        # Each prompt is computed once: 5 of the 8 sequences' prompt tokens are not.
        prompt_N = batch["attention_mask"][:, :P].sum(1)
        assert shared.tokens == batch["attention_mask"].sum() - prompt_N[[1, 2, 3, 5, 6]].sum()
    else:  # a small row budget caps a prompt's copy (a longer sequence alone gets its own row)
        assert shared.input_ids.size(1) <= max(row_tokens, int(batch["attention_mask"].sum(1).max()))
    shared_kwargs = {"row_tokens": row_tokens, "chunk_tokens": chunk_tokens, "share_prompts": cost}
    _assert_same_training(model, batch, {"padding_free": True}, padding_free=True, **shared_kwargs)


def test_shared_prompts_keep_completions_and_units_apart():
    # A completion sees its prompt and itself only: each one's log-probs equal those it gets alone, in bf16 too.
    model = tiny.build_model()
    batch = _grouped_batch(seed=3)
    cost = prompt_sharing_cost(model)
    with torch.no_grad():
        alone = torch.cat([completion_logps(model, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(N)])
        together = completion_logps(model, batch, row_tokens=4096, share_prompts=cost)
        assert pack_shared(batch, cost, row_tokens=4096).input_ids.size(0) == 1  # all units in one row
        assert torch.allclose(together, alone, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            alone = torch.cat([completion_logps(model, {k: v[i : i + 1] for k, v in batch.items()}) for i in range(N)])
            together = completion_logps(model, batch, share_prompts=cost)
    assert (together - alone)[batch["completion_mask"].bool()].abs().max() < 0.05


def test_shared_prompts_take_empty_completions_and_keep_rows_within_the_budget():
    model = tiny.build_model()
    batch = _grouped_batch(seed=4)
    for key in ("attention_mask", "completion_mask"):
        batch[key] = batch[key].clone()
    batch["attention_mask"][2, P:] = 0  # a completion with no tokens (an agent's, a rollout_func's)
    batch["completion_mask"] = batch["attention_mask"][:, P:]
    cost = prompt_sharing_cost(model)
    with torch.no_grad():
        unshared = completion_logps(model, batch)
        for row_tokens in (None, 8, 16):
            shared = completion_logps(model, batch, row_tokens=row_tokens, share_prompts=cost)
            assert torch.allclose(shared, unshared, atol=1e-5)
    longest = int(batch["attention_mask"].sum(1).max())
    assert pack_shared(batch, cost, row_tokens=longest).input_ids.size(1) <= longest  # as wide as a padded row


def test_a_prompt_copy_takes_completions_while_that_is_cheaper_than_a_new_copy():
    # Free attention: one copy for all. Otherwise long completions of a short prompt get a copy each, short
    # completions of a long prompt share it, and a growing unit stops where its attention outweighs a new copy.
    assert share_units(10, [5, 5, 5], attention_cost=0.0) == [[0, 1, 2]]
    assert share_units(4, [100, 100, 100], attention_cost=0.01) == [[0], [1], [2]]
    assert share_units(100, [4, 4, 4, 4], attention_cost=0.01) == [[0, 1, 2, 3]]
    assert share_units(100, [4, 4, 4, 4], attention_cost=0.01, max_tokens=108) == [[0, 1], [2, 3]]  # a row budget
    # 50 + 20: a new copy costs 70 + 0.05 × 70² = 315; the 6th completion would add 20 + 0.05 × (170² - 150²) = 340.
    assert share_units(50, [20] * 8, attention_cost=0.05) == [[0, 1, 2, 3, 4], [5, 6, 7]]


def test_prompts_are_shared_only_where_the_attention_takes_the_mask():
    model = tiny.build_model()
    # A query-key pair: 4 × 128 FLOPs per layer; a token: 2 × (q, k, v, o: 4 × 128² + MLP: 3 × 128 × 256) FLOPs.
    assert prompt_sharing_cost(model) == pytest.approx(4 * 128 / (2 * (4 * 128 * 128 + 3 * 128 * 256)))
    model.config._attn_implementation = "eager"  # adds the mask to its scores: a boolean mask would not do
    assert prompt_sharing_cost(model) is None
    config = {k: v for k, v in tiny.build_model().config.to_dict().items() if k != "layer_types"}
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)  # the second layer slides
    sliding = Qwen2ForCausalLM(Qwen2Config(**config))
    assert "sliding_attention" in sliding.config.layer_types
    assert prompt_sharing_cost(sliding) is None
    # ALiBi biases come from a 2D mask, which a shared row has not got.
    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    bloom.config._attn_implementation = "sdpa"  # as if it had it: still not shared
    assert prompt_sharing_cost(bloom) is None
    model = tiny.build_model()
    model.config.alibi = True
    assert prompt_sharing_cost(model) is None


def _one_prompt_batch(prompt_len: int, completion_lens: list[int]) -> dict[str, torch.Tensor]:
    """One prompt of `prompt_len` tokens with completions of the given lengths, laid out as `pad_rollout` does."""
    n, t = len(completion_lens), max(completion_lens)
    ids = torch.randint(3, 60, (n, prompt_len + t), generator=torch.Generator().manual_seed(0))
    ids[:, :prompt_len] = ids[0, :prompt_len]
    mask = torch.zeros_like(ids)
    for i, c in enumerate(completion_lens):
        mask[i, : prompt_len + c] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "completion_ids": ids[:, prompt_len:]}


def _shares(sharing: PromptSharing, batch: dict[str, torch.Tensor], row_tokens: int | None = None) -> bool:
    return pack_for_forward(batch, sharing, row_tokens).attention_mask is not None


def test_auto_sharing_on_a_gpu_shares_where_it_saves_a_fifth_of_the_tokens():
    gpu, cpu = PromptSharing(0.0, min_saving=0.2), PromptSharing(0.0)
    # A long prompt and many short completions: one copy instead of 8 saves 7 × 64 of 8 × 72 tokens.
    assert _shares(gpu, _one_prompt_batch(64, [8] * 8))
    # A short prompt and long completions of one length: 10 + 8 × 40 of 8 × 50 tokens, 17.5% saved. Unshared, each
    # row is one sequence with no padding (the maskless kernel), so the shared mask would cost more than it saves.
    assert not _shares(gpu, _one_prompt_batch(10, [40] * 8))
    assert _shares(cpu, _one_prompt_batch(10, [40] * 8))  # on a CPU any saving pays
    # Lengths that differ (or rows holding two sequences) need a mask unshared too: any saving pays.
    assert _shares(gpu, _one_prompt_batch(10, [40, 39, 40, 38, 40, 40, 37, 40]))
    assert _shares(gpu, _one_prompt_batch(10, [40] * 8), row_tokens=100)
    # Nothing shared (completions of one prompt each): the plain packing.
    batch = _batch()
    assert not _shares(cpu, batch) and not _shares(gpu, batch)


def test_prompt_sharing_follows_the_setting_and_the_masked_kernel(monkeypatch, caplog):
    model = tiny.build_model()
    cost, cpu, cuda = prompt_sharing_cost(model), torch.device("cpu"), torch.device("cuda")
    for setting in ("auto", True):
        assert prompt_sharing(model, setting, cpu, torch.float32) == PromptSharing(cost)
    assert prompt_sharing(model, False, cpu, torch.float32) is None
    # On a GPU (the kernel probe stubbed): an additive mask; auto shares where it saves a fifth of the tokens.
    asked = []
    kernel = SDPBackend.CUDNN_ATTENTION
    monkeypatch.setattr(packing, "masked_attention_kernel", lambda *a: asked.append(a) or kernel)
    assert prompt_sharing(model, "auto", cuda, torch.bfloat16) == PromptSharing(cost, 0.2, additive_mask=True)
    assert prompt_sharing(model, True, cuda, torch.bfloat16) == PromptSharing(cost, 0.0, additive_mask=True)
    assert asked[0] == (2, 64, torch.bfloat16, cuda)  # the tiny model's heads and head size
    kernel = SDPBackend.MATH  # O(L²) memory per layer: auto does not share, true does; both say so
    with caplog.at_level("WARNING", logger="colograd.trainer"):
        assert prompt_sharing(model, "auto", cuda, torch.float32) is None
        assert prompt_sharing(model, True, cuda, torch.float32) == PromptSharing(cost, 0.0, additive_mask=True)
    assert len(caplog.records) == 2 and "math kernel" in caplog.records[0].message
    model.config._attn_implementation = "eager"
    assert prompt_sharing(model, True, cuda, torch.bfloat16) is None


def test_the_masked_kernel_probe_asks_torch():
    kernel = masked_attention_kernel(2, 64, torch.float32, torch.device("cpu"))
    assert kernel in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)  # what CPU SDPA has


def test_one_additive_mask_serves_every_layer_and_trains_as_unshared(monkeypatch):
    # The GPU path, forced on the CPU: each layer's SDPA gets the same mask object, in the queries' dtype and of a
    # width that is a multiple of 16, so no layer converts or pads its own copy; training is unchanged.
    model = tiny.build_model()
    batch = _grouped_batch(seed=6)
    sharing = PromptSharing(prompt_sharing_cost(model), additive_mask=True)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def hooked(query, key, value, attn_mask=None, **kwargs):
        seen.append((attn_mask, query.dtype))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", hooked)
    _assert_same_training(model, batch, {"padding_free": True}, share_prompts=sharing)
    masks = seen[len(seen) // 2 :]  # the shared forward's layers (the first half: the unshared reference)
    assert len(masks) == model.config.num_hidden_layers
    assert all(mask is masks[0][0] for mask, _ in masks)
    assert masks[0][0].dtype == torch.float32 and masks[0][0].size(-1) % 16 == 0


class _KernelMasks(TorchDispatchMode):
    """Records the storage of the mask each SDPA kernel call receives, below autocast and SDPA's conversions."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask")
        if "scaled_dot_product" in func.name() and "backward" not in func.name() and mask is not None:
            self.masks.append((mask.untyped_storage().data_ptr(), mask.dtype))
        return func(*args, **kwargs)


@pytest.mark.parametrize("additive", [True, False])
def test_under_autocast_every_layer_takes_the_additive_mask_as_built(additive):
    # bf16 autocast over fp32 weights, gradients on (each layer keeps what its kernel got for the backward): the
    # kernels all receive the one bf16 mask built for the pass; a boolean mask is converted by each layer anew.
    model = tiny.build_model()
    sharing = PromptSharing(prompt_sharing_cost(model), additive_mask=additive)
    with torch.autocast("cpu", dtype=torch.bfloat16), _KernelMasks() as seen:
        completion_logps(model, _grouped_batch(seed=6), share_prompts=sharing).sum().backward()
    assert len(seen.masks) == model.config.num_hidden_layers
    assert all(dtype == torch.bfloat16 for _, dtype in seen.masks)
    assert (len({ptr for ptr, _ in seen.masks}) == 1) == additive


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("AUTO", "auto"), (True, True), ("true", True),
                                             (False, False), ("False", False)])  # fmt: skip
def test_share_prompts_takes_auto_true_or_false(tmp_path, value, expected):
    assert GRPOConfig(output_dir=str(tmp_path), share_prompts=value).share_prompts == expected


@pytest.mark.parametrize("value", ["sometimes", None, 1])
def test_share_prompts_refuses_other_values(tmp_path, value):
    with pytest.raises(ConfigError, match="share_prompts=.*use auto, true or false"):
        GRPOConfig(output_dir=str(tmp_path), share_prompts=value)
