"""The benchmarks' own arithmetic (their figures come from running them, not from tests)."""

import pytest

from colograd.bench.soak import slope_per_100_steps


def test_slope_of_a_steady_leak_and_of_a_flat_line():
    assert slope_per_100_steps([1000 + 0.5 * i for i in range(50)]) == pytest.approx(50.0)
    assert slope_per_100_steps([1000.0, 1001.0, 1000.0, 1001.0, 1000.0, 1001.0]) == pytest.approx(100 * 0.0857, abs=0.1)
    assert slope_per_100_steps([7.0] * 10) == 0.0
