"""The benchmarks' own arithmetic (their figures come from running them, not from tests)."""

import pytest

from colograd.bench.soak import slope_per_100_steps


def test_slope_of_a_steady_leak_and_of_a_flat_line():
    assert slope_per_100_steps([1000 + 0.5 * i for i in range(50)]) == pytest.approx(50.0)
    # x = 0..5, y alternating 0/1: cov = 1.5, var = 17.5 (worked by hand)
    assert slope_per_100_steps([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]) == pytest.approx(100 * 1.5 / 17.5)
    assert slope_per_100_steps([7.0] * 10) == 0.0
