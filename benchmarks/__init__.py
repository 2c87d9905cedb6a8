"""Benchmarks: side-by-side, alternating, warm-up discarded, medians. Not tests."""
