"""The benchmarks' and the phase timers' own arithmetic (their figures come from running them, not from tests)."""

from collections import defaultdict

import pytest

from colograd.bench.soak import slope_per_100_steps
from colograd.timing import PhaseTimes, format_summary, throughput


def test_slope_of_a_steady_leak_and_of_a_flat_line():
    assert slope_per_100_steps([1000 + 0.5 * i for i in range(50)]) == pytest.approx(50.0)
    # x = 0..5, y alternating 0/1: cov = 1.5, var = 17.5 (worked by hand)
    assert slope_per_100_steps([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]) == pytest.approx(100 * 1.5 / 17.5)
    assert slope_per_100_steps([7.0] * 10) == 0.0


def test_throughput_counts_every_process_and_skips_phases_without_time():
    rates = throughput({"generated": 300.0, "trained": 900.0}, {"generate": 2.0, "train": 0.0}, processes=2)
    assert rates == {"throughput/generate_tokens_per_s": 300.0}  # 300 per process × 2 over 2 s; train not timed


def test_phase_times_feed_the_window_and_the_run_totals():
    times, window = PhaseTimes(), defaultdict(list)
    with times.timed("generate", window):
        pass
    times.add("generate", 0.5, window)
    times.count("generated", 40, window)
    assert len(window["time/generate"]) == 2 and times.seconds["generate"] >= 0.5
    assert window["tokens/generated"] == [40] and times.tokens["generated"] == 40
    summary = format_summary(4, {"generate": 1.0, "train": 3.0}, {"throughput/train_tokens_per_s": 1234.0})
    assert "generate        1.00 s   25.0%" in summary and "train tokens/s (all processes): 1,234" in summary


def test_training_flops_count_every_matrix_product_by_hand():
    from types import SimpleNamespace

    from colograd.bench.step import training_flops

    # One layer, hidden 2 (2 heads of 1, one KV head), MLP 3, vocabulary 5: q, o 2×2 each; k, v 2×1 each;
    # gate, up, down 2×3 each: 8 + 4 + 18 = 30 weights per layer; the output layer 2×5.
    config = SimpleNamespace(hidden_size=2, intermediate_size=3, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=5)  # fmt: skip
    assert training_flops(config, trained_tokens=7, completion_tokens=3) == 6 * 30 * 7 + 8 * 10 * 3


def test_step_report_of_the_pretrained_model_shows_memory_and_leaves_out_the_engine_comparisons():
    from colograd.bench.step import SMOLLM2_WORKLOAD, report, workload

    phases = {"generate": 10.0, "train": 20.0}
    result = {
        "workload": {**workload("smollm2"), "model": "smollm2", "dtype": "fp32"},
        "colograd_steps_per_s": 0.03, "trl_steps_per_s": 0.015, "colograd_tokens_per_s": 20.0,
        "trl_tokens_per_s": 10.0, "speedup_vs_trl": 2.0, "trl_mode": "use_vllm=False (transformers generate)",
        "colograd_phases_s": phases, "trl_phases_s": phases,
        "colograd_peak_rss_mib": 5120.0, "trl_peak_rss_mib": 4096.0,
        "machine_matmul_gflops": 150.0, "colograd_train_gflops": 100.0, "trl_train_gflops": 50.0,
        "colograd_train_gflops_executed": 60.0, "trained_tokens_per_step": 2000.0, "forwarded_tokens_per_step": 750.0,
    }  # fmt: skip
    text = report(result)
    assert workload("smollm2") is SMOLLM2_WORKLOAD and "4 prompts × 8 completions of ≤32 tokens" in text
    assert "in 4 micro-step(s)" in text
    assert "GFLOP/s of useful work: colograd 100, TRL 50; the machine's matrix product 150" in text
    assert "colograd forwards 750 of the step's 2,000 tokens (prompts shared), executing 60 GFLOP/s" in text
    assert "peak resident memory per process: colograd 5,120 MiB, TRL 4,096 MiB" in text
    assert "speedup_vs_trl 2.00" in text and "bare vllm" not in text
