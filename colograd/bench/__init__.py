"""Benchmarks that print figures and ratios measured side by side in one run: `python -m colograd.bench NAME`."""
