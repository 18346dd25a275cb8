"""`micro_batch_tokens`: a micro-step in several forward + backward passes trains exactly as in one (2 processes)."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import launch
from test_logps import _grouped_batch, _one_prompt_batch

from colograd.forward import memory
from colograd.forward.batch import split_by_tokens
from colograd.forward.logps import PromptSharing, pack_shared
from colograd.forward.memory import (
    PassBudget,
    activation_bytes_per_token,
    output_layer_bytes,
    pass_token_budget,
    pending_bytes,
)
from colograd.forward.packing import prompt_sharing_cost
from colograd.models import tiny

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("token_budget")
    proc = launch("tests/scripts/token_budget.py", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.slow
def test_passes_by_token_budget_give_the_same_step(ranks, loss_type):
    for rank in ranks:
        whole, split = rank[f"{loss_type}-None"], rank[f"{loss_type}-40"]
        assert whole["sampled"] == split["sampled"]  # the same rollout, so the same step is expected
        assert whole["passes"] == [1, 1] and min(split["passes"]) > 2
        for budget in ("None", "40"):  # ranks agree: gradients were reduced once, after the last pass
            assert rank[f"{loss_type}-{budget}"]["weights"] == ranks[0][f"{loss_type}-{budget}"]["weights"]
        # Plain SGD: the step is lr × gradient, so the weights compare the gradients themselves.
        assert (torch.tensor(whole["weights"]) - torch.tensor(rank["initial"])).abs().max() > 1e-4
        gap = (torch.tensor(split["weights"]) - torch.tensor(whole["weights"])).abs().max().item()
        assert gap < 1e-7, f"{loss_type}: weights differ by {gap:.2e} after one step"


def test_split_keeps_rows_whole_and_scales_the_loss():
    mask = torch.zeros(5, 10, dtype=torch.long)
    for i, n in enumerate([3, 4, 9, 2, 2]):
        mask[i, :n] = 1
    batch = {"attention_mask": mask, "completion_mask": mask[:, 2:], "advantages": torch.arange(5.0),
             "num_items": torch.tensor(7.0)}  # fmt: skip
    passes = split_by_tokens(batch, max_tokens=7, loss_type="grpo")
    assert [p["advantages"].tolist() for p in passes] == [[0.0, 1.0], [2.0], [3.0, 4.0]]  # 9 tokens: a pass alone
    assert sum(p["loss_scale"].item() for p in passes) == pytest.approx(1.0)
    assert all(p["num_items"].item() == 7.0 for p in passes)
    bnpo = split_by_tokens(batch, max_tokens=7, loss_type="bnpo")
    # Completion tokens (from column 2): 1, 2, 7, 0, 0; the last pass has none, so it weighs nothing.
    assert [p["loss_scale"].item() for p in bnpo] == pytest.approx([3 / 10, 7 / 10, 0.0])


def test_with_shared_prompts_a_pass_counts_the_tokens_its_forward_computes():
    # GRPO's groups (rows 0-3 share a prompt, 5-6 another): a row that shares the prompt before it costs its
    # completion, so passes hold whole groups; each pass's shared forward stays within the budget.
    batch = _grouped_batch(seed=5)
    cost = prompt_sharing_cost(tiny.build_model())
    fewer = []
    for budget in (10, 20, 30, 40, 60, 80):
        unshared = split_by_tokens(batch, max_tokens=budget, loss_type="grpo")
        shared = split_by_tokens(batch, max_tokens=budget, loss_type="grpo", share_prompts=cost)
        fewer.append(len(shared) < len(unshared))
        assert len(shared) <= len(unshared)
        assert torch.cat([p["advantages"] for p in shared]).equal(batch["advantages"])  # rows whole, in order
        assert sum(p["loss_scale"].item() for p in shared) == pytest.approx(1.0)
        for part in shared:
            longest = int(part["attention_mask"].sum(1).max())
            assert pack_shared(part, cost).tokens <= max(budget, longest)
    assert any(fewer)


def test_a_pass_budget_fits_a_1_5b_step_on_an_80gb_card():
    # Qwen2.5-1.5B (hidden 1536, 28 layers, MLP 8960, vocabulary 151,936), fp32 weights under bf16 autocast.
    # Per token and layer: (4 × 8960 + 9 × 1536) × 2 B + 4 × 1536 × 4 B = 99,328 + 24,576 = 123,904 B;
    # × 28 layers + 4 × 1536 × 4 B outside them = 3,493,888 B (3.3 MiB; an H100 measured ~2.8).
    qwen = SimpleNamespace(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960)
    per_token = activation_bytes_per_token(qwen, compute_bytes=2, residual_bytes=4)
    assert per_token == 3_493_888
    # Before the first pass training still allocates, per parameter, a 4 B gradient, 8 B of Adam moments and a
    # 2 B autocast copy (1.54e9 × 14 B), and the output layer's chunk: 3 × 1024 × 151,936 × 4 B.
    reserved = 1_540_000_000 * 14 + output_layer_bytes(151_936, 1024)
    assert reserved == 21_560_000_000 + 1_866_989_568
    # 60 GiB free (an 80 GB card less the fp32 weights and an engine whose KV cache is sized to the rollout):
    # 0.8 × (64,424,509,440 - 23,426,989,568) // 3,493,888 = 9,387 tokens, so a micro-step of 32 completions
    # × 270 tokens (16 × 8 × 256 in 4 micro-steps) is one pass.
    assert pass_token_budget(60 * 2**30, reserved, per_token) == 9_387
    # With 24 GiB of the card held by an engine at vllm_gpu_memory_utilization 0.3: 3,486 tokens, three passes.
    assert pass_token_budget(36 * 2**30, reserved, per_token) == 3_486
    assert pass_token_budget(20 * 2**30, reserved, per_token) == 1  # nothing left: a sequence per pass


def test_a_config_listing_its_mlp_widths_layer_by_layer_is_summed_over_them():
    # Gemma-3n's config lists one MLP width per layer (its published E4B: 16,384 for each of its 35 layers): a
    # config's list is summed layer by layer, as the same widths given once are counted (it stopped the trainer's
    # start in a TypeError).
    widths = [16_384] * 5 + [8_192] * 5
    listed = SimpleNamespace(hidden_size=2048, num_hidden_layers=10, intermediate_size=widths)
    halves = [SimpleNamespace(hidden_size=2048, num_hidden_layers=5, intermediate_size=w) for w in (16_384, 8_192)]
    per_token = activation_bytes_per_token(listed, compute_bytes=2, residual_bytes=4)
    outside = 4 * 2048 * 4  # the embeddings, final norm and output layer's input, counted once
    assert per_token == sum(activation_bytes_per_token(h, 2, 4) for h in halves) - outside
    same = SimpleNamespace(hidden_size=2048, num_hidden_layers=10, intermediate_size=[16_384] * 10)
    assert activation_bytes_per_token(same, 2, 4) == activation_bytes_per_token(
        SimpleNamespace(hidden_size=2048, num_hidden_layers=10, intermediate_size=16_384), 2, 4
    )


def test_pending_bytes_are_what_training_has_yet_to_allocate():
    model = tiny.build_model()
    model.lm_head.weight.requires_grad_(False)  # frozen: no gradient, no optimizer state
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    # float32: a 4 B gradient, 2 × 4 B of moments and, under bf16 autocast, a 2 B copy per trainable weight.
    assert pending_bytes(model, optimizer, torch.bfloat16) == 14 * n
    assert pending_bytes(model, None, None) == 12 * n
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert pending_bytes(model, optimizer, torch.bfloat16) == 10 * n
    optimizer.step()
    assert pending_bytes(model, optimizer, torch.bfloat16) == 2 * n
    assert pending_bytes(model, optimizer, torch.float32) == 0


def _run_args(**kwargs) -> SimpleNamespace:
    """The fields `PassBudget` reads, with the defaults of a bf16 run on a GPU."""
    fields = dict(device=torch.device("cuda"), mixed_precision="bf16", logps_chunk_tokens=1024, padding_free=True,
                  top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False)  # fmt: skip
    return SimpleNamespace(**{**fields, **kwargs})


def test_the_pass_budget_is_derived_once_on_a_gpu(monkeypatch, capsys):
    model = tiny.build_model()
    asked = []
    monkeypatch.setattr(memory, "free_bytes", lambda device: asked.append(device) or 2**30)
    budget = PassBudget(model, _run_args(), announce=True)
    per_token = activation_bytes_per_token(model.config, 2, 4)
    reserved = pending_bytes(model, None, torch.bfloat16) + output_layer_bytes(64, 1024)
    expected = pass_token_budget(2**30, reserved, per_token)
    assert budget.tokens(model, None) == expected == budget.tokens(model, None)
    assert asked == [torch.device("cuda")]  # measured once, at the first pass
    assert f"training passes of at most {expected:,} tokens" in capsys.readouterr().out
    assert PassBudget(model, _run_args(device=torch.device("cpu"))).tokens(model, None) is None
    assert PassBudget(model, _run_args(), deepspeed=True).tokens(model, None) is None
    assert PassBudget(model, _run_args(padding_free=False)).tokens(model, None) is None
    assert PassBudget(model, _run_args(entropy_coef=0.01)).tokens(model, None) is None
    assert PassBudget(model, _run_args(top_entropy_quantile=0.2)).tokens(model, None) is None


def test_a_micro_batch_the_gpu_would_not_share_is_split_by_its_whole_tokens():
    # One prompt of 10 tokens, 8 completions of 40: shared, 10 + 8 × 40 = 330 of 400 tokens, 17.5% fewer. Below
    # the 20% the GPU's auto rule asks of rows that unshared need no mask, so passes count whole sequences (2 of 50
    # tokens in 130); where sharing applies, a completion after the first adds 40 (50 + 40 + 40 = 130).
    batch = _one_prompt_batch(10, [40] * 8)
    batch.update(completion_mask=batch["attention_mask"][:, 10:], advantages=torch.arange(8.0))

    def sizes(sharing):
        return [len(p["advantages"]) for p in split_by_tokens(batch, 130, "grpo", share_prompts=sharing)]

    assert sizes(None) == [2, 2, 2, 2]
    assert sizes(0.0) == sizes(PromptSharing(0.0, min_saving=0.1)) == [3, 3, 2]
    assert sizes(PromptSharing(0.0, min_saving=0.2)) == [2, 2, 2, 2]
