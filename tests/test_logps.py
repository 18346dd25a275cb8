"""Completion log-probs: packed (padding-free) and padded forward passes agree, in loss and in gradients."""

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, Qwen2Config, Qwen2ForCausalLM
from trl.trainer.utils import selective_log_softmax

from colograd import tiny
from colograd.logps import completion_logps, pack, pack_rows, pack_shared, prompt_sharing_cost, share_units
from colograd.loss import policy_loss

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
