"""same_bits: the benchmarks' and tests' check of a result against the numpy reference."""

from __future__ import annotations

import numpy as np

from reduction_appliance.dataplane.dtypes import info
from reduction_appliance.dataplane.wire import DType
from reduction_appliance.deploy.testnet.reference import same_bits


def test_equal_values_with_different_bits_differ() -> None:
    zero = np.zeros(4, np.float32)
    assert not same_bits(zero, -zero)  # equal as floats, not bit for bit


def test_nans_compare_by_their_bits() -> None:
    a = np.array([np.nan, 1.0], np.float32)
    assert same_bits(a, a.copy())  # == on floats would say NaN != NaN
    b = a.view(np.uint32).copy()
    b[0] ^= 1  # another NaN payload
    assert not same_bits(a, b.view(np.float32))


def test_one_changed_element_in_a_large_array_is_found() -> None:
    a = np.arange(1 << 20, dtype=np.float32)
    b = a.copy()
    b[-1] = np.nextafter(b[-1], np.float32(np.inf))
    assert same_bits(a, a.copy())
    assert not same_bits(a, b)


def test_dtype_and_shape_must_match() -> None:
    a = np.ones(4, np.float32)
    assert not same_bits(a, a.astype(np.float16))
    assert not same_bits(a, a.view(np.int32))
    assert not same_bits(a, a[:3])


def test_sixteen_bit_floats_and_strided_views() -> None:
    for dtype in (DType.FLOAT16, DType.BFLOAT16):
        a = np.arange(8, dtype=np.float32).astype(info(dtype).numpy)
        b = a.copy()
        assert same_bits(a, b) and same_bits(a[::2], b[::2])
        b[6] = b[7]
        assert same_bits(a[::2][:3], b[::2][:3]) and not same_bits(a, b)
