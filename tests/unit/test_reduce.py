"""Reduce kernels against a plain numpy reference: fp32 accumulation, then numpy's own narrowing.

Every available backend runs every (dtype, op); results must match the reference bit for bit,
except that a NaN only has to be a NaN (backends canonicalise NaN bits differently).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from reduction_appliance.dataplane.errors import ConfigError
from reduction_appliance.dataplane.reduce import (
    BACKENDS,
    KernelTable,
    available_backends,
    element_view,
    select_kernels,
)
from reduction_appliance.dataplane.wire import DType, Op

NP_DTYPE = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}
BITS = {DType.FLOAT32: np.uint32, DType.FLOAT16: np.uint16, DType.BFLOAT16: np.uint16}
FOLD = {Op.SUM: np.add, Op.AVG: np.add, Op.MIN: np.minimum, Op.MAX: np.maximum}
HALVES = (DType.FLOAT16, DType.BFLOAT16)


def _backend_param(name: str) -> object:
    needs = {"torch": "torch", "numpy+ml_dtypes": "ml_dtypes"}.get(name)
    missing = needs is not None and importlib.util.find_spec(needs) is None
    reason = f"{needs} not importable, so the {name!r} backend cannot run here"
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=reason), id=name)


@pytest.fixture(params=[_backend_param(b) for b in BACKENDS], scope="module")
def table(request: pytest.FixtureRequest) -> KernelTable:
    return select_kernels(str(request.param))


@pytest.fixture(autouse=True)
def _quiet_fp_warnings() -> Iterator[None]:
    # inf - inf and overflowing casts are the point of these inputs, not accidents.
    with np.errstate(all="ignore"):
        yield


# --- helpers ------------------------------------------------------------------------------------


def reference(arrays: list[NDArray[np.generic]], op: Op) -> NDArray[np.generic]:
    acc = arrays[0].astype(np.float32)
    for a in arrays[1:]:
        acc = FOLD[op](acc, a.astype(np.float32))
    if op is Op.AVG:
        acc = np.divide(acc, np.float32(len(arrays)))
    return acc.astype(arrays[0].dtype)


def reduce_with(
    table: KernelTable, dtype: DType, op: Op, arrays: list[NDArray[np.generic]], offset: int = 0
) -> NDArray[np.uint8]:
    """Run first/add/finish the way the aggregator does, payloads as element views of a buffer."""
    kernel = table.kernel(dtype, op)
    n = len(arrays[0])
    nbytes = n * dtype.itemsize
    arena = np.zeros(offset + nbytes + 64, np.uint8)
    payload = arena[offset : offset + nbytes]
    acc = np.full(n, 12345.0, np.float32)  # garbage: first() must overwrite it all
    for i, a in enumerate(arrays):
        payload[:] = a.view(np.uint8)
        (kernel.first if i == 0 else kernel.add)(acc, element_view(payload, dtype))
    out = np.zeros(offset + 4 * n, np.uint8)[offset:]
    result = kernel.finish(acc, len(arrays), out)
    return result.copy()


def assert_bits_equal(got: NDArray[np.uint8], want: NDArray[np.generic], dtype: DType) -> None:
    assert got.dtype == np.uint8
    assert len(got) == want.nbytes
    g = got.view(NP_DTYPE[dtype])
    want_nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(g.astype(np.float32)), want_nan, "NaN positions")
    g_bits, w_bits = got.view(BITS[dtype]), want.view(BITS[dtype])
    bad = np.flatnonzero((g_bits != w_bits) & ~want_nan)
    assert bad.size == 0, (
        f"{bad.size} elements differ, first at {bad[0]}: "
        f"got {g_bits[bad[0]]:#x}, want {w_bits[bad[0]]:#x}"
    )


def special_values(dtype: DType) -> NDArray[np.generic]:
    d = NP_DTYPE[dtype]
    finfo = ml_dtypes.finfo(d)
    tiny_sub = float(finfo.smallest_subnormal)
    values = [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
        float(finfo.max),
        -float(finfo.max),
        float(finfo.smallest_normal),
        tiny_sub,
        -tiny_sub,
        3 * tiny_sub,
        1.0,
        -1.0,
    ]
    return np.array(values, np.float64).astype(d)


def contributions(
    rng: np.random.Generator, dtype: DType, n: int, count: int
) -> list[NDArray[np.generic]]:
    """Random normals at several scales, sprinkled with inf/NaN/-0/subnormals/max."""
    d = NP_DTYPE[dtype]
    finfo = ml_dtypes.finfo(d)
    specials = special_values(dtype)
    out = []
    for _ in range(count):
        scale = rng.choice([1.0, 1e3, float(finfo.max) / 4, float(finfo.smallest_normal)], n)
        a = (rng.standard_normal(n) * scale).astype(d)
        hit = rng.random(n) < 0.05
        a[hit] = rng.choice(specials, int(hit.sum()))
        sub = rng.random(n) < 0.05  # random subnormal bit patterns
        mant = (1 << (finfo.nmant)) - 1
        a.view(BITS[dtype])[sub] = rng.integers(1, mant + 1, int(sub.sum())).astype(BITS[dtype])
        out.append(a)
    return out


# --- the main comparison ------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("count", [1, 2, 5])
def test_matches_numpy_reference(table: KernelTable, dtype: DType, op: Op, count: int) -> None:
    rng = np.random.default_rng([int(dtype), int(op), count])
    arrays = contributions(rng, dtype, 4099, count)
    assert_bits_equal(reduce_with(table, dtype, op, arrays), reference(arrays, op), dtype)


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("offset", [1, 2, 3, 64])
def test_any_payload_alignment(table: KernelTable, dtype: DType, offset: int) -> None:
    rng = np.random.default_rng(offset)
    arrays = contributions(rng, dtype, 1001, 3)
    for op in Op:
        got = reduce_with(table, dtype, op, arrays, offset=offset)
        assert_bits_equal(got, reference(arrays, op), dtype)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
def test_segments_longer_than_a_chunk(table: KernelTable, dtype: DType) -> None:
    # Longer than every backend's widening chunk, with a ragged tail.
    rng = np.random.default_rng(7)
    arrays = contributions(rng, dtype, (1 << 19) + 4097, 2)
    for op in (Op.SUM, Op.MIN):
        assert_bits_equal(reduce_with(table, dtype, op, arrays), reference(arrays, op), dtype)


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    bits=hnp.arrays(np.uint32, st.integers(1, 300), elements=st.integers(0, 2**32 - 1)),
    dtype=st.sampled_from(HALVES),
)
def test_narrowing_rounds_like_numpy(
    table: KernelTable, bits: NDArray[np.uint32], dtype: DType
) -> None:
    """Any fp32 bit pattern (ties, overflow, subnormal results) narrows like numpy/ml_dtypes."""
    acc = bits.view(np.float32).copy()
    want = acc.astype(NP_DTYPE[dtype])
    out = np.empty(2 * len(acc), np.uint8)
    with np.errstate(all="ignore"):
        got = table.kernel(dtype, Op.SUM).finish(acc, 1, out)
    assert_bits_equal(got, want, dtype)


@settings(max_examples=60, deadline=None)
@given(
    bits=hnp.arrays(np.uint16, st.integers(1, 300), elements=st.integers(0, 2**16 - 1)),
    dtype=st.sampled_from(HALVES),
    op=st.sampled_from(list(Op)),
)
def test_widening_is_exact(
    table: KernelTable, bits: NDArray[np.uint16], dtype: DType, op: Op
) -> None:
    """first() of any 2-byte pattern equals numpy's widening; finish(count=1) gives it back."""
    payload = bits.view(np.uint8).copy()
    acc = np.empty(len(bits), np.float32)
    kernel = table.kernel(dtype, op)
    kernel.first(acc, element_view(payload, dtype))
    want = bits.view(NP_DTYPE[dtype]).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(acc), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(acc.view(np.uint32)[finite], want.view(np.uint32)[finite])
    assert_bits_equal(
        kernel.finish(acc, 1, np.empty_like(payload)), bits.view(NP_DTYPE[dtype]), dtype
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(list(DType)),
    op=st.sampled_from(list(Op)),
    count=st.integers(1, 6),
    n=st.integers(1, 200),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_reductions(
    table: KernelTable, dtype: DType, op: Op, count: int, n: int, seed: int
) -> None:
    arrays = contributions(np.random.default_rng(seed), dtype, n, count)
    assert_bits_equal(reduce_with(table, dtype, op, arrays), reference(arrays, op), dtype)


def test_min_max_propagate_nan(table: KernelTable) -> None:
    for dtype in DType:
        d = NP_DTYPE[dtype]
        a, b = np.array([np.nan, 1.0, np.nan], d), np.array([2.0, np.nan, np.nan], d)
        for op in (Op.MIN, Op.MAX):
            got = reduce_with(table, dtype, op, [a, b]).view(d).astype(np.float32)
            assert np.isnan(got).all(), (dtype, op, got)


# --- the result buffer contract -----------------------------------------------------------------


def test_fp32_finish_returns_accumulator_bytes(table: KernelTable) -> None:
    acc = np.arange(8, dtype=np.float32)
    kernel = table.kernel(DType.FLOAT32, Op.AVG)
    out = np.zeros(64, np.uint8)
    result = kernel.finish(acc, 2, out)
    assert np.shares_memory(result, acc) and not np.shares_memory(result, out)
    assert len(result) == acc.nbytes
    np.testing.assert_array_equal(result.view(np.float32), np.arange(8, dtype=np.float32) / 2)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: d.name)
def test_half_finish_writes_into_out(table: KernelTable, dtype: DType) -> None:
    acc = np.arange(8, dtype=np.float32)
    out = np.zeros(64, np.uint8)
    result = table.kernel(dtype, Op.SUM).finish(acc, 1, out)
    assert len(result) == 16 and np.shares_memory(result, out)
    assert result.ctypes.data == out.ctypes.data
    assert_bits_equal(result, acc.astype(NP_DTYPE[dtype]), dtype)


def test_rejects_mismatched_lengths(table: KernelTable) -> None:
    for dtype in DType:
        kernel = table.kernel(dtype, Op.SUM)
        acc = np.zeros(16, np.float32)
        short = element_view(np.zeros(dtype.itemsize, np.uint8), dtype)  # one: no broadcast
        with pytest.raises(ValueError):
            kernel.first(acc, short)
        with pytest.raises(ValueError):
            kernel.add(acc, short)
        if dtype is not DType.FLOAT32:
            with pytest.raises(ValueError):
                kernel.finish(acc, 1, np.zeros(8, np.uint8))


def test_avg_needs_a_contribution(table: KernelTable) -> None:
    with pytest.raises(ValueError):
        table.kernel(DType.FLOAT32, Op.AVG).finish(
            np.zeros(4, np.float32), 0, np.zeros(0, np.uint8)
        )


def _strided_rows(data: NDArray[np.uint8], rows: int, gap: int, n: int,
                  dtype: DType) -> NDArray[np.generic]:
    """`rows` payloads of `n` elements, each behind a `gap`-byte header: a GRO receive."""
    stride = gap + n * dtype.itemsize
    view = np.lib.stride_tricks.as_strided(data[gap:], (rows, n * dtype.itemsize), (stride, 1))
    return view.view(NP_DTYPE[dtype] if dtype is DType.FLOAT32 else np.uint16)


def every_rows_case(test: Callable[..., None]) -> Callable[..., None]:
    """Every (op, dtype) with rows of a rack segment's elements and rows past a widening chunk
    (where the 16-bit kernels go row by row): the cases of the burst-row tests."""
    for mark in (pytest.mark.parametrize("op", list(Op), ids=lambda o: o.name),
                 pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name),
                 pytest.mark.parametrize("n", [2224, 40000], ids=["segment", "past-a-chunk"])):
        test = mark(test)
    return test


@every_rows_case
def test_a_bursts_rows_fold_as_each_row_alone(
    table: KernelTable, dtype: DType, op: Op, n: int
) -> None:
    """first_rows/add_rows over a burst's strided payloads (48-byte headers between them) into
    strided accumulator rows (an arena's slots) give each row what first/add give it alone."""
    rows, gap, slot = 7, 48, n + 16  # accumulators a slot apart, wider than a segment
    rng = np.random.default_rng(n)
    kernel = table.kernel(dtype, op)
    parts = [[a.view(np.uint8) for a in contributions(rng, dtype, n, rows)] for _ in range(3)]
    bursts = []
    for part in parts:
        data = np.zeros(rows * (gap + n * dtype.itemsize) + gap, np.uint8)
        payload = _strided_rows(data, rows, gap, n, dtype)
        for r in range(rows):
            payload[r] = part[r].view(payload.dtype)
        bursts.append(payload)
    arena = np.full(rows * slot, 12345.0, np.float32)
    together = arena.reshape(rows, slot)[:, :n]
    kernel.first_rows(together, bursts[0])
    for burst in bursts[1:]:
        kernel.add_rows(together, burst)
    for r in range(rows):
        alone = np.full(n, -1.0, np.float32)
        kernel.first(alone, np.ascontiguousarray(bursts[0][r]))
        for burst in bursts[1:]:
            kernel.add(alone, np.ascontiguousarray(burst[r]))
        np.testing.assert_array_equal(together[r], alone, f"row {r}")


@every_rows_case
def test_finish_rows_gives_each_row_what_finish_gives_it_alone(
    table: KernelTable, dtype: DType, op: Op, n: int
) -> None:
    """finish_rows over strided accumulator rows (an arena's slots) into strided result rows
    returns, for each row, the bytes finish returns for that row alone (NaN, inf, overflow
    and ties among them), and leaves each accumulator finalised the same way."""
    rows, slot, out_slot = 5, n + 16, 2 * n + 64
    rng = np.random.default_rng(n)
    sums = np.stack([np.concatenate([
        rng.standard_normal(n - 6).astype(np.float32) * 1e3,
        np.array([np.nan, np.inf, -np.inf, 3.4e38, -0.0, 1.00390625], np.float32)])
        for _ in range(rows)])
    kernel = table.kernel(dtype, op)
    arena = np.full(rows * slot, 12345.0, np.float32)
    together = arena.reshape(rows, slot)[:, :n]
    together[:] = sums
    outs = np.zeros(rows * out_slot, np.uint8).reshape(rows, out_slot)
    results = kernel.finish_rows(together, 3, outs)
    assert len(results) == rows
    for r in range(rows):
        alone = sums[r].copy()
        want = kernel.finish(alone, 3, np.zeros(out_slot, np.uint8)).copy()
        assert results[r].dtype == np.uint8 and len(results[r]) == len(want)
        assert_bits_equal(results[r], want.view(NP_DTYPE[dtype]), dtype)
        np.testing.assert_array_equal(together[r], alone, f"row {r}'s accumulator")
        if dtype is not DType.FLOAT32:
            assert np.shares_memory(results[r], outs[r]), "narrowed into its own result row"


def test_finish_rows_rejects_rows_that_do_not_pair(table: KernelTable) -> None:
    for dtype in DType:
        kernel = table.kernel(dtype, Op.SUM)
        with pytest.raises(ValueError):
            kernel.finish_rows(np.zeros((3, 8), np.float32), 1, np.zeros((2, 64), np.uint8))
        if dtype is not DType.FLOAT32:
            with pytest.raises(ValueError):  # a result row too short for its segment
                kernel.finish_rows(np.zeros((2, 8), np.float32), 1, np.zeros((2, 8), np.uint8))


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_steady_state_allocates_nothing(table: KernelTable, dtype: DType) -> None:
    """After a warm-up call, first/add/finish allocate no array memory (numpy reports its
    allocations to tracemalloc; torch's casts allocate nothing here either way)."""
    n = 1 << 16
    rng = np.random.default_rng(0)
    payload = element_view(
        rng.standard_normal(n).astype(NP_DTYPE[dtype]).view(np.uint8).copy(), dtype)
    acc, out = np.empty(n, np.float32), np.empty(4 * n, np.uint8)
    kernel = table.kernel(dtype, Op.AVG)

    def segment() -> None:
        kernel.first(acc, payload)
        for _ in range(3):
            kernel.add(acc, payload)
        kernel.finish(acc, 4, out)

    segment()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        segment()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 8 << 10, f"{peak - base} bytes allocated for a {payload.nbytes} B segment"


# --- selection ----------------------------------------------------------------------------------


def test_numpy_always_available() -> None:
    assert "numpy" in available_backends()
    assert select_kernels("numpy").backend == "numpy"


def test_default_is_best_available() -> None:
    assert select_kernels().backend == available_backends()[0]


def test_torch_preferred_when_importable() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch not importable: nothing to prefer")
    assert select_kernels().backend == "torch"


def test_a_named_numpy_backend_never_imports_torch() -> None:
    """A core configured with kernels = "numpy" starts without paying torch's import (seconds
    per core on a slow host, tens of seconds in the emulated RoCE guest)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch not installed: nothing that could be imported by mistake")
    probe = ("import sys; from reduction_appliance.dataplane.reduce import select_kernels; "
             "select_kernels('numpy'); print(sorted({'torch', 'ml_dtypes'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "torch" not in done.stdout, done.stdout


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="numpy") as err:
        select_kernels("cuda")
    assert "unknown" in str(err.value)


def test_every_dtype_op_pair_has_a_kernel(table: KernelTable) -> None:
    for dtype in DType:
        for op in Op:
            assert table.kernel(dtype, op) is table.kernel(dtype, op)
