"""`python -m colograd.gpu.proof` (or `make gpu-proof`): prove a GPU machine end to end and record it in docs/gpu.md.

It runs, in parts that each fit one 10-minute command on an H100:

    engine      the acceptance check's engine rows (`colograd.gpu.check`): sync parity eager and compiled, with every
                engine tensor at the address it had (captured CUDA graphs read those), sleep levels 1 and 2 (2
                compiled), a tiny MoE, LoRA adapter and merged, LoRA's three sleep levels
    training    the tiny recipe, then partial rollouts, dynamic sampling and a vision-language model on a compiled
                engine, segment attention, and tensor parallelism 2 where there are two GPUs
    hybrids     the hybrid models only a GPU answers for (docs/real-models.md, "Hybrid models"): Qwen3.5-4B and
                Qwen3.5-35B-A3B as published, Qwen3-Next, Kimi-Linear and Nemotron 3 Nano, shrunk as tests/zoo.py
                shrinks them, 3 GRPO steps each in bf16 with the gate on (`tests/scripts/gpu_models.py`, a checkout's)
    mamba2      the same for the Mamba-2 and short-convolution hybrids (Granite-4.0-H, Falcon-H1, Nemotron-H, LFM2),
                whose GPU engines keep prefix caching (the CPU's turn it off)
    step-0.5b   the step benchmark against TRL at Qwen2.5-0.5B's shape (`python -m colograd.bench step`)
    step-1.5b   the same at Qwen2.5-1.5B's shape
    step-qwen3.5-4b  the same on Qwen3.5-4B's layers (`--model qwen3.5-4b-layers`: a hybrid at that model's widths)

`--part all` (the default) runs them one after the other. Each part's results go to `.gpu-proof/PART.json`, with
the device and the versions it ran on; `--record docs/gpu.md` then writes every part found there into that page,
between its `gpu-proof` markers. Without a GPU it says so in one line and exits 1, before anything starts.
"""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from colograd.gpu import check
from colograd.gpu.runner import Result, format_table, last_line

# The check's rows of each part (all of `check.ROWS` between them, in its order).
_ENGINE_ROWS = [name for name in check.ROWS if name.startswith(("sync", "sleep", "MoE", "LoRA"))]
_TRAINING_ROWS = [name for name in check.ROWS if name not in _ENGINE_ROWS]
# The step benchmark's GPU workloads (docs/benchmarks.md): 16 prompts × 8 completions of up to 256 tokens, in bf16.
_STEP = [
    "--prompts",
    "16",
    "--generations",
    "8",
    "--completion-tokens",
    "256",
    "--accumulation",
    "4",
    "--dtype",
    "bf16",
]
# The step benchmark's rows: the label and the flags that pick its model.
STEPS = {
    "step-0.5b": ("Qwen2.5-0.5B shape", ["--shape", "qwen2.5-0.5b"]),
    "step-1.5b": ("Qwen2.5-1.5B shape", ["--shape", "qwen2.5-1.5b"]),
    "step-qwen3.5-4b": ("Qwen3.5-4B's layers", ["--model", "qwen3.5-4b-layers"]),
}
# The hybrids' rows: tests/zoo.py's model and `gpu_models.py`'s flags (all run in bf16); `--published` trains the
# checkpoint's own class (Qwen3.5's vision-language one), `--replay` replays the engine's expert routing.
HYBRIDS = {
    "hybrids": {
        "Qwen3.5-4B as published": ("Qwen/Qwen3.5-4B", "--published"),
        "Qwen3.5-35B-A3B as published, replay": ("Qwen/Qwen3.5-35B-A3B", "--published", "--replay"),
        "Qwen3-Next, replay": ("Qwen/Qwen3-Next-80B-A3B-Instruct", "--replay"),
        "Kimi-Linear, replay": ("moonshotai/Kimi-Linear-48B-A3B-Instruct", "--replay"),
        "Nemotron 3 Nano": ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",),
    },
    "mamba2": {
        "Granite-4.0-H-Tiny, replay": ("ibm-granite/granite-4.0-h-tiny", "--replay"),
        "Falcon-H1": ("tiiuae/Falcon-H1-0.5B-Instruct",),
        "Nemotron-H": ("nvidia/Nemotron-H-8B-Base-8K",),
        "LFM2": ("LiquidAI/LFM2-1.2B",),
    },
}
PARTS = ("engine", "training", *HYBRIDS, *STEPS)
RESULTS = Path(".gpu-proof")
BEGIN, END = "<!-- gpu-proof:begin -->", "<!-- gpu-proof:end -->"
STEP_TIMEOUT_S = 560
# A hybrid's row: its start-up, 3 steps and the check after them; five rows fit one 10-minute command.
HYBRID_TIMEOUT_S = 110
# The script the hybrids' rows run: a checkout's (it builds its models with tests/zoo.py).
GPU_MODELS = Path(__file__).resolve().parents[2] / "tests" / "scripts" / "gpu_models.py"


def run_part(part: str) -> dict:
    """Run one part; returns what `.gpu-proof/PART.json` holds: the part, when, where, and its rows."""
    start = time.time()
    if part in ("engine", "training"):
        rows = [check.run_row(name) for name in (_ENGINE_ROWS if part == "engine" else _TRAINING_ROWS)]
        if part == "training":
            rows.append(check.check_tensor_parallel())
        else:
            check.compare_lora_sleep(rows)
    elif part in HYBRIDS:
        rows = [hybrid_row(name, *run) for name, run in HYBRIDS[part].items()]
    else:
        rows = [step_row(part)]
    return {"part": part, "seconds": time.time() - start, "machine": machine(), "rows": [vars(r) for r in rows]}


def step_row(part: str) -> Result:
    """The step benchmark of `part` (`STEPS`), in a child process, as a row: colograd's speed against TRL's, and
    the worst token's sampling gap of colograd's steps."""
    label, model = STEPS[part]
    name = f"step vs TRL, {label}"
    cmd = [sys.executable, "-m", "colograd.bench", "step", *model, *_STEP, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Result(name, "FAIL", f"timed out after {STEP_TIMEOUT_S} s")
    figures = _last_json(proc.stdout)
    if proc.returncode != 0 or figures is None:
        return Result(name, "FAIL", f"exit {proc.returncode}: {last_line(proc.stderr or proc.stdout)}")
    keys = ("speedup_vs_trl", "colograd_steps_per_s", "trl_steps_per_s", "generation_vs_bare_vllm",
            "colograd_sampling_gap_max")  # fmt: skip
    detail = ", ".join(f"{key} {figures[key]:.3g}" for key in keys if isinstance(figures.get(key), int | float))
    note = figures.get("trl_side_note")
    return Result(name, "pass", detail + (f" ({note})" if note else ""), {k: figures[k] for k in keys if k in figures})


def hybrid_row(name: str, model: str, *flags: str, timeout: float = HYBRID_TIMEOUT_S) -> Result:
    """`model` trained 3 steps in bf16 by `GPU_MODELS` in a child process, as a row: it passes when the run ends in
    training (the gate stops a run whose gap is past its bound), with its gaps and whether the running parity guard
    stayed on. Its log goes to `.gpu-proof/logs/`; a run the time limit ends says the last stage it reached."""
    if not GPU_MODELS.exists():
        return Result(name, "skip", f"needs a checkout of colograd: {GPU_MODELS} is not here")
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() else "-" for c in name)
    out, log = logs / f"{stem}.json", logs / f"{stem}.log"
    out.unlink(missing_ok=True)
    stacks = max(timeout - 15, timeout * 0.8)  # every thread's stack in the log, before the limit ends the run
    cmd = [sys.executable, str(GPU_MODELS), str(out), model, "--bf16", *flags, "--stacks-after", str(stacks)]
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            stages = [line for line in log.read_text().splitlines() if line.startswith("gpu_models: ")]
            reached = stages[-1].removeprefix("gpu_models: ") if stages else "nothing (not even its imports)"
            return Result(name, "FAIL", f"timed out after {timeout:.0f} s; last stage: {reached}; log in {log}")
    if not out.exists():
        return Result(name, "FAIL", f"exit {proc.returncode}: {last_line(log.read_text())}")
    return hybrid_result(name, json.loads(out.read_text()))


def hybrid_result(name: str, row: dict) -> Result:
    """The row of a `gpu_models.py` run (its JSON object)."""
    if "error" in row:
        return Result(name, "FAIL", f"{row['error']} ({row['seconds']:.0f} s)")
    steps, means = (" / ".join("-" if v is None else f"{v:.2g}" for v in row[key]) for key in ("gap_max", "gap_mean"))
    detail = f"sampling gap worst {steps}, mean {means}; after the last sync {row['parity_gap']:.2g}"
    if any(differed is not None for differed in row["differed"]):
        detail += ", routing differed on " + " / ".join(f"{d:.1%}" for d in row["differed"] if d is not None)
    guard = row["running_guard"]
    detail += f"; running guard {'on' if guard else 'off'}; {row['seconds']:.0f} s"
    worst = max((v for v in row["gap_max"] if v is not None), default=float("nan"))
    figures = {"gap": worst, "parity_gap": row["parity_gap"], "seconds": row["seconds"]}
    return Result(name, "pass", detail, figures)


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def machine() -> dict:
    """The device and the versions a part ran on."""
    versions = {}
    for package in ("torch", "vllm", "transformers", "trl"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    gpus = torch.cuda.device_count()
    device = f"{torch.cuda.get_device_name()} × {gpus}" if gpus else "no GPU"
    return {"device": device, "cuda": torch.version.cuda, **versions}


def record(page: Path, parts: list[dict]) -> None:
    """Write `parts` into `page` between its markers (replacing what was there), or say where they are missing."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"colograd.gpu.proof: {page} has no '{BEGIN}' ... '{END}' section to write into; add one")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(head + BEGIN + "\n" + render(parts) + "\n" + END + tail)


def render(parts: list[dict]) -> str:
    """The parts as markdown: per part, where and when it ran, then its table."""
    blocks = []
    for part in parts:
        m = part["machine"]
        versions = ", ".join(f"{k} {v}" for k, v in m.items() if k != "device")
        when = time.strftime("%Y-%m-%d", time.gmtime(part.get("finished", 0)))
        table = format_table([Result(**row) for row in part["rows"]])
        blocks.append(
            f"**{part['part']}** ({m['device']}; {versions}; {when}, {part['seconds']:.0f} s)\n\n```\n{table}\n```"
        )
    return "\n\n".join(blocks) if blocks else "(no part has run yet)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colograd.gpu.proof", description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--record", metavar="PAGE", help="write every part's results into PAGE (docs/gpu.md)")
    cli = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "colograd.gpu.proof: needs an NVIDIA GPU (torch.cuda.is_available() is False); see docs/gpu.md",
            file=sys.stderr,
        )
        return 1
    RESULTS.mkdir(exist_ok=True)
    failed = False
    for part in PARTS if cli.part == "all" else (cli.part,):
        print(f"colograd.gpu.proof: {part} ...", flush=True)
        result = run_part(part) | {"finished": time.time()}
        (RESULTS / f"{part}.json").write_text(json.dumps(result))
        print(format_table([Result(**row) for row in result["rows"]]), flush=True)
        failed |= any(row["status"] == "FAIL" for row in result["rows"])
    if cli.record:
        found = [
            json.loads((RESULTS / f"{part}.json").read_text()) for part in PARTS if (RESULTS / f"{part}.json").exists()
        ]
        record(Path(cli.record), found)
        print(f"colograd.gpu.proof: wrote {len(found)} part(s) into {cli.record}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
