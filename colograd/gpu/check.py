"""The GPU acceptance check: `python -m colograd.gpu.check` (or `make gpu-check`) on a machine with NVIDIA GPUs.

Every figure in the test suite comes from vLLM's CPU build; the CUDA build takes a different model runner.
This check runs the pieces a GPU run depends on, with the project's own engine and sync, and prints a table:

    sync parity fp32 / bf16   the engine's log-probs equal the trainer's after a sync (and differ before it), and
                              no engine tensor moved (captured CUDA graphs read the addresses they were built on)
    ... compiled              the same in the default engine mode: torch.compile and CUDA graphs
    sleep level 1 / 2         several sync → generate → sleep → wake cycles, parity after each wake
    MoE sync parity           a tiny Qwen3-MoE (8 experts, top 2): its expert layers' sync, compiled
    LoRA adapter / merged     adapter-only and merged sync parity (bf16 engine); generation with and without it
    LoRA sleep kv_cache / 1 / 2   adapter-only engines: base kept in place (the default), to host and back, or
                              dropped and re-sent by the sync; timed
    tiny recipe               recipes/grpo_tiny.yaml for a few dozen steps: the reward rises, the gap stays small
    partial rollouts, dynamic sampling, vision-language
                              the tiny recipes with that feature, compiled engine: the gap stays small every step
    segment attention         the varlen kernel of padding-free passes: shared prompts train as unshared SDPA
    tensor parallel 2         one engine over two GPUs (two processes), when there are two

Each row that builds an engine runs in a fresh interpreter (`python -m colograd.gpu.check --row NAME --json OUT`,
run and read back by `colograd.gpu.runner`):
vLLM never gives an engine's GPU memory back inside a process, and its sleep-mode allocator refuses a second
engine in one. Parity is measured as in tests/engine/test_engine.py: the engine's prompt log-probs of a token sequence
against `log_softmax` of the trainer's logits. Without a GPU the check says so in one line and exits 1.
"""

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from colograd.config.core import GRPOConfig
from colograd.engine.core import Engine
from colograd.engine.launch import free_port
from colograd.engine.requests import Sampling, sampling_params
from colograd.engine.sync import WeightPlan
from colograd.gpu.runner import ROW_TIMEOUT_S, Result, format_table, read_result, run_child, write_result
from colograd.models import tiny

# Largest engine/trainer log-prob gap accepted: fp32 differs only by kernel order; bf16 rounds every layer.
TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}
# A sync that did not reach the engine leaves a gap at least this large after the weights move.
STALE = 1e-2
CYCLES = 3
# A sleep gives back at least this share of the KV cache the engine was given (vLLM allocates whole blocks).
KV_FREED = 0.9
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tiny.yaml"
RECIPE_STEPS = 60
# The tiny recipe's reward starts near 0.05; a working loop lifts the mean of the last 10 steps this far above
# the first 10 within RECIPE_STEPS (one process, measured on CPU: 0.04 → 0.28).
REWARD_RISE = 0.1


@dataclass
class Setup:
    """What every check builds its engine from: a model factory (fresh weights each call) and a tokenizer."""

    build: Callable[[], nn.Module]
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    prompts: int = 64  # prompts per timed rollout (× 8 completions)
    repeats: int = 3  # timed rollouts per figure (the median is reported), after one untimed
    sync_goal_ms: float | None = None  # the sync time a GPU should reach with this model, shown beside it


def trainer_logprobs(model: nn.Module, ids: list[int], autocast: torch.dtype | None = None) -> torch.Tensor:
    """The trainer's log-prob of each token of `ids` given the ones before: shape [len - 1], float32, on CPU.

    Args:
        autocast: compute under autocast in this dtype, as a `bf16: true` run trains.
    """
    device = next(model.parameters()).device
    context = torch.autocast(device.type, dtype=autocast) if autocast else nullcontext()
    with torch.no_grad(), context:
        logits = model(torch.tensor([ids], device=device)).logits[0, :-1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
    return logps.cpu()


def parity_gap(engine: Engine, model: nn.Module, ids: list[int], autocast: torch.dtype | None = None) -> float:
    """Largest |engine log-prob − trainer log-prob| over the tokens of `ids`."""
    return (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids, autocast)).abs().max().item()


def engine_args(output_dir: str, compiled: bool = False, **overrides) -> GRPOConfig:
    """A small engine: 8 completions of up to 32 tokens per prompt, eager mode (no CUDA-graph capture) unless
    `compiled` (the default engine mode of a run: torch.compile and CUDA graphs).

    The KV cache is left to the engine's own sizing (what a run gets by default: room for the rollout), so the
    sync and sleep figures are those of a run.
    """
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=8,
        max_prompt_length=32,
        max_completion_length=32,
        vllm_max_num_seqs=512,
        vllm_enforce_eager=not compiled,
        report_to="none",
    )
    return GRPOConfig(output_dir=output_dir, **{**settings, **overrides})


def move(model: nn.Module, lora_only: bool = False, scale: float = 0.05, seed: int = 0) -> None:
    """Change every trained tensor (every adapter tensor with `lora_only`), as an optimizer step does, by the
    same steps for the same `seed` (a check's figures do not depend on what ran before it in the process)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not lora_only or "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator).to(p) * scale)


def lora(model: nn.Module) -> nn.Module:
    """`model` with rank-8 LoRA on every linear layer and non-zero B, so that the adapter changes the outputs.

    The adapter moves log-probs by 0.5–1.0 while the bf16 rounding stays near 0.01 (measured on the tiny model
    over four seeds). At 5× the scale the adapter multiplies every layer's activations about tenfold, and bf16
    rounding alone reached 0.2, past the bf16 tolerance, with an fp32 engine exact to 5e-7 on the same weights.
    """
    from peft import LoraConfig, get_peft_model

    model = _seeded(lambda: get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")))
    move(model, lora_only=True, scale=0.1, seed=1234)
    return model


def check_sync(setup: Setup, dtype: str, compiled: bool = False, name: str | None = None) -> Result:
    """Sync parity for an fp32 or bf16 engine (bf16: the trainer computes under bf16 autocast, as `bf16: true`),
    and the engine's tensors where they were: a sync that put a weight into new memory would leave a compiled
    engine's CUDA graphs reading the old one."""
    name = name or f"sync parity {dtype}" + (" compiled" if compiled else "")
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    model = setup.build().eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        engine = Engine(model, setup.tokenizer, engine_args(out, compiled, bf16=autocast is not None))
        plan = WeightPlan(model)
        plan.sync(engine)
        first = parity_gap(engine, model, ids, autocast)
        before = engine_addresses(engine)
        move(model)
        stale = parity_gap(engine, model, ids, autocast)
        seconds = _median_seconds(lambda: plan.sync(engine))
        after = parity_gap(engine, model, ids, autocast)
        moved = moved_tensors(before, engine_addresses(engine)) if engine.direct_load else []
    ok = max(first, after) <= TOLERANCE[dtype] and stale > STALE and not moved
    kv_gib = engine.kv_cache_bytes / 2**30
    goal = f" (goal ≤ {setup.sync_goal_ms:g} ms)" if setup.sync_goal_ms else ""
    detail = (
        f"gap {first:.1e} / {after:.1e} (≤ {TOLERANCE[dtype]:.0e}), stale {stale:.1e}; "
        f"sync {seconds * 1e3:.2f} ms{goal} for {plan.nbytes / 2**20:.1f} MiB ({plan.nbytes / seconds / 1e9:.1f} "
        f"GB/s); KV cache {kv_gib:.2f} GiB; {addresses_detail(moved, engine.direct_load)}"
    )
    figures = {"gap": max(first, after), "stale": stale, "sync_ms": seconds * 1e3, "kv_cache_gib": kv_gib,
               "moved_tensors": len(moved)}  # fmt: skip
    return Result(name, "pass" if ok else "FAIL", detail, figures)


def engine_addresses(engine: Engine) -> dict[str, int]:
    """Where each of the engine's parameters and buffers lives (`data_ptr`), read in its worker."""
    return engine.in_workers(_addresses_in_worker)[0]


def _addresses_in_worker(worker: object) -> dict[str, int]:
    model = worker.model_runner.model
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tensor.data_ptr() for name, tensor in tensors}


def moved_tensors(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The engine tensors whose memory changed between two reads (or that appeared or went)."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def addresses_detail(moved: list[str], direct: bool) -> str:
    if not direct:
        return "addresses not compared (the engine re-processes loaded weights: CPU repacking)"
    if not moved:
        return "every engine tensor kept its address"
    return f"{len(moved)} engine tensors moved (compiled graphs would read the old ones): {', '.join(moved[:3])}"


def check_sleep(setup: Setup, level: int, compiled: bool = False) -> Result:
    """Several rollouts through `Engine.awake` with an engine built to sleep at `level` between them; the engine's
    tensors must wake where they slept (vLLM maps the same addresses back)."""
    model = setup.build().eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        args = engine_args(out, compiled, vllm_enable_sleep_mode=True)
        engine = Engine(model, setup.tokenizer, args, sleep_level=level)
        plan = WeightPlan(model)
        before = engine_addresses(engine)

        def update_and_sync() -> None:  # an optimizer step, then the rollout's sync once the weights are back
            move(model)
            plan.sync(engine)

        def rollout() -> float:
            engine.generate([ids[:8]], Sampling.of(args))
            return parity_gap(engine, model, ids)

        gaps, freed = sleep_cycles(engine, update_and_sync, rollout)
        moved = moved_tensors(before, engine_addresses(engine)) if engine.direct_load else []
    name = f"sleep level {level}" + (" compiled" if compiled else "")
    result = sleep_result(name, gaps, freed, engine.kv_cache_bytes, TOLERANCE["float32"])
    result.detail += f"; {addresses_detail(moved, engine.direct_load)}"
    result.status = "FAIL" if moved else result.status
    return result


def sleep_cycles(
    engine: Engine, sync: Callable[[], object], rollout: Callable[[], float], cycles: int = CYCLES
) -> tuple[list[float], list[int]]:
    """`cycles` rollouts as training runs them (the weights memory back, `sync`, then `engine.awake`), measuring the
    GPU memory each sleep gives back.

    The engine is asleep between rollouts (it starts asleep), so the memory it holds is seen only inside
    `awake`: freed = free memory after the block (asleep again) − free memory inside it (awake, after the
    rollout).

    Args:
        rollout: generates and returns the parity gap of the woken engine.

    Returns:
        The gap after each wake, and the bytes each sleep freed.
    """
    gaps, freed = [], []
    for _ in range(cycles):
        engine.wake_weights()
        sync()
        with engine.awake():
            gaps.append(rollout())
            _synchronize()
            inside = _free_bytes()
        _synchronize()
        freed.append(_free_bytes() - inside)
    return gaps, freed


def sleep_result(name: str, gaps: list[float], freed: list[int], kv_cache_bytes: int, tolerance: float) -> Result:
    """A sleep row: parity within `tolerance` after every wake, and every sleep gave back the KV cache at least."""
    least = min(freed) / 2**30
    ok = max(gaps) <= tolerance and least >= KV_FREED * kv_cache_bytes / 2**30
    detail = (
        f"{len(gaps)} cycles, gap max {max(gaps):.1e} (≤ {tolerance:.0e}); sleeping frees "
        f"{statistics.median(freed) / 2**30:.2f} GiB (least {least:.2f}; KV cache {kv_cache_bytes / 2**30:.2f} GiB)"
    )
    figures = {"gap": max(gaps), "freed_gib": statistics.median(freed) / 2**30, "kv_cache_gib": kv_cache_bytes / 2**30}
    return Result(name, "pass" if ok else "FAIL", detail, figures)


def check_lora(setup: Setup, merged: bool = False) -> Result:
    """Adapter-only (or `merged`: the adapter merged into the weights the engine gets) sync parity after two adapter
    updates, and generation speed with and without the adapter.

    The engine is bf16 (the trainer under bf16 autocast), as training with an adapter on a GPU runs: vLLM's
    GPU LoRA kernels take fp16 / bf16 activations only.
    """
    if merged:
        return check_lora_merged(setup)
    model = lora(setup.build()).eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        args = engine_args(out, bf16=True)
        engine = Engine(model, setup.tokenizer, args, lora_rank=8)
        gaps, adapter_effect = adapter_cycles(engine, model, WeightPlan(model, adapter_only=True), ids)
        prompts = [_sample_ids(setup, seed=i)[:16] for i in range(setup.prompts)]
        with_adapter = _tokens_per_second(engine, prompts, args, setup.repeats)
        without = _tokens_per_second(engine, prompts, args, setup.repeats, adapter=False)
    tolerance = TOLERANCE["bfloat16"]
    ok = max(gaps) <= tolerance and adapter_effect > tolerance
    detail = (
        f"bf16 gap max {max(gaps):.1e} (≤ {tolerance:.0e}), adapter effect {adapter_effect:.1e}; generation "
        f"{with_adapter:,.0f} tok/s with the adapter, {without:,.0f} without ({with_adapter / without:.2f}×)"
    )
    figures = {"gap": max(gaps), "adapter_effect": adapter_effect, "tok_s_adapter": with_adapter, "tok_s": without}
    return Result("LoRA adapter", "pass" if ok else "FAIL", detail, figures)


def check_lora_merged(setup: Setup) -> Result:
    """LoRA trained, the adapter merged into the weights each sync sends (`lora_sync: merged`): parity after two
    adapter updates, on a plain bf16 engine."""
    model = lora(setup.build()).eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        engine = Engine(model, setup.tokenizer, engine_args(out, bf16=True))
        gaps, adapter_effect = adapter_cycles(engine, model, WeightPlan(model), ids)
    tolerance = TOLERANCE["bfloat16"]
    ok = max(gaps) <= tolerance and adapter_effect > tolerance
    detail = f"bf16 gap max {max(gaps):.1e} (≤ {tolerance:.0e}), adapter effect {adapter_effect:.1e}"
    return Result("LoRA merged", "pass" if ok else "FAIL", detail, {"gap": max(gaps)})


def adapter_cycles(engine: Engine, model: nn.Module, plan: WeightPlan, ids: list[int]) -> tuple[list[float], float]:
    """Two syncs of a LoRA model, the adapter moved after each: the bf16 gap after each, and how far the engine's
    log-probs are from the base model's (the adapter must matter for the gap to mean anything)."""
    gaps = []
    for cycle in range(2):
        plan.sync(engine)
        gaps.append(parity_gap(engine, model, ids, torch.bfloat16))
        move(model, lora_only=True, seed=1 + cycle)
    with model.disable_adapter():
        base = trainer_logprobs(model, ids, torch.bfloat16)
    return gaps, (base - engine.prompt_logprobs(ids)).abs().max().item()


def check_lora_sleep(setup: Setup, level: int | str) -> Result:
    """An adapter-only bf16 engine that sleeps at `level` between rollouts, through `Engine.awake` as in training:
    `kv_cache` (the default) keeps the frozen base in place and releases the KV cache only; level 1 keeps the base
    by copying it to host and back at every rollout; level 2 drops it and the sync re-sends it (a plan sends the
    base again whenever the engine is stale). Times sleep + wake + sync, parity after every cycle."""
    model = lora(setup.build()).eval()
    ids = _sample_ids(setup)
    seconds, gaps = [], []
    with tempfile.TemporaryDirectory() as out:
        args = engine_args(out, bf16=True, vllm_enable_sleep_mode=True)
        engine = Engine(model, setup.tokenizer, args, lora_rank=8, sleep_level=level)
        plan = WeightPlan(model, adapter_only=True)
        for cycle in range(CYCLES + 1):  # the first cycle brings the base in and is not timed
            move(model, lora_only=True, seed=1 + cycle)
            _synchronize()
            start = time.perf_counter()
            engine.wake_weights()
            plan.sync(engine)
            with engine.awake():
                _synchronize()
                woken = time.perf_counter() - start
                gaps.append(parity_gap(engine, model, ids, torch.bfloat16))
                _synchronize()
                leaving = time.perf_counter()
            _synchronize()  # `awake` put the engine back to sleep at `level`
            if cycle:
                seconds.append(woken + time.perf_counter() - leaving)
    tolerance, ms = TOLERANCE["bfloat16"], statistics.median(seconds) * 1e3
    what = "sleep+wake+sync of the base and adapter" if level == 2 else "sleep+wake+sync"
    detail = f"bf16 gap max {max(gaps):.1e} (≤ {tolerance:.0e}); {what} {ms:.1f} ms"
    status = "pass" if max(gaps) <= tolerance else "FAIL"
    return Result(lora_sleep_row(level), status, detail, {"gap": max(gaps), "cycle_ms": ms})


def lora_sleep_row(level: int | str) -> str:
    return f"LoRA sleep {level}" if isinstance(level, str) else f"LoRA sleep level {level}"


def check_tiny_recipe(
    steps: int = RECIPE_STEPS,
    recipe: Path = RECIPE,
    flags: tuple[str, ...] = (),
    name: str = "tiny recipe",
    rise: float | None = REWARD_RISE,
) -> Result:
    """Train `recipe` (recipes/grpo_tiny.yaml) for `steps` steps in this process, as `colograd/train.py` does, with
    further command-line `flags`.

    Passes when the mean reward of the last 10 steps is `rise` above the first 10 (None: not compared) and the
    sampling gap (`sampling/sampling_logp_difference/max`, fp32) stays within the fp32 tolerance at every step.
    """
    from trl import ModelConfig, TrlParser

    from colograd import GRPOTrainer, ScriptArguments
    from colograd.preflight.core import preflight
    from colograd.train import load_model, load_model_config

    with tempfile.TemporaryDirectory() as out:
        flags = [
            "--config",
            str(recipe),
            "--max_steps",
            str(steps),
            "--output_dir",
            out,
            "--report_to",
            "none",
            *flags,
        ]
        parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
        script_args, args, model_args = parser.parse_args_and_config(flags)
        config, tokenizer, dtype = load_model_config(model_args, args)
        inputs = preflight(script_args, args, config, tokenizer, dtype)
        model, tokenizer = load_model(model_args, args)
        trainer = GRPOTrainer(
            model=model, reward_funcs=inputs.reward_funcs, args=args, train_dataset=inputs.dataset,
            processing_class=tokenizer,
        )  # fmt: skip
        trainer.train()
    return recipe_result(trainer.state.log_history, trainer.engine.kv_cache_bytes, name, rise)


def recipe_result(
    log_history: list[dict[str, float]],
    kv_cache_bytes: int,
    name: str = "tiny recipe",
    rise: float | None = REWARD_RISE,
) -> Result:
    """The tiny-recipe row from the trainer's per-step logs (`logging_steps: 1`): the mean reward of the last 10
    steps against the first 10 (of the last and first half, in a run of fewer than 20 steps)."""
    steps = [entry for entry in log_history if "loss" in entry]
    if len(steps) < 2:
        return Result(name, "FAIL", f"{len(steps)} steps logged, 2 at least needed to compare rewards")
    window = min(10, len(steps) // 2)
    first = statistics.mean(entry["reward"] for entry in steps[:window])
    last = statistics.mean(entry["reward"] for entry in steps[-window:])
    gaps = [entry.get("sampling/sampling_logp_difference/max", float("nan")) for entry in steps]
    gap = max((g for g in gaps if g == g), default=float("nan"))  # NaN where a step logged no gap
    step_s = statistics.median(sum(v for k, v in entry.items() if k.startswith("time/")) for entry in steps)
    sync_ms = statistics.median(entry.get("time/sync", 0.0) for entry in steps) * 1e3
    tolerance = TOLERANCE["float32"]
    ok = (rise is None or last - first >= rise) and gap <= tolerance
    detail = (
        f"reward {first:.2f} → {last:.2f} (first / last {window} of {len(steps)} steps), gap max {gap:.1e} "
        f"(≤ {tolerance:.0e}); KV cache {kv_cache_bytes / 2**30:.2f} GiB; {step_s:.3f} s/step, "
        f"sync {sync_ms:.2f} ms/step (medians)"
    )
    figures = {"reward_first": first, "reward_last": last, "gap": gap, "kv_cache_gib": kv_cache_bytes / 2**30,
               "step_s": step_s, "sync_ms": sync_ms}  # fmt: skip
    return Result(name, "pass" if ok else "FAIL", detail, figures)


def check_moe_replay(setup: Setup, steps: int = 8) -> Result:
    """A small Qwen3-MoE (`colograd.bench.shapes.MOE_SHAPE`: 4 layers, 8 experts, 2 per token) trained `steps` GRPO
    steps on the letters task in bf16 with `routing_replay: rollout` on a compiled engine, so every pass routes as the
    engine did (on a GPU through vLLM's own route, `enable_return_routed_experts`). Passes when the engine reported
    every routing choice (`moe/routing_replay/unreplayed` 0 at every step), replay had work to do (`differed` above 0
    at some step: the trainer's routers alone would have chosen otherwise) and the sampling gap stays within the bf16
    tolerance at every step."""
    from colograd import GRPOTrainer
    from colograd.bench.shapes import build_moe_model

    name, tokenizer = "MoE routing replay", tiny.build_tokenizer()
    model = build_moe_model(len(tokenizer), 16 + 8)
    with tempfile.TemporaryDirectory() as out:
        args = tiny.run_config(out, steps, bf16=True, routing_replay="rollout", vllm_enforce_eager=False,
                               vllm_importance_sampling_correction=True, logging_steps=1)  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=tiny.letters_reward, args=args,
                              train_dataset=tiny.letters_dataset(256), processing_class=tokenizer)  # fmt: skip
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    if not logged:
        return Result(name, "FAIL", "no step logged")
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in logged]
    differed = [entry["moe/routing_replay/differed"] for entry in logged]
    unreplayed = [entry["moe/routing_replay/unreplayed"] for entry in logged]
    tolerance = TOLERANCE["bfloat16"]
    ok = max(gaps) <= tolerance and max(unreplayed) == 0 and max(differed) > 0
    detail = (
        f"{len(logged)} steps, bf16 gap max {max(gaps):.1e} (≤ {tolerance:.0e}); routing choices the trainer would "
        f"have made otherwise {min(differed):.1%} to {max(differed):.1%} (above 0), unreported {max(unreplayed):.1%}"
    )
    figures = {"gap": max(gaps), "gaps": gaps, "differed": differed, "unreplayed": unreplayed}
    return Result(name, "pass" if ok else "FAIL", detail, figures)


def check_segments(setup: Setup) -> Result:
    """Padding-free passes as segments (`colograd.forward.attention`): which varlen kernel this GPU runs, and a pass
    with shared prompts against SDPA's unshared packing, in float32 and under bf16 autocast: the largest log-prob gap
    and the largest gradient difference relative to the gradient's largest value."""
    from colograd.bench.sharing import grouped_batch
    from colograd.forward import attention
    from colograd.forward.logps import PromptSharing, completion_logps
    from colograd.forward.packing import segment_kernel

    name, figures, parts = "segment attention", {}, []
    model = setup.build().train()
    switched = copy.deepcopy(model)
    attention.install(switched)
    batch = grouped_batch(model.config.vocab_size, 4, 60, 8, 48, shortest_prompt=5)  # prompts of 5 to 60 tokens
    batch = {k: v.to(setup.device) for k, v in batch.items()}
    mask = batch["completion_mask"].bool()
    for dtype, autocast in (("float32", None), ("bfloat16", torch.bfloat16)):
        kernel = segment_kernel(model, setup.device, autocast or torch.float32)
        if kernel is None:
            return Result(name, "FAIL", f"no varlen kernel runs here in {dtype}")
        outs = []
        for net, kwargs in ((model, {}), (switched, {"share_prompts": PromptSharing(0.0), "segments": kernel})):
            net.zero_grad()
            with torch.autocast(setup.device.type, autocast) if autocast else nullcontext():
                logps = completion_logps(net, batch, padding_free=True, **kwargs)
            (logps * mask).sum().backward()
            outs.append((logps.detach(), torch.cat([p.grad.flatten() for p in net.parameters()])))
        gap = (outs[0][0] - outs[1][0])[mask].abs().max().item()
        grad = ((outs[0][1] - outs[1][1]).abs().max() / outs[0][1].abs().max()).item()
        figures |= {f"gap_{dtype}": gap, f"grad_{dtype}": grad}
        parts.append(f"{dtype} {kernel}: gap {gap:.1e} (≤ {TOLERANCE[dtype]:.0e}), grad {grad:.1e}")
    ok = all(figures[f"gap_{d}"] <= TOLERANCE[d] and figures[f"grad_{d}"] <= 10 * TOLERANCE[d] for d in TOLERANCE)
    return Result(name, "pass" if ok else "FAIL", "; ".join(parts), figures)


def check_tensor_parallel() -> Result:
    """One engine over two GPUs: two processes (torchrun), each syncs its trainer's weights and checks parity."""
    name = "tensor parallel 2"
    if torch.cuda.device_count() < 2:
        return Result(name, "skip", f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")

    with tempfile.TemporaryDirectory() as out:

        def read() -> Result:  # each rank's gap, once both have ended
            gaps = []
            for rank in (0, 1):
                with open(os.path.join(out, f"rank{rank}.json")) as f:
                    gaps.append(json.load(f)["gap"])
            ok = max(gaps) <= TOLERANCE["float32"]
            return Result(name, "pass" if ok else "FAIL", f"gap per rank {gaps[0]:.1e} / {gaps[1]:.1e}")

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "colograd.gpu.check", "--tp-worker", out]  # fmt: skip
        return run_child(name, cmd, read)


def tensor_parallel_worker(out: str) -> None:
    """One of the two processes of `check_tensor_parallel` (run under torchrun)."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    setup = tiny_setup(torch.device("cuda"))
    model = setup.build().eval()  # the same seed on both ranks: the same weights
    engine = Engine(model, setup.tokenizer, engine_args(out, vllm_tensor_parallel_size=2))
    WeightPlan(model).sync(engine)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"gap": parity_gap(engine, model, _sample_ids(setup))}, f)


def tiny_setup(device: torch.device) -> Setup:
    """The built-in tiny Qwen2 (no download): a check of the machinery, not of speed. Its sync on a GPU is a
    1.3 MiB copy through vLLM's weight loaders (~1 ms measured on an H100), hence the goal."""
    goal = 2.0 if device.type == "cuda" else None
    return Setup(lambda: _seeded(tiny.build_model).to(device), tiny.build_tokenizer(), device, sync_goal_ms=goal)


def moe_setup(device: torch.device) -> Setup:
    """A tiny Qwen3-MoE over the tiny tokenizer: 8 experts, 2 routed per token, normalised top-k (Qwen3-30B-A3B's
    routing), 2 layers of 4 query and 2 key-value heads of 32: what the engine's fused-expert sync must get right."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    text = tiny.model_config()
    config = Qwen3MoeConfig(
        vocab_size=text.vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=text.pad_token_id, eos_token_id=text.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return Setup(lambda: _seeded(lambda: Qwen3MoeForCausalLM(config)).to(device), tiny.build_tokenizer(), device)


def _seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """`build()` with torch's generator at `seed`, and left as it was: the same weights whatever ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def model_setup(name: str, device: torch.device) -> Setup:
    """A model from a local folder or the Hub, loaded in float32 (the trainer's weights; bf16 by autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return Setup(
        lambda: AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(device),
        AutoTokenizer.from_pretrained(name),
        device,
    )


# The training rows' flags: the engine in its default mode (compiled, CUDA graphs), and the feature.
_COMPILED = ("--vllm_enforce_eager", "false")
_RECIPE_ROWS = {
    "partial rollouts": (RECIPE, ("--partial_rollouts", "true")),
    "dynamic sampling": (RECIPE, ("--dynamic_sampling", "true")),
    "vision-language": (RECIPE.with_name("grpo_tiny_vlm.yaml"), ()),
}


def recipe_row(name: str, setup: Setup) -> Result:
    """A `_RECIPE_ROWS` row: its recipe with its flags for 24 steps on a compiled engine; the gap is what it checks
    (the recipe names its own model)."""
    recipe, flags = _RECIPE_ROWS[name]
    return check_tiny_recipe(24, recipe, (*_COMPILED, *flags), name, rise=None)


_LORA_SLEEP_ROWS = ("LoRA sleep kv_cache", "LoRA sleep level 1", "LoRA sleep level 2")

# The rows that build an engine, each run in a process of its own (`run_row`), in this order.
ROWS: dict[str, Callable[[Setup], Result]] = {
    "sync parity float32": lambda setup: check_sync(setup, "float32"),
    "sync parity bfloat16": lambda setup: check_sync(setup, "bfloat16"),
    "sync parity bfloat16 compiled": lambda setup: check_sync(setup, "bfloat16", compiled=True),
    "sleep level 1": lambda setup: check_sleep(setup, 1),
    "sleep level 2": lambda setup: check_sleep(setup, 2),
    "sleep level 2 compiled": lambda setup: check_sleep(setup, 2, compiled=True),
    "MoE sync parity": lambda setup: check_sync(moe_setup(setup.device), "float32", True, "MoE sync parity"),
    "MoE routing replay": check_moe_replay,
    "LoRA adapter": check_lora,
    "LoRA merged": lambda setup: check_lora(setup, merged=True),
    "LoRA sleep kv_cache": lambda setup: check_lora_sleep(setup, "kv_cache"),
    "LoRA sleep level 1": lambda setup: check_lora_sleep(setup, 1),
    "LoRA sleep level 2": lambda setup: check_lora_sleep(setup, 2),
    "tiny recipe": lambda setup: check_tiny_recipe(),  # the recipe names its own model
    **{name: functools.partial(recipe_row, name) for name in _RECIPE_ROWS},
    "segment attention": check_segments,  # no engine: in its own process all the same
}


def run_row(name: str, model: str | None = None, allow_cpu: bool = False, timeout: float = ROW_TIMEOUT_S) -> Result:
    """Run the row `name` of `ROWS` in a fresh interpreter (`row_child`) and read its result back (`run_child`)."""
    with tempfile.TemporaryDirectory(prefix="colograd-check-") as out:
        path = os.path.join(out, "row.json")
        cmd = [sys.executable, "-m", "colograd.gpu.check", "--row", name, "--json", path]
        cmd += (["--model", model] if model else []) + (["--allow-cpu"] if allow_cpu else [])
        return run_child(name, cmd, lambda: read_result(path), timeout)


def row_child(name: str, out: str, model: str | None) -> None:
    """The child side of `run_row`: the free GPU memory at its start, the row, the result as JSON into `out`."""
    free_gib = _free_bytes() / 2**30 if torch.cuda.is_available() else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = model_setup(model, device) if model else tiny_setup(device)
    result = ROWS[name](setup)
    result.free_gib = free_gib
    write_result(result, out)


def run_checks(model: str | None = None, run: Callable[[str], Result] | None = None) -> list[Result]:
    """Every row in turn, each engine row in its own process (`run_row`), then tensor parallelism.

    Args:
        model: `--model`, passed to every engine row.
        run: runs one row by name; `run_row` with `model` when None.
    """
    run = run or functools.partial(run_row, model=model)
    results = []
    for name in ROWS:
        results.append(run(name))
        print(f"{results[-1].status:>4}  {name}", flush=True)
    results.append(check_tensor_parallel())
    print(f"{results[-1].status:>4}  {results[-1].name}", flush=True)
    compare_lora_sleep(results)
    return results


def compare_lora_sleep(results: list[Result]) -> None:
    """Name the fastest LoRA sleep level in the last LoRA sleep row, against the next fastest, when at least two
    rows passed (each ran in its own process)."""
    rows = {r.name: r for r in results if r.status == "pass" and r.name in _LORA_SLEEP_ROWS}
    if len(rows) < 2:
        return
    ranked = sorted(rows, key=lambda name: rows[name].figures["cycle_ms"])
    if rows[ranked[0]].figures["cycle_ms"] <= 0:
        return
    ratio = rows[ranked[1]].figures["cycle_ms"] / rows[ranked[0]].figures["cycle_ms"]
    last = [name for name in _LORA_SLEEP_ROWS if name in rows][-1]
    rows[last].detail += f": {ranked[0].removeprefix('LoRA sleep ')} is {ratio:.2f}× faster than the next"


def _sample_ids(setup: Setup, seed: int = 0, length: int = 24) -> list[int]:
    """A fixed token sequence: random ids from the tokenizer's vocabulary, special ids left out."""
    generator = torch.Generator().manual_seed(seed)
    special = set(setup.tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(setup.tokenizer), 5000)) if i not in special]
    return [vocab[i] for i in torch.randint(len(vocab), (length,), generator=generator).tolist()]


def _tokens_per_second(
    engine: Engine, prompts: list[list[int]], args: GRPOConfig, repeats: int, adapter: bool = True
) -> float:
    """Generated tokens per second over a rollout's requests (each prompt × G, no log-probs; `adapter=False`: the
    base weights alone), median of `repeats`, after one warm-up."""
    requests = engine.requests(adapter=adapter)
    batch, params = [engine.prompt(ids) for ids in prompts], sampling_params(args, logprobs=None)
    requests.generate(batch, params)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = requests.generate(batch, params)
        rates.append(sum(len(s.token_ids) for o in outputs for s in o.outputs) / (time.perf_counter() - start))
    return statistics.median(rates)


def _median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_bytes() -> int:
    """The GPU memory free on this process's device, as the driver counts it (other processes' use included)."""
    return torch.cuda.mem_get_info()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colograd.gpu.check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder or hub id to check with instead of the tiny model")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # one row, in this process
    parser.add_argument("--json", metavar="OUT", help=argparse.SUPPRESS)  # where --row writes its result
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # --row on CPU, for tests
    parser.add_argument("--tp-worker", metavar="OUT", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.row and not cli.json:
        parser.error("--row needs --json OUT, the file its result goes to")
    if cli.tp_worker:
        tensor_parallel_worker(cli.tp_worker)
        return 0
    if not torch.cuda.is_available() and not (cli.row and cli.allow_cpu):
        message = "colograd.gpu.check: needs an NVIDIA GPU (torch.cuda.is_available() is False); see docs/gpu.md"
        print(message, file=sys.stderr)
        return 1
    if cli.row:
        row_child(cli.row, cli.json, cli.model)
        return 0
    print(f"colograd GPU check on {torch.cuda.get_device_name()} × {torch.cuda.device_count()}", flush=True)
    results = run_checks(cli.model)
    print(format_table(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
