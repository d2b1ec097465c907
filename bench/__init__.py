"""Shipped benchmarks, runnable as ``python -m bench.<name>``."""
