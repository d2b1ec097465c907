"""Shipped benchmarks, runnable as ``python -m reduction_appliance.bench.<name>``."""
