"""The numpy reference every reduction is checked against: fp32 accumulation in rank order,
then the result narrowed to the input dtype (what deterministic mode promises bit for bit)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.dtypes import info
from reduction_appliance.dataplane.wire import DType, Op


def reference(arrays: list[NDArray[np.generic]], op: Op) -> NDArray[np.generic]:
    acc = arrays[0].astype(np.float32)
    for a in arrays[1:]:
        x = a.astype(np.float32)
        if op in (Op.SUM, Op.AVG):
            np.add(acc, x, out=acc)
        elif op is Op.MIN:
            np.minimum(acc, x, out=acc)
        else:
            np.maximum(acc, x, out=acc)
    if op is Op.AVG:
        np.divide(acc, np.float32(len(arrays)), out=acc)
    return acc.astype(arrays[0].dtype)


def integer_valued(rng: np.random.Generator, n: int, dtype: DType) -> NDArray[np.generic]:
    """Values whose sums are exact in any order (small integers): for arrival-order modes.
    Sums of up to 64 of them stay within bfloat16's exact integers."""
    return rng.integers(-4, 4, n, dtype=np.int8).astype(info(dtype).numpy)


def random_values(rng: np.random.Generator, n: int, dtype: DType) -> NDArray[np.generic]:
    return (rng.standard_normal(n) * 10).astype(info(dtype).numpy)


def same_bits(a: NDArray[np.generic], b: NDArray[np.generic]) -> bool:
    """Bit-identical (NaNs included), compared as unsigned integers of the same width.

    The benchmarks check every iteration between back-to-back timed calls with no barrier, so
    a slow check delays the rank's next call and shows up in the other ranks' timings, and it
    takes CPU from the ranks still reducing: `tobytes()` copies both arrays, 62 ms for 64 MiB,
    this 4.6 ms."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = np.dtype(f"u{a.dtype.itemsize}")
    return bool(np.array_equal(a.view(width), b.view(width)))
