"""The GPU acceptance check: `python -m colograd.check` (or `make gpu-check`) on a machine with NVIDIA GPUs.

Every figure in the test suite comes from vLLM's CPU build; the CUDA build takes a different model runner.
This check runs the pieces a GPU run depends on, with the project's own engine and sync, and prints a table:

    sync parity fp32 / bf16   the engine's log-probs equal the trainer's after a sync (and differ before it)
    sleep level 1 / 2         several sync → generate → sleep → wake cycles, parity after each wake
    LoRA adapter              adapter-only sync parity; generation speed with and without the adapter
    LoRA sleep                level 1 (base to host and back) against level 2 + re-sending the base, timed
    tensor parallel 2         one engine over two GPUs (two processes), when there are two

Parity is measured as in tests/test_engine.py: the engine's prompt log-probs of a token sequence against
`log_softmax` of the trainer's logits. Without a GPU the check says so in one line and exits 1.
"""

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from colograd import tiny
from colograd.config import GRPOConfig
from colograd.engine import Engine, free_port
from colograd.sync import WeightPlan

# Largest engine/trainer log-prob gap accepted: fp32 differs only by kernel order; bf16 rounds every layer.
TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}
# A sync that did not reach the engine leaves a gap at least this large after the weights move.
STALE = 1e-2
CYCLES = 3


@dataclass
class Result:
    """One row of the table: `status` is pass, FAIL or skip; `detail` gives the figures or the reason."""

    name: str
    status: str
    detail: str


@dataclass
class Setup:
    """What every check builds its engine from: a model factory (fresh weights each call) and a tokenizer."""

    build: Callable[[], nn.Module]
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    prompts: int = 64  # prompts per timed rollout (× 8 completions)
    repeats: int = 3  # timed rollouts per figure (the median is reported), after one untimed


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


def engine_args(output_dir: str, **overrides) -> GRPOConfig:
    """A small engine: 8 completions of up to 32 tokens per prompt, eager mode (no CUDA-graph capture)."""
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=8,
        max_prompt_length=32,
        max_completion_length=32,
        vllm_max_num_seqs=512,
        vllm_gpu_memory_utilization=0.3,
        vllm_kv_cache_gib=0.1,
        vllm_enforce_eager=True,
        report_to="none",
    )
    return GRPOConfig(output_dir=output_dir, **{**settings, **overrides})


def move(model: nn.Module, lora_only: bool = False, scale: float = 0.05) -> None:
    """Change every trained tensor (every adapter tensor with `lora_only`), as an optimizer step does."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not lora_only or "lora_" in name:
                p.add_(torch.randn_like(p) * scale)


def lora(model: nn.Module) -> nn.Module:
    """`model` with rank-8 LoRA on every linear layer and non-zero B, so that the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    move(model, lora_only=True, scale=0.5)
    return model


def check_sync(setup: Setup, dtype: str) -> Result:
    """Sync parity for an fp32 or bf16 engine (bf16: the trainer computes under bf16 autocast, as `bf16: true`)."""
    name = f"sync parity {dtype}"
    autocast = torch.bfloat16 if dtype == "bfloat16" else None
    model = setup.build().eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        engine = Engine(model, setup.tokenizer, engine_args(out, bf16=autocast is not None))
        plan = WeightPlan(model)
        plan.sync(engine)
        first = parity_gap(engine, model, ids, autocast)
        move(model)
        stale = parity_gap(engine, model, ids, autocast)
        seconds = _median_seconds(lambda: plan.sync(engine))
        after = parity_gap(engine, model, ids, autocast)
        _release(engine)
    ok = max(first, after) <= TOLERANCE[dtype] and stale > STALE
    detail = (
        f"gap {first:.1e} / {after:.1e} (≤ {TOLERANCE[dtype]:.0e}), stale {stale:.1e}; "
        f"sync {seconds * 1e3:.2f} ms for {plan.nbytes / 2**20:.1f} MiB ({plan.nbytes / seconds / 1e9:.1f} GB/s)"
    )
    return Result(name, "pass" if ok else "FAIL", detail)


def check_sleep(setup: Setup, level: int) -> Result:
    """Several rollouts through `Engine.awake` with the engine put to sleep at `level` between them."""
    model = setup.build().eval()
    ids = _sample_ids(setup)
    gaps, freed = [], []
    with tempfile.TemporaryDirectory() as out:
        args = engine_args(out, vllm_enable_sleep_mode=True)
        engine = Engine(model, setup.tokenizer, args)
        engine.sleep_level = level
        plan = WeightPlan(model)
        for _ in range(CYCLES):
            if not engine.llm.llm_engine.is_sleeping():
                awake_free = torch.cuda.mem_get_info()[0]
                engine.llm.sleep(level=level)
                freed.append(torch.cuda.mem_get_info()[0] - awake_free)
            move(model)
            with engine.awake(lambda: plan.sync(engine)):
                engine.generate([ids[:8]], args)
                gaps.append(parity_gap(engine, model, ids))
        _release(engine)
    ok = max(gaps) <= TOLERANCE["float32"]
    detail = f"{CYCLES} cycles, gap max {max(gaps):.1e}; sleeping frees {statistics.median(freed) / 2**30:.2f} GiB"
    return Result(f"sleep level {level}", "pass" if ok else "FAIL", detail)


def check_lora(setup: Setup) -> Result:
    """Adapter-only sync parity after two adapter updates, and generation speed with and without the adapter."""
    model = lora(setup.build()).eval()
    ids = _sample_ids(setup)
    with tempfile.TemporaryDirectory() as out:
        args = engine_args(out)
        engine = Engine(model, setup.tokenizer, args, lora_rank=8)
        plan = WeightPlan(model, adapter_only=True)
        gaps = []
        for _ in range(2):
            plan.sync(engine)
            gaps.append(parity_gap(engine, model, ids))
            move(model, lora_only=True)
        with model.disable_adapter():
            adapter_effect = (trainer_logprobs(model, ids) - engine.prompt_logprobs(ids)).abs().max().item()
        prompts = [_sample_ids(setup, seed=i)[:16] for i in range(setup.prompts)]
        with_adapter = _tokens_per_second(engine, prompts, args, setup.repeats)
        engine.lora_request, request = None, engine.lora_request
        without = _tokens_per_second(engine, prompts, args, setup.repeats)
        engine.lora_request = request
        _release(engine)
    ok = max(gaps) <= TOLERANCE["float32"] and adapter_effect > STALE
    detail = (
        f"gap max {max(gaps):.1e}; generation {with_adapter:,.0f} tok/s with the adapter, {without:,.0f} without "
        f"({with_adapter / without:.2f}×)"
    )
    return Result("LoRA adapter", "pass" if ok else "FAIL", detail)


def check_lora_sleep(setup: Setup) -> Result:
    """Adapter-only LoRA with sleep: level 1 keeps the frozen base (copied to host and back at every rollout);
    level 2 drops it and the sync re-sends it. Times sleep + wake + sync of each, parity after every cycle."""
    (level1, gaps1), (level2, gaps2) = (_lora_sleep_cycles(setup, level) for level in (1, 2))
    gap = max(gaps1 + gaps2)
    faster, ratio = (1, level2 / level1) if level1 <= level2 else (2, level1 / level2)
    detail = (
        f"gap max {gap:.1e}; sleep+wake+sync level 1 {level1 * 1e3:.1f} ms, level 2 + base "
        f"{level2 * 1e3:.1f} ms: level {faster} is {ratio:.2f}× faster"
    )
    return Result("LoRA sleep level 1 vs 2", "pass" if gap <= TOLERANCE["float32"] else "FAIL", detail)


def _lora_sleep_cycles(setup: Setup, level: int) -> tuple[float, list[float]]:
    """An adapter-only engine that sleeps at `level` between rollouts, through `Engine.awake` as in training.

    Returns:
        The median seconds of sleep + wake + sync over the timed cycles, and the parity gap after every wake.
    """
    model = lora(setup.build()).eval()
    ids = _sample_ids(setup)
    seconds, gaps = [], []
    with tempfile.TemporaryDirectory() as out:
        engine = Engine(model, setup.tokenizer, engine_args(out, vllm_enable_sleep_mode=True), lora_rank=8)
        engine.sleep_level = level
        if not engine.llm.llm_engine.is_sleeping():
            engine.llm.sleep(level=level)
        plan = WeightPlan(model, adapter_only=True)
        for cycle in range(CYCLES + 1):  # the first cycle brings the base in and is not timed
            if level == 2:
                plan = WeightPlan(model, adapter_only=True)  # a new plan sends the base again with the adapter
            move(model, lora_only=True)
            _synchronize()
            start = time.perf_counter()
            with engine.awake(functools.partial(plan.sync, engine)):
                _synchronize()
                woken = time.perf_counter() - start
                gaps.append(parity_gap(engine, model, ids))
                _synchronize()
                leaving = time.perf_counter()
            _synchronize()  # `awake` put the engine back to sleep at `level`
            if cycle:
                seconds.append(woken + time.perf_counter() - leaving)
        _release(engine)
    return statistics.median(seconds), gaps


def check_tensor_parallel() -> Result:
    """One engine over two GPUs: two processes (torchrun), each syncs its trainer's weights and checks parity."""
    name = "tensor parallel 2"
    if torch.cuda.device_count() < 2:
        return Result(name, "skip", f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "colograd.check", "--tp-worker", out]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return Result(name, "FAIL", f"exit {proc.returncode}: {_last_line(proc.stderr or proc.stdout)}")
        gaps = [json.load(open(os.path.join(out, f"rank{r}.json")))["gap"] for r in (0, 1)]
    ok = max(gaps) <= TOLERANCE["float32"]
    return Result(name, "pass" if ok else "FAIL", f"gap per rank {gaps[0]:.1e} / {gaps[1]:.1e}")


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
    """The built-in tiny Qwen2 (no download): a check of the machinery, not of speed."""
    return Setup(lambda: tiny.build_model().to(device), tiny.build_tokenizer(), device)


def model_setup(name: str, device: torch.device) -> Setup:
    """A model from a local folder or the Hub, loaded in float32 (the trainer's weights; bf16 by autocast)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return Setup(
        lambda: AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(device),
        AutoTokenizer.from_pretrained(name),
        device,
    )


def run_checks(setup: Setup) -> list[Result]:
    """Every check in turn; one that raises is a FAIL with its error, and the others still run."""
    checks: list[tuple[str, Callable[[], Result]]] = [
        ("sync parity float32", lambda: check_sync(setup, "float32")),
        ("sync parity bfloat16", lambda: check_sync(setup, "bfloat16")),
        ("sleep level 1", lambda: check_sleep(setup, 1)),
        ("sleep level 2", lambda: check_sleep(setup, 2)),
        ("LoRA adapter", lambda: check_lora(setup)),
        ("LoRA sleep level 1 vs 2", lambda: check_lora_sleep(setup)),
        ("tensor parallel 2", check_tensor_parallel),
    ]
    results = []
    for name, check in checks:
        try:
            results.append(check())
        except Exception as err:  # a check that crashes is a finding, reported in its row
            results.append(Result(name, "FAIL", f"{type(err).__name__}: {_last_line(str(err))}"))
        print(f"{results[-1].status:>4}  {name}", flush=True)
    return results


def format_table(results: list[Result]) -> str:
    """The results as a fixed-width table, one row per check, and a closing count."""
    width = max(len(r.name) for r in results)
    rows = [f"{'check':<{width}}  result  figures"]
    rows += [f"{r.name:<{width}}  {r.status:<6}  {r.detail}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "skip")}
    return "\n".join(rows + [f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"])


def _sample_ids(setup: Setup, seed: int = 0, length: int = 24) -> list[int]:
    """A fixed token sequence: random ids from the tokenizer's vocabulary, special ids left out."""
    generator = torch.Generator().manual_seed(seed)
    special = set(setup.tokenizer.all_special_ids)
    vocab = [i for i in range(min(len(setup.tokenizer), 5000)) if i not in special]
    return [vocab[i] for i in torch.randint(len(vocab), (length,), generator=generator).tolist()]


def _tokens_per_second(engine: Engine, prompts: list[list[int]], args: GRPOConfig, repeats: int) -> float:
    """Generated tokens per second over a whole rollout (median of `repeats`, after one warm-up)."""
    engine.generate(prompts, args)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = engine.generate(prompts, args)
        rates.append(sum(map(len, rollout.completion_ids)) / (time.perf_counter() - start))
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


def _release(engine: Engine) -> None:
    """Free the engine's memory before the next check builds its own."""
    del engine.llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colograd.check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local folder or hub id to check with instead of the tiny model")
    parser.add_argument("--tp-worker", metavar="OUT", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.tp_worker:
        tensor_parallel_worker(cli.tp_worker)
        return 0
    if not torch.cuda.is_available():
        message = "colograd.check: needs an NVIDIA GPU (torch.cuda.is_available() is False); see docs/gpu.md"
        print(message, file=sys.stderr)
        return 1
    device = torch.device("cuda")
    setup = model_setup(cli.model, device) if cli.model else tiny_setup(device)
    print(f"colograd GPU check on {torch.cuda.get_device_name()} × {torch.cuda.device_count()}", flush=True)
    results = run_checks(setup)
    print(format_table(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
