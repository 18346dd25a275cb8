"""The GPU acceptance check (`python -m colograd.gpu.check`): its checks run here against vLLM's CPU build, which is
evidence that they measure what they claim; the command itself refuses to run without a GPU. Each engine row runs in
a child process and hands its result back as JSON: that protocol runs here for real (a hidden `--allow-cpu`)."""

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, _env

from colograd.engine.core import Engine
from colograd.engine.sync import WeightPlan
from colograd.gpu import check
from colograd.gpu import runner as check_runner

CPU = torch.device("cpu")
GiB = 2**30


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs instead")
@pytest.mark.slow
def test_without_a_gpu_the_check_says_so_in_one_line_and_fails():
    proc = subprocess.run(
        [sys.executable, "-m", "colograd.gpu.check"], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "needs an NVIDIA GPU" in lines[0], lines


# --- one row per process ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_row_runs_in_a_child_process_and_reports_as_json():
    """The fp32 sync row through a real child (`--row ... --json ... --allow-cpu`) with vLLM's CPU build."""
    result = check.run_row("sync parity float32", allow_cpu=True)
    assert result.status == "pass", result.detail
    assert result.name == "sync parity float32" and "stale" in result.detail and "GB/s" in result.detail
    assert result.figures["gap"] <= check.TOLERANCE["float32"] < check.STALE < result.figures["stale"]
    # The engine sized its cache for 512 sequences of 64 tokens (no GPU: no free memory to report).
    assert 0 < result.figures["kv_cache_gib"] < 1 and result.free_gib is None


@pytest.mark.slow
def test_a_child_that_fails_is_a_fail_row_with_its_last_error_line():
    result = check.run_row("no such row", allow_cpu=True)
    assert result.status == "FAIL" and result.name == "no such row"
    assert result.detail.startswith("exit 2:") and "invalid choice: 'no such row'" in result.detail


@pytest.mark.slow
def test_a_child_past_its_time_is_killed_and_a_fail_row():
    result = check.run_row("sync parity float32", allow_cpu=True, timeout=1)
    assert result.status == "FAIL" and result.detail.startswith("timed out after 1 s")


def test_run_checks_runs_every_row_and_compares_the_lora_sleep_levels(capsys):
    """The parent with a stand-in for the child processes: every engine row once, in order, then tensor parallel
    (skipped: no second GPU); the LoRA sleep rows' times give the comparison."""
    asked = []
    cycles = {"LoRA sleep kv_cache": 20.0, "LoRA sleep level 1": 30.0, "LoRA sleep level 2": 45.0}

    def run(name: str) -> check.Result:
        asked.append(name)
        figures = {"cycle_ms": cycles.get(name, 0.0)}
        return check.Result(name, "pass", "figures", figures, free_gib=70.0)

    results = check.run_checks(run=run)
    assert asked == list(check.ROWS) and "tiny recipe" in asked
    assert [r.name for r in results] == [*check.ROWS, "tensor parallel 2"] and results[-1].status == "skip"
    assert results[asked.index("LoRA sleep level 2")].detail == "figures: kv_cache is 1.50× faster than the next"
    assert capsys.readouterr().out.splitlines()[0] == "pass  sync parity float32"


def test_lora_sleep_levels_are_compared_only_when_both_passed():
    rows = [check.Result("LoRA sleep level 1", "FAIL", "crashed"), check.Result("LoRA sleep level 2", "pass", "x",
            {"cycle_ms": 1.0})]  # fmt: skip
    check.compare_lora_sleep(rows)
    assert rows[1].detail == "x"


def test_table_shows_free_memory_counts_each_status_and_names_a_leak():
    rows = [check.Result("a", "pass", "x", free_gib=70.0), check.Result("bb", "FAIL", "y", free_gib=69.5),
            check.Result("c", "skip", "z")]  # fmt: skip
    lines = check_runner.format_table(rows).splitlines()
    assert lines[2].split() == ["bb", "FAIL", "69.5", "y"] and lines[3].split()[:3] == ["c", "skip", "-"]
    assert lines[4] == "1 passed, 1 failed, 1 skipped"
    assert lines[5].startswith("every row started within 1 GiB")
    rows.append(check.Result("d", "pass", "w", free_gib=46.0))
    assert check_runner.format_table(rows).splitlines()[-1].endswith("(a leak?): d (24.0 GiB less)")


def test_a_child_that_failed_after_or_while_writing_its_result_is_a_fail_row(tmp_path):
    """A row whose process crashes at teardown, after writing its result: the figures stay, the row fails. One that
    crashed while writing it: a FAIL row with its last line, and the other rows go on."""
    path = tmp_path / "row.json"
    written = check.Result("r", "pass", "gap 1e-05", {"gap": 1e-5})
    code = (f"from colograd.gpu.runner import Result, write_result; import sys; "
            f"write_result(Result(**{vars(written)!r}), {str(path)!r}); "
            "print('teardown crashed', file=sys.stderr); sys.exit(3)")  # fmt: skip
    result = check_runner.run_child("r", [sys.executable, "-c", code], lambda: check_runner.read_result(str(path)))
    assert result.status == "FAIL" and result.figures == {"gap": 1e-5}
    assert result.detail == "gap 1e-05; then exit 3: teardown crashed"
    ok = check_runner.run_child("r", [sys.executable, "-c", "pass"], lambda: check_runner.read_result(str(path)))
    assert ok.status == "pass" and ok.detail == "gap 1e-05"
    path.write_text('{"name": "r", "sta')  # a child that crashed while writing
    code = "import sys; print('killed', file=sys.stderr); sys.exit(1)"
    cut = check_runner.run_child("r", [sys.executable, "-c", code], lambda: check_runner.read_result(str(path)))
    assert cut.status == "FAIL" and cut.detail == "exit 1: killed"


# --- sleep: what a sleep frees --------------------------------------------------------------------------------


class MemoryLLM:
    """Stands in for `vllm.LLM` under `Engine.awake`: waking takes GPU memory, sleeping gives it back."""

    def __init__(self, gpu: dict[str, int], weights: int, kv: int) -> None:
        self.gpu, self.weights, self.kv = gpu, weights, kv

    def wake_up(self, tags: list[str]) -> None:
        self.gpu["free"] -= self.weights if tags == ["weights"] else self.kv

    def sleep(self, level: int) -> None:
        self.gpu["free"] += self.kv + self.weights


def test_sleep_freed_memory_is_measured_inside_awake_and_after_it(monkeypatch):
    """The engine is asleep between rollouts (and from the start): what it holds shows only inside `awake`."""
    gpu = {"free": 60 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu["free"], 80 * GiB))
    engine = Engine.__new__(Engine)  # no vLLM: the wake/sleep order of `awake` and the arithmetic
    engine.llm, engine.sleep_level, engine.stale = MemoryLLM(gpu, weights=2 * GiB, kv=GiB), 2, False
    engine.weights_resident = False  # asleep, as `Engine.__init__` leaves an engine with sleep mode on
    synced = []

    def sync() -> None:  # a write: the engine holds the weights again after level 2 dropped them
        synced.append(1)
        engine.stale = False

    gaps, freed = check.sleep_cycles(engine, sync, lambda: 1e-5, cycles=3)
    assert freed == [3 * GiB] * 3 and gaps == [1e-5] * 3 and len(synced) == 3
    assert gpu["free"] == 60 * GiB


def test_sleep_row_fails_when_a_sleep_gives_back_less_than_the_kv_cache():
    ok = check.sleep_result("sleep level 1", [1e-5] * 3, [3 * GiB] * 3, GiB, 1e-3)
    assert ok.status == "pass" and "sleeping frees 3.00 GiB" in ok.detail
    kept = check.sleep_result("sleep level 1", [1e-5] * 3, [3 * GiB, 0, 3 * GiB], GiB, 1e-3)
    assert kept.status == "FAIL" and "least 0.00" in kept.detail
    assert check.sleep_result("sleep level 1", [1e-5, 1e-2], [3 * GiB] * 2, GiB, 1e-3).status == "FAIL"


# --- the tiny recipe -----------------------------------------------------------------------------------------


def steps_logged(rewards: list[float], gap: float = 1e-6) -> list[dict[str, float]]:
    """A run's log history as the trainer writes it: a step's entry has a loss; the end of training's carries the
    last step's metrics again (as TRL's tests read them), and is no step."""
    steps = [{"loss": 0.0, "reward": r, "sampling/sampling_logp_difference/max": gap, "time/sync": 0.002,
              "time/train": 0.1} for r in rewards]  # fmt: skip
    return steps + [{"train_runtime": 10.0, **{k: v for k, v in steps[-1].items() if k != "loss"}}]


def test_recipe_row_passes_when_the_reward_rises_and_the_gap_stays_small():
    result = check.recipe_result(steps_logged([0.05] * 10 + [0.1] * 20 + [0.3] * 10), 2**28)
    assert result.status == "pass", result.detail
    assert result.detail.startswith("reward 0.05 → 0.30 (first / last 10 of 40 steps)")
    assert "KV cache 0.25 GiB; 0.102 s/step, sync 2.00 ms/step" in result.detail


@pytest.mark.parametrize(
    "rewards, gap",
    [([0.05] * 20 + [0.1] * 10, 1e-6), ([0.05] * 10 + [0.5] * 10, 5e-3), ([0.5], 1e-6)],
    ids=["flat-reward", "gap", "one-step"],
)
def test_recipe_row_fails_without_a_rise_with_a_gap_or_too_few_steps(rewards, gap):
    assert check.recipe_result(steps_logged(rewards, gap), 2**28).status == "FAIL"


@pytest.mark.slow
def test_recipe_row_trains_the_tiny_recipe():
    """The recipe row builds and trains the trainer as the CLI does; a few steps only here (no rise asserted)."""
    result = check.check_tiny_recipe(steps=4)
    assert result.figures["gap"] <= check.TOLERANCE["float32"], result.detail
    assert result.figures["kv_cache_gib"] == pytest.approx(0.25, rel=0.05)  # the recipe's vllm_kv_cache_gib
    assert result.figures["step_s"] > 0 and "(first / last 2 of 4 steps)" in result.detail


# --- rows run in this process (vLLM's CPU build) -------------------------------------------------------------


@pytest.mark.slow
def test_sync_check_fails_when_a_sync_does_not_reach_the_engine(monkeypatch):
    """A sync that works once and then hands the engine nothing: the second parity must catch it."""
    real_sync = WeightPlan.sync
    calls = []

    def first_only(plan, engine):
        calls.append(1)
        return real_sync(plan, engine) if len(calls) == 1 else 0

    monkeypatch.setattr(WeightPlan, "sync", first_only)
    result = check.check_sync(check.tiny_setup(CPU), "float32")
    assert result.status == "FAIL", result.detail


_LEFT_BEHIND: list = []  # the memory each move left, held so that no later allocation can take its address


def _move_one_tensor(worker) -> None:
    """In the engine's worker: put one weight into new memory, as a loader that rebinds `.data` would. The memory it
    leaves stays allocated: freed, the next move (the check syncs more than once) could be given that same address
    back by the allocator, and the tensor would read as never moved."""
    weight = next(worker.model_runner.model.parameters())
    _LEFT_BEHIND.append(weight.data)
    weight.data = weight.data.clone()


@pytest.mark.slow
def test_sync_row_fails_when_a_sync_moves_an_engine_tensor(monkeypatch):
    """A compiled GPU engine's CUDA graphs read the addresses they were captured with: the sync row compares every
    engine tensor's address before and after the syncs. On an engine that computes with its plain weights (CPU
    repacking off, as on a GPU), a sync that keeps them passes, and one that moves a single tensor fails."""
    plain = check.engine_args
    monkeypatch.setattr(check, "engine_args", lambda *a, **kw: plain(*a, vllm_cpu_repack_weights=False, **kw))
    kept = check.check_sync(check.tiny_setup(CPU), "float32")
    assert kept.status == "pass" and "every engine tensor kept its address" in kept.detail, kept.detail
    real_sync = WeightPlan.sync

    def moving(plan, engine):
        real_sync(plan, engine)
        engine.llm.collective_rpc(_move_one_tensor)

    monkeypatch.setattr(WeightPlan, "sync", moving)
    moved = check.check_sync(check.tiny_setup(CPU), "float32")
    assert moved.status == "FAIL" and "1 engine tensors moved" in moved.detail, moved.detail


@pytest.mark.slow
def test_lora_check_passes_on_a_bf16_cpu_engine():
    setup = check.tiny_setup(CPU)
    setup.prompts, setup.repeats = 1, 1  # the speed figures are for GPUs; here only that they are measured
    result = check.check_lora(setup)
    assert result.status == "pass", result.detail
    assert result.detail.startswith("bf16 gap") and "with the adapter" in result.detail


# The rows vLLM's CPU build can run (sleep mode is CUDA's; the segment row needs CUDA's varlen kernels; the tiny
# recipe, LoRA adapter, MoE replay and fp32 sync rows have tests of their own above and below).
CPU_ROWS = ("sync parity bfloat16", "sync parity bfloat16 compiled", "MoE sync parity", "LoRA merged",
            "partial rollouts", "dynamic sampling", "vision-language")  # fmt: skip


@pytest.mark.slow
def test_every_row_the_cpu_engine_can_run_passes_on_it():
    """Each row a GPU's check runs that vLLM's CPU build can run too, in this process (the child protocol is the fp32
    row's test): a row that stops working (a renamed option, a recipe that no longer parses, a changed call) is found
    here rather than on a lent GPU's time, as the hybrids' script once was (tests/scripts/gpu_models.py)."""
    results = [check.ROWS[name](check.tiny_setup(CPU)) for name in CPU_ROWS]
    assert [r.name for r in results] == list(CPU_ROWS)
    assert all(r.status == "pass" for r in results), [(r.name, r.detail) for r in results if r.status != "pass"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and vLLM's CUDA build")
@pytest.mark.slow
def test_gpu_check_passes():
    assert check.main([]) == 0


def test_segment_row_compares_shared_segments_with_unshared_sdpa(monkeypatch):
    """The row's arithmetic on a CPU, the reference kernel standing in for CUDA's varlen kernels."""
    from colograd.forward import attention, packing

    setup = check.tiny_setup(CPU)
    assert check.check_segments(setup).status == "FAIL"  # no varlen kernel on a CPU, and the row says so
    monkeypatch.setattr(packing, "segment_kernel", lambda *a: "reference")
    result = check.check_segments(setup)
    assert result.status == "pass", result.detail
    assert result.figures["gap_float32"] < 1e-5 and result.detail.startswith("float32 reference: gap")
    # Segments that gather the wrong keys (the queries' own positions): a completion no longer sees its prompt.
    wrong = attention._reference

    def misaligned(q, k, v, s, scale, dropout=0.0):
        keys = s.cu_k.clone()
        keys[1:] = s.cu_q[1:]  # each segment's first keys only, as many as its queries
        return wrong(q, k, v, attention.Segments(s.cu_q, keys, s.kv_index, s.max_q, s.max_q, s.kernel), scale)

    monkeypatch.setitem(attention.KERNELS, "reference", misaligned)
    assert check.check_segments(setup).status == "FAIL"


# --- the proof: the check and the step benchmark, recorded (`python -m colograd.gpu.proof`) ----------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the proof runs instead")
@pytest.mark.slow
def test_without_a_gpu_the_proof_says_so_in_one_line_before_writing_anything(tmp_path):
    page = tmp_path / "gpu.md"
    page.write_text("<!-- gpu-proof:begin -->\nkept\n<!-- gpu-proof:end -->\n")
    proc = subprocess.run(
        [sys.executable, "-m", "colograd.gpu.proof", "--record", str(page)],
        cwd=tmp_path, env={**_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "needs an NVIDIA GPU" in lines[0], lines
    assert "kept" in page.read_text() and not (tmp_path / ".gpu-proof").exists()


def test_the_proof_writes_its_parts_between_the_page_markers_and_nothing_else(tmp_path):
    from colograd.gpu import proof

    page = tmp_path / "gpu.md"
    page.write_text(f"intro\n{proof.BEGIN}\nan older table\n{proof.END}\noutro\n")
    machine = {"device": "NVIDIA H100 80GB HBM3 × 1", "cuda": "13.0", "torch": "2.14.0", "vllm": "0.33.0"}
    rows = [vars(check.Result("sync parity float32", "pass", "gap 1.0e-07")), vars(check.Result("x", "FAIL", "y"))]
    proof.record(page, [{"part": "engine", "seconds": 312.0, "finished": 0, "machine": machine, "rows": rows}])
    text = page.read_text()
    assert text.startswith(f"intro\n{proof.BEGIN}\n") and text.endswith(f"{proof.END}\noutro\n")
    assert "an older table" not in text and "NVIDIA H100 80GB HBM3 × 1; cuda 13.0, torch 2.14.0, vllm 0.33.0" in text
    assert "1 passed, 1 failed, 0 skipped" in text
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no '<!-- gpu-proof:begin -->'"):
        proof.record(page, [])


@pytest.mark.slow
def test_a_hybrid_row_trains_its_model_through_the_script_a_gpu_runs(tmp_path, monkeypatch):
    """The proof's hybrid row, LFM2's (the fastest hybrid here) on vLLM's CPU build: the checkout's script
    (tests/scripts/gpu_models.py) trains the zoo's shrunk LFM2-1.2B 3 steps in bf16 and the row reads its figures.
    The script once stopped at its first line for an option its shared training code had gained since (`partial`):
    on a GPU that would have spent a lent machine's time on a row of errors."""
    from colograd.gpu import proof

    monkeypatch.chdir(tmp_path)
    result = proof.hybrid_row("LFM2", "LiquidAI/LFM2-1.2B")
    assert result.status == "pass", result.detail
    # LFM2 in bf16 reads 0.12 at its worst token (docs/real-models.md); the gate's 16-bit bound is 1.5
    assert result.figures["gap"] < 0.5 and result.figures["parity_gap"] < 0.5, result.detail
    assert "running guard on" in result.detail
    log = (tmp_path / ".gpu-proof/logs/LFM2.log").read_text()
    assert [line.split(" (")[0] for line in log.splitlines() if line.startswith("gpu_models: ")][-1] == (
        "gpu_models: trained"
    ), log[-2000:]


def test_a_hybrid_row_cut_short_says_the_last_stage_it_reached(tmp_path, monkeypatch):
    """A row that runs past its time says how far it got (the fourth GPU run's hybrids passed their limit with empty
    logs, so nothing said where they waited); one that ends without figures gives its last line; one whose run
    raised gives the error."""
    from colograd.gpu import proof

    script = tmp_path / "gpu_models.py"
    script.write_text(
        "import sys, time\n"
        "print('gpu_models: importing (0 s)', flush=True)\n"
        "print('gpu_models: building the model (1 s)', flush=True)\n"
        "if 'Nemo' in sys.argv[2]:\n    raise SystemExit('CUDA error: no kernel image')\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(proof, "GPU_MODELS", script)
    monkeypatch.chdir(tmp_path)
    slow = proof.hybrid_row("Kimi-Linear, replay", "moonshotai/Kimi-Linear", "--replay", timeout=3)
    assert slow.status == "FAIL" and "timed out after 3 s; last stage: building the model (1 s)" in slow.detail
    assert (tmp_path / ".gpu-proof/logs/Kimi-Linear--replay.log").exists()
    crashed = proof.hybrid_row("Nemotron 3 Nano", "nvidia/Nemotron")
    assert crashed.status == "FAIL" and crashed.detail == "exit 1: CUDA error: no kernel image"
    refused = proof.hybrid_result("x", {"error": "colograd: vLLM's CPU build ...", "seconds": 3.2})
    assert refused.status == "FAIL" and refused.detail == "colograd: vLLM's CPU build ... (3 s)"
    monkeypatch.setattr(proof, "GPU_MODELS", tmp_path / "absent.py")
    assert proof.hybrid_row("LFM2", "LiquidAI/LFM2-1.2B").status == "skip"


@pytest.mark.slow
def test_the_moe_replay_row_trains_with_the_engine_in_its_default_mode():
    """The "MoE routing replay" row on vLLM's CPU build, its engine left compiled (`vllm_enforce_eager` false, a run's
    default): the engine reports every routing choice (the CPU capture is a Python hook, which a compiled forward
    skipped: the first rollout stopped with "ran without routing some of its MoE layers"; such an engine now runs
    eagerly), replay has work to do, and the bf16 gap stays within the tolerance."""
    result = check.check_moe_replay(None, steps=2)
    assert result.status == "pass", result.detail
    assert result.figures["unreplayed"] == [0.0, 0.0] and max(result.figures["differed"]) > 0
