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
