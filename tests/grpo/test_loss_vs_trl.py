"""colograd's loss and advantages against TRL's own `GRPOTrainer` code on identical random inputs.

TRL's math lives inside trainer methods (`_compute_loss`, `_generate_and_score_completions`), so they are called
unbound on a stand-in `self` that holds only the attributes they read. The model forward and the generation are
the only parts replaced: they return the chosen log-probs and completions. Everything else is TRL's code.
"""

import copy
import threading
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trl.trainer import grpo_trainer as trl_grpo_trainer
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from colograd.config.core import IS_CORRECTION_MODES, LOSS_TYPES, ConfigError
from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout, split_by_tokens
from colograd.forward.logps import completion_logps
from colograd.grpo.entropy import EntropyTerms
from colograd.grpo.loss import (
    Surrogate,
    clipped_fractions,
    group_advantages,
    normalize_then_sum,
    policy_loss,
    sampling_correction,
    weighted_rewards,
)
from colograd.models import tiny

N, T, P, G = 12, 7, 3, 4
# The loss types built on PPO's clipped objective (TRL logs clip_ratio/* for these); the others have their own.
CLIPPED_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")


class _Accelerator:
    """A one-process accelerator: the collectives are identities."""

    num_processes, process_index, device = 1, 0, torch.device("cpu")

    def gather(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    logps = torch.log(torch.rand(N, T, generator=gen) * 0.9 + 0.05)
    return {
        "prompt_ids": torch.ones(N, P, dtype=torch.long),
        "prompt_mask": torch.ones(N, P, dtype=torch.long),
        "completion_ids": torch.ones(N, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.randn(N, generator=gen),
        "num_items_in_batch": mask.sum(),
        # Far enough from the current log-probs, per token and per sequence, that clipping happens at both levels.
        "old_per_token_logps": logps + 0.4 * torch.randn(N, T, generator=gen) + 0.6 * torch.randn(N, 1, generator=gen),
        "ref_per_token_logps": logps + 0.3 * torch.randn(N, T, generator=gen),
        "logps": logps,
    }


def _trl_loss(
    inputs, loss_type, level, beta, bias_correction, eps_low, eps_high, sampling_weights=None, surrogate=None
):
    """TRL's `_compute_loss` on `inputs`; returns the loss, the gradient w.r.t. the log-probs, and its metrics.

    `sampling_weights` is passed as TRL's vLLM importance-sampling ratio, with its correction switched on;
    `surrogate` as TRL's config fields of the same names."""
    surrogate = surrogate or Surrogate()
    logps = inputs["logps"].clone().requires_grad_()
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=surrogate.off_policy_mask_threshold,
        get_off_policy_mask=TRLGRPOTrainer.get_off_policy_mask,
        get_gamma_weights=TRLGRPOTrainer.get_gamma_weights,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=sampling_weights is not None,
        vllm_importance_sampling_correction=sampling_weights is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        accelerator=_Accelerator(),
        args=SimpleNamespace(
            use_bias_correction_kl=bias_correction, steps_per_generation=1, **surrogate._asdict()
        ),  # fmt: skip
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    trl_inputs = {k: v for k, v in inputs.items() if k != "logps"}
    if beta == 0.0:
        del trl_inputs["ref_per_token_logps"]
    if sampling_weights is not None:
        trl_inputs["importance_sampling_ratio"] = sampling_weights
    if "engine_logps" in inputs:
        trl_inputs["sampling_per_token_logps"] = inputs["engine_logps"]
    trl_inputs.pop("engine_logps", None)
    loss = TRLGRPOTrainer._compute_loss(stand_in, None, trl_inputs)
    loss.backward()
    return loss.item(), logps.grad, {k: v[-1] for k, v in stand_in._metrics["train"].items()}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    if x.size(1) == 1:  # one value per completion
        return x.float().mean().item()
    return ((x.float() * mask).sum() / mask.sum()).item()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, bias_correction", [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type", CLIPPED_LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trl(loss_type, beta, bias_correction, level):
    inputs = _inputs(seed=zlib.crc32(f"{loss_type}{beta}{bias_correction}{level}".encode()))
    eps_low, eps_high = 0.2, 0.28
    trl_loss, trl_grad, trl_metrics = _trl_loss(inputs, loss_type, level, beta, bias_correction, eps_low, eps_high)

    logps = inputs["logps"].clone().requires_grad_()
    mask = inputs["completion_mask"]
    ours = policy_loss(
        logps,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        mask,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        importance_sampling_level=level,
        ref_logps_NT=inputs["ref_per_token_logps"],
        beta=beta,
        use_bias_correction_kl=bias_correction,
        max_completion_length=T,
        num_items=inputs["num_items_in_batch"],
    )
    ours.loss.backward()
    assert ours.loss.item() == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(logps.grad, trl_grad, atol=1e-6)

    clipped = clipped_fractions(ours.ratio, inputs["advantages"], eps_low, eps_high)
    for name in ("low", "high", "region"):
        assert _masked_mean(clipped[name], mask) == pytest.approx(trl_metrics[f"clip_ratio/{name}_mean"], abs=1e-6)
    assert trl_metrics["clip_ratio/region_mean"] > 0  # the inputs do exercise clipping
    if beta:
        assert _masked_mean(ours.kl_NT, mask) == pytest.approx(trl_metrics["kl"], abs=1e-6)
    else:
        assert ours.kl_NT is None and "kl" not in trl_metrics


@pytest.mark.parametrize("mode", IS_CORRECTION_MODES)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sampling_correction_loss_equals_trl(loss_type, mode):
    inputs = _inputs(seed=zlib.crc32(f"is{loss_type}{mode}".encode()))
    mask = inputs["completion_mask"]
    gen = torch.Generator().manual_seed(3)
    engine_logps = inputs["old_per_token_logps"] + 0.8 * torch.randn(N, T, generator=gen)
    weights = sampling_correction(inputs["old_per_token_logps"], engine_logps, mask, mode, clip_min=0.5, clip_max=2.0)
    assert weights.shape == ((N, 1) if mode.startswith("sequence") else (N, T))
    if mode.endswith("truncate"):
        assert weights.min() >= 0.5 and weights.max() <= 2.0 and (weights == 2.0).any()
    else:
        assert (weights == 0).any() and (weights[weights > 0] >= 0.5).all() and (weights <= 2.0).all()
    trl_loss, trl_grad, _ = _trl_loss(inputs, loss_type, "token", 0.04, True, 0.2, 0.2, sampling_weights=weights)

    logps = inputs["logps"].clone().requires_grad_()
    ours = policy_loss(
        logps,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        mask,
        loss_type=loss_type,
        ref_logps_NT=inputs["ref_per_token_logps"],
        beta=0.04,
        max_completion_length=T,
        num_items=inputs["num_items_in_batch"],
        sampling_weights=weights,
    )
    ours.loss.backward()
    assert ours.loss.item() == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(logps.grad, trl_grad, atol=1e-6)


def _our_loss(inputs, loss_type, level, beta, eps_low, eps_high, sampling_weights=None, surrogate=None):
    """colograd's `policy_loss` on the same inputs; returns the loss and the gradient w.r.t. the log-probs."""
    logps = inputs["logps"].clone().requires_grad_()
    out = policy_loss(
        logps,
        inputs["old_per_token_logps"],
        inputs["advantages"],
        inputs["completion_mask"],
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        importance_sampling_level=level,
        ref_logps_NT=inputs["ref_per_token_logps"],
        beta=beta,
        max_completion_length=T,
        num_items=inputs["num_items_in_batch"],
        sampling_weights=sampling_weights,
        surrogate=surrogate,
        sampling_logps_NT=inputs.get("engine_logps"),
    )
    out.loss.backward()
    return out.loss.item(), logps.grad


# Parameters away from TRL's defaults, so that each one shows in the numbers.
SURROGATES = {
    "cispo": Surrogate(),
    "sapo": Surrogate(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6),
    "vespo": Surrogate(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    "luspo": Surrogate(),
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", sorted(set(LOSS_TYPES) - set(CLIPPED_LOSS_TYPES)) + ["luspo"])
def test_newer_loss_types_equal_trl(loss_type, beta, level):
    inputs = _inputs(seed=zlib.crc32(f"new{loss_type}{beta}{level}".encode()))
    # cispo's epsilon_high is the cap of its weights (ScaleRL recommends 5); 1.3 caps some of these ratios.
    eps_high = 1.3 if loss_type == "cispo" else 0.28
    surrogate = SURROGATES[loss_type]
    trl_loss, trl_grad, trl_metrics = _trl_loss(inputs, loss_type, level, beta, True, 0.2, eps_high, None, surrogate)
    loss, grad = _our_loss(inputs, loss_type, level, beta, 0.2, eps_high, surrogate=surrogate)
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(grad, trl_grad, atol=1e-6)
    if loss_type == "cispo":
        assert trl_metrics["cispo_clip_ratio"] > 0  # the cap does bind on these inputs


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_vespo_folds_the_sampling_correction_into_its_weights_as_trl(mode):
    inputs = _inputs(seed=zlib.crc32(f"vespo{mode}".encode()))
    engine_logps = inputs["old_per_token_logps"] + 0.3 * torch.randn(N, T, generator=torch.Generator().manual_seed(5))
    weights = sampling_correction(inputs["old_per_token_logps"], engine_logps, inputs["completion_mask"], mode)
    trl_loss, trl_grad, _ = _trl_loss(inputs, "vespo", "token", 0.04, True, 0.2, 0.2, weights, Surrogate())
    loss, grad = _our_loss(inputs, "vespo", "token", 0.04, 0.2, 0.2, sampling_weights=weights)
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(grad, trl_grad, atol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_two_sided_clipping_equals_trl(loss_type, level):
    inputs = _inputs(seed=zlib.crc32(f"delta{loss_type}{level}".encode()))
    surrogate = Surrogate(delta=1.29)  # just above 1 + epsilon_high, so that it binds
    trl_loss, trl_grad, trl_metrics = _trl_loss(inputs, loss_type, level, 0.04, True, 0.2, 0.28, None, surrogate)
    loss, grad = _our_loss(inputs, loss_type, level, 0.04, 0.2, 0.28, surrogate=surrogate)
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(grad, trl_grad, atol=1e-6)
    without, _ = _our_loss(inputs, loss_type, level, 0.04, 0.2, 0.28)
    assert loss != pytest.approx(without, abs=1e-6)  # the cap binds on these inputs


@pytest.mark.parametrize("engine", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_off_policy_mask_equals_trl(loss_type, engine):
    inputs = _inputs(seed=zlib.crc32(f"opsm{loss_type}{engine}".encode()))
    if engine:  # the engine's log-probs are what the mask compares with when there are some
        inputs["engine_logps"] = inputs["old_per_token_logps"] + 0.2 * torch.randn(N, T)
    surrogate = Surrogate(off_policy_mask_threshold=0.1)
    trl_loss, trl_grad, _ = _trl_loss(inputs, loss_type, "token", 0.0, True, 0.2, 0.28, None, surrogate)
    loss, grad = _our_loss(inputs, loss_type, "token", 0.0, 0.2, 0.28, surrogate=surrogate)
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(grad, trl_grad, atol=1e-6)
    unmasked, _ = _our_loss(inputs, loss_type, "token", 0.0, 0.2, 0.28)
    assert loss != pytest.approx(unmasked, abs=1e-6)  # some completions are dropped on these inputs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_budget_passes_add_up_to_the_whole_loss(loss_type):
    """`micro_batch_tokens` splits a micro-step into passes whose scaled losses must sum to the micro-step's."""
    inputs = _inputs(seed=zlib.crc32(f"passes{loss_type}".encode()))
    mask = inputs["completion_mask"]
    batch = {"attention_mask": mask, "completion_mask": mask, "num_items": inputs["num_items_in_batch"],
             **{k: inputs[k] for k in ("advantages", "old_per_token_logps", "logps")}}  # fmt: skip

    def loss(part):
        return policy_loss(
            part["logps"],
            part["old_per_token_logps"],
            part["advantages"],
            part["completion_mask"],
            loss_type=loss_type,
            max_completion_length=T,
            num_items=part["num_items"],
        ).loss

    passes = split_by_tokens(batch, max_tokens=15, loss_type=loss_type)
    assert len(passes) > 2
    assert sum(loss(p) * p["loss_scale"] for p in passes).item() == pytest.approx(loss(batch).item(), abs=1e-6)


def test_sampling_correction_values():
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    engine = torch.log(torch.tensor([[0.25, 0.8, 0.9]]))
    mask = torch.tensor([[1, 1, 0]])
    tokens = sampling_correction(trainer, engine, mask, "token_truncate", clip_max=1.5)
    assert torch.allclose(tokens, torch.tensor([[1.5, 0.25, 1.0]]))
    assert torch.allclose(
        sampling_correction(trainer, engine, mask, "token_mask", clip_max=1.5), torch.tensor([[0.0, 0.25, 1.0]])
    )
    # The product of the counted tokens' ratios: 2 × 0.25.
    assert torch.allclose(sampling_correction(trainer, engine, mask, "sequence_truncate"), torch.tensor([[0.5]]))
    assert sampling_correction(trainer, engine, mask, "sequence_mask", clip_min=0.6).item() == 0.0


def _trl_advantages(
    rewards_NF: torch.Tensor, weights_F: torch.Tensor, scale_rewards: str, aggregation: str = "sum_then_normalize"
) -> torch.Tensor:
    """The advantages TRL's `_generate_and_score_completions` computes when its reward functions give `rewards_NF`.

    Call it with TRL's module-level `gather_object` made a one-process identity (see the test's monkeypatch).
    """
    n = rewards_NF.size(0)
    completion_ids = [[5, 6, 1] for _ in range(n)]
    stand_in = SimpleNamespace(
        accelerator=_Accelerator(),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None,
        environments=None,
        tools=None,
        # Generation is replaced: prompts and completions of fixed ids, no sampling log-probs.
        _generate=lambda prompts: ([[3, 4]] * n, completion_ids, None, ["x"] * n, None, {}, None, None),
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        args=SimpleNamespace(
            per_device_train_batch_size=n,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            gradient_checkpointing_kwargs=None,
        ),  # fmt: skip
        num_iterations=1,
        use_vllm=False,
        beta=0.0,
        _calculate_rewards=lambda *a: rewards_NF.clone(),
        num_generations=G,
        multi_objective_aggregation=aggregation,
        reward_weights=weights_F,
        scale_rewards=scale_rewards,
        reward_func_names=[f"f{j}" for j in range(rewards_NF.size(1))],
        reward_funcs=[None] * rewards_NF.size(1),  # only counted
        _metrics=defaultdict(lambda: defaultdict(list)),
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list),
        log_multimodal=False,
    )
    out = TRLGRPOTrainer._generate_and_score_completions(stand_in, [{"prompt": "x"}] * n)
    return out["advantages"]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards, monkeypatch):
    # One process: TRL's object gather (for its completion logs) returns this process's objects.
    monkeypatch.setattr(trl_grpo_trainer, "gather_object", lambda obj: obj)
    gen = torch.Generator().manual_seed(7)
    rewards_NF = torch.randn(N, 3, generator=gen)
    rewards_NF[0, 1] = rewards_NF[5, 0] = float("nan")  # a function abstained on a sample
    rewards_NF[6] = float("nan")  # every function abstained: unscorable
    rewards_NF[8:12, 0] = 1.0  # a group in which one function agrees everywhere
    weights_F = torch.tensor([1.0, 0.5, 2.0])
    expected = _trl_advantages(rewards_NF, weights_F, scale_rewards)
    ours = group_advantages(weighted_rewards(rewards_NF, weights_F), G, scale_rewards)
    assert torch.allclose(ours, expected, atol=1e-6)
    assert ours[6].item() == 0.0


def test_normalize_then_sum_advantages_equal_trl(monkeypatch):
    monkeypatch.setattr(trl_grpo_trainer, "gather_object", lambda obj: obj)
    gen = torch.Generator().manual_seed(11)
    rewards_NF = torch.randn(N, 3, generator=gen)
    rewards_NF[0, 1] = float("nan")
    rewards_NF[6] = float("nan")
    rewards_NF[8:12, 0] = 1.0
    weights_F = torch.tensor([1.0, 0.5, 2.0])
    expected = _trl_advantages(rewards_NF, weights_F, "group", "normalize_then_sum")
    ours = normalize_then_sum(rewards_NF, weights_F, G)
    assert torch.allclose(ours, expected, atol=1e-6)
    assert not torch.allclose(ours, group_advantages(weighted_rewards(rewards_NF, weights_F), G), atol=1e-3)


class _RankAccelerator(_Accelerator):
    """One process, as TRL's entropy code uses it: padding is an identity, `sync_gradients` is set by the test."""

    sync_gradients = True

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor


def _trl_entropy_stand_in(loss_type, quantile, coef, adaptive=None, accumulation=1):
    """A stand-in `self` for TRL's `_compute_loss` with its entropy options; `adaptive` is (target, delta, low,
    high) for adaptive control, None for a static coefficient."""
    target, delta, low, high = adaptive or (0.2, 0.005, 0.0, 1.0)
    accelerator = _RankAccelerator()
    stand_in = SimpleNamespace(
        aux_loss_enabled=False,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=T,
        accelerator=accelerator,
        args=SimpleNamespace(
            use_bias_correction_kl=True,
            steps_per_generation=accumulation,
            delta=None,
            entropy_target=target,
            entropy_coef_delta=delta,
            entropy_coef_min=low,
            entropy_coef_max=high,
        ),
        entropy_coef=coef,
        use_adaptive_entropy=adaptive is not None,
        _entropy_bonus_enabled=coef != 0.0 or adaptive is not None,
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    stand_in.get_high_entropy_mask = lambda *a: TRLGRPOTrainer.get_high_entropy_mask(stand_in, *a)
    return stand_in


def _trl_entropy_loss(stand_in, inputs, entropies):
    """TRL's `_compute_loss` of `inputs` whose forward gives `inputs["logps"]` and `entropies`; the loss and the
    gradients with respect to both."""
    logps = inputs["logps"].clone().requires_grad_()
    entropies = entropies.clone().requires_grad_()
    stand_in._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    trl_inputs = {k: v for k, v in inputs.items() if k not in ("logps", "ref_per_token_logps")}
    loss = TRLGRPOTrainer._compute_loss(stand_in, None, trl_inputs)
    loss.backward()
    return loss.item(), logps.grad, entropies.grad


def _entropy_config(quantile, coef, adaptive=None):
    target, delta, low, high = adaptive or (0.2, 0.005, 0.0, 1.0)
    return SimpleNamespace(
        top_entropy_quantile=quantile, entropy_coef=coef, use_adaptive_entropy=adaptive is not None,
        entropy_target=target, entropy_coef_delta=delta, entropy_coef_min=low, entropy_coef_max=high,
    )  # fmt: skip


def _our_entropy_loss(terms, inputs, entropies, loss_type):
    """colograd's composition, as `GRPOTrainer.compute_loss` does it: the mask into `policy_loss`, then the bonus.
    The completion mask has the tool mask folded in (`pad_rollout`)."""
    logps = inputs["logps"].clone().requires_grad_()
    entropies = entropies.clone().requires_grad_()
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    entropy_mask = terms.mask(entropies, mask)
    out = policy_loss(
        logps, inputs["old_per_token_logps"], inputs["advantages"], mask, loss_type=loss_type, epsilon_high=0.28,
        max_completion_length=T, num_items=inputs["num_items_in_batch"], entropy_mask_NT=entropy_mask,
    )  # fmt: skip
    loss = terms.regularize(out.loss, entropies, mask, entropy_mask, training=True)
    loss.backward()
    return loss.item(), logps.grad, entropies.grad


def _entropy_inputs(seed, scale=2.0):
    inputs = _inputs(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs["tool_mask"] = (torch.rand(N, T, generator=gen) > 0.2).long()  # some inserted tool-result tokens
    inputs["num_items_in_batch"] = (inputs["completion_mask"] * inputs["tool_mask"]).sum()
    return inputs, torch.rand(N, T, generator=gen) * scale


@pytest.mark.parametrize("quantile, coef", [(1.0, 0.0), (0.2, 0.0), (1.0, 0.05), (0.3, 0.05), (0.0, 0.0)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "cispo"])
def test_entropy_mask_and_bonus_equal_trl(loss_type, quantile, coef):
    inputs, entropies = _entropy_inputs(zlib.crc32(f"entropy{loss_type}{quantile}{coef}".encode()))
    stand_in = _trl_entropy_stand_in(loss_type, quantile, coef)
    trl_loss, trl_logps_grad, trl_entropy_grad = _trl_entropy_loss(stand_in, inputs, entropies)
    metrics = defaultdict(list)
    terms = EntropyTerms(_entropy_config(quantile, coef), _RankAccelerator(), lambda x: x, metrics)
    loss, logps_grad, entropy_grad = _our_entropy_loss(terms, inputs, entropies, loss_type)
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert torch.allclose(logps_grad, trl_logps_grad, atol=1e-6)
    if coef:
        assert torch.allclose(entropy_grad, trl_entropy_grad, atol=1e-7) and entropy_grad.abs().sum() > 0
    else:
        assert entropy_grad is None and trl_entropy_grad is None  # no bonus: the entropies carry no gradient
    trl_metrics = {k: v[-1] for k, v in stand_in._metrics["train"].items()}
    assert metrics.keys() - {"entropy", "entropy_coef", "policy_loss"} == set()
    for name, values in metrics.items():
        assert values[-1] == pytest.approx(trl_metrics[name], abs=1e-6), name
    if quantile < 1.0:  # the mask does bind: without it the loss differs
        unmasked = EntropyTerms(_entropy_config(1.0, coef), _RankAccelerator(), lambda x: x, defaultdict(list))
        assert loss != pytest.approx(_our_entropy_loss(unmasked, inputs, entropies, loss_type)[0], abs=1e-6)


def test_adaptive_entropy_coefficient_and_loss_follow_trl_step_by_step():
    # Two micro-steps per optimizer step; the entropy scale moves the step means below and above the target, so the
    # coefficient goes up, then down, and the bonus switches on and off.
    adaptive = (0.8, 0.05, 0.02, 0.12)  # target, delta, min, max
    stand_in = _trl_entropy_stand_in("grpo", 0.5, 0.1, adaptive, accumulation=2)
    metrics = defaultdict(list)
    accelerator = _RankAccelerator()
    terms = EntropyTerms(_entropy_config(0.5, 0.1, adaptive), accelerator, lambda x: x, metrics)
    coefs = []
    for step, scale in enumerate([1.0, 1.0, 1.0, 4.0, 4.0, 1.0]):
        for micro in range(2):
            inputs, entropies = _entropy_inputs(100 * step + micro, scale)
            accelerator.sync_gradients = stand_in.accelerator.sync_gradients = micro == 1
            trl_loss, trl_logps_grad, trl_entropy_grad = _trl_entropy_loss(stand_in, inputs, entropies)
            loss, logps_grad, entropy_grad = _our_entropy_loss(terms, inputs, entropies, "grpo")
            # TRL divides by the accumulation steps itself; colograd leaves that to the Trainer.
            assert loss / 2 == pytest.approx(trl_loss, abs=1e-6)
            assert torch.allclose(logps_grad / 2, trl_logps_grad, atol=1e-6)
            assert torch.allclose(entropy_grad / 2, trl_entropy_grad, atol=1e-7)
        assert terms.coef == pytest.approx(stand_in.entropy_coef, abs=1e-9)
        assert terms.last_entropy == pytest.approx(stand_in._last_world_entropy, abs=1e-6)
        coefs.append(terms.coef)
    assert metrics["entropy_coef"] == pytest.approx(stand_in._metrics["train"]["entropy_coef"], abs=1e-9)
    assert max(coefs) == 0.12 and min(coefs) < coefs[2]  # up to the cap, then down


def _forward_batch(seed: int) -> dict[str, torch.Tensor]:
    """A rollout of 4 completions of two 3-token prompts (equal lengths: TRL's forward passes no position ids)."""
    gen = torch.Generator().manual_seed(seed)
    completions = [torch.randint(2, 49, (n,), generator=gen).tolist() for n in (5, 2, 4, 5)]
    rollout = Rollout(completion_ids=completions, logps=[[0.0] * len(c) for c in completions], truncated=[False] * 4)
    return pad_rollout([[5, 6, 7], [8, 9, 10]], rollout, torch.zeros(4), 2, pad_token_id=0)


def _trl_fused(model, batch, temperature):
    """Log-probs and entropies [N, T] of the completions from TRL's own fused LM head, called as TRL's
    `_get_per_token_logps_and_entropies` calls it."""
    t = batch["completion_ids"].size(1)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, :-t] = -100
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                fused_lm_head=True)  # fmt: skip
    return out.log_probs[:, -t:], out.entropy[:, -t:]


@pytest.mark.parametrize("padding_free", [True, False])
def test_chunked_entropies_and_their_gradients_equal_trls_fused_head(padding_free):
    ours = tiny.build_model(seed=3)
    theirs = copy.deepcopy(ours)
    add_fused_lm_head(theirs, temperature=0.7, outputs=("log_probs", "entropy"))
    batch = _forward_batch(seed=4)
    mask = batch["completion_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))  # any downstream use

    logps, entropies = completion_logps(ours, batch, 0.7, padding_free, chunk_tokens=3, entropy="grad")
    trl_logps, trl_entropies = _trl_fused(theirs, batch, 0.7)
    assert torch.allclose(logps[mask], trl_logps[mask], atol=1e-5)
    assert torch.allclose(entropies[mask], trl_entropies[mask], atol=1e-5)
    ((entropies * weights)[mask].sum() + logps[mask].sum()).backward()
    ((trl_entropies * weights)[mask].sum() + trl_logps[mask].sum()).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name

    # Detached (for the metric and the mask): the same values, no gradient.
    _, detached = completion_logps(ours, batch, 0.7, padding_free, chunk_tokens=3, entropy="detached")
    assert torch.allclose(detached, entropies, atol=1e-6) and not detached.requires_grad


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_output_layer_equals_trls_cast_lm_head_to_fp32(tied):
    # A bfloat16 model. TRL casts its output layer to float32 and computes it outside autocast; colograd upcasts
    # the same bfloat16 weights at each chunk, so the log-probs and entropies are the same.
    ours = tiny.build_model(tie_word_embeddings=tied, seed=6).to(torch.bfloat16)
    theirs = copy.deepcopy(ours)
    # TRL's `_cast_lm_head_to_fp32`: the head (with a tied embedding, the shared weight) becomes float32, and a tied
    # embedding's outputs are cast back to the model's dtype.
    theirs.lm_head = theirs.lm_head.float()
    if tied:
        theirs.model.embed_tokens.register_forward_hook(lambda module, args, output: output.to(torch.bfloat16))
    add_fused_lm_head(theirs, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    batch = _forward_batch(seed=7)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        logps, entropies = completion_logps(ours, batch, padding_free=False, entropy="detached", fp32_head=True)
        trl_logps, trl_entropies = _trl_fused(theirs, batch, 1.0)
        bf16_logps = completion_logps(ours, batch, padding_free=False)
    assert torch.allclose(logps[mask], trl_logps[mask], atol=1e-5)
    assert torch.allclose(entropies[mask], trl_entropies[mask], atol=1e-5)
    assert (bf16_logps - logps)[mask].abs().max() > 1e-4  # a bfloat16 output layer does differ, by more
    # colograd's weights keep their dtype, so the engine (built in the first parameter's dtype) and the weight
    # sync see the same model with or without the option.
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


def test_lora_on_the_output_layer_with_fp32_head_is_refused():
    model = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match="lm_head"):
        completion_logps(model, _forward_batch(seed=8), fp32_head=True)


def _on_two_ranks(fn, per_rank: list) -> list:
    """Run `fn(inputs, gather)` as two ranks at once (threads), `gather` concatenating both ranks' tensors."""
    slots: list = [None, None]
    barrier = threading.Barrier(2)

    def gather_for(rank):
        def gather(x):
            slots[rank] = x
            barrier.wait()
            out = torch.cat(slots)
            barrier.wait()  # both have read before either writes again
            return out

        return gather

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda r: fn(per_rank[r], gather_for(r)), range(2)))


@pytest.mark.parametrize("aggregation, scale_rewards", [("sum_then_normalize", "batch"),
                         ("sum_then_normalize", "group"), ("sum_then_normalize", "none"),
                         ("normalize_then_sum", "group")])  # fmt: skip
def test_advantages_over_two_ranks_equal_trls_over_the_whole_batch(aggregation, scale_rewards, monkeypatch):
    # TRL gathers every rank's rewards: "batch" scaling and normalize_then_sum's last step span the whole batch.
    monkeypatch.setattr(trl_grpo_trainer, "gather_object", lambda obj: obj)
    gen = torch.Generator().manual_seed(13)
    rewards_NF = torch.randn(2 * N, 2, generator=gen)
    rewards_NF[N:] = rewards_NF[N:] * 3 + 1  # the second rank's rewards are spread wider
    rewards_NF[3, 1] = rewards_NF[N + 6] = float("nan")
    weights_F = torch.tensor([1.0, 0.5])
    expected = _trl_advantages(rewards_NF, weights_F, scale_rewards, aggregation)

    def advantages(rank_rewards_NF, gather):
        if aggregation == "normalize_then_sum":
            return normalize_then_sum(rank_rewards_NF, weights_F, G, gather)
        return group_advantages(weighted_rewards(rank_rewards_NF, weights_F), G, scale_rewards, gather)

    ours = torch.cat(_on_two_ranks(advantages, list(rewards_NF.chunk(2))))
    assert torch.allclose(ours, expected, atol=1e-6)
    # Each rank alone gets the same only where nothing spans the batch.
    per_rank = torch.cat([advantages(r, None) for r in rewards_NF.chunk(2)])
    batch_wide = scale_rewards == "batch" or aggregation == "normalize_then_sum"
    assert torch.allclose(per_rank, expected, atol=1e-6) != batch_wide
