"""The numpy client's arguments, checked: the caller's faults said plainly (`ReductionError`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.dtypes import by_numpy
from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.wire import DType, Op

__all__ = ["check_array", "check_in_place", "dtype_of", "op_of", "staged"]


def dtype_of(array: NDArray[Any]) -> DType:
    found = by_numpy(array.dtype)
    if found is None:
        raise ReductionError(
            f"the appliance reduces float32, float16 and bfloat16, not {array.dtype}")
    return found.dtype


def check_array(array: object) -> None:
    """The caller's fault, said plainly: only a numpy array can be reduced in place."""
    if not isinstance(array, np.ndarray):
        scalar = " (a numpy scalar is immutable)" if isinstance(array, np.generic) else ""
        raise ReductionError(f"allreduce() reduces a numpy.ndarray in place, not "
                             f"{type(array).__name__}{scalar}: pass np.asarray(...) of a "
                             "supported dtype and read the result from that array")


def op_of(op: str | Op) -> Op:
    if isinstance(op, Op):
        return op
    try:
        return Op[op.upper()]
    except (KeyError, AttributeError):  # an unknown name, or not a name at all
        raise ReductionError(f"unknown op {op!r}; choose sum, avg, min or max") from None


def check_in_place(array: NDArray[Any]) -> None:
    """An array `allreduce` can reduce in place (possibly through a contiguous copy)."""
    check_array(array)
    if not array.flags.writeable:  # (a contiguous copy of it would be read-only too)
        raise ReductionError(
            "allreduce() reduces in place, and this array is read-only (np.frombuffer over "
            "bytes, a broadcast view, or writeable=False): pass a writable copy")


def staged(array: NDArray[Any], reduce: Callable[[NDArray[Any]], object]) -> NDArray[Any]:
    """Reduce an array that is not one contiguous block in a contiguous copy, then copy the
    result back; a dtype the appliance cannot reduce is refused before the copy."""
    dtype_of(array)
    copy = np.ascontiguousarray(array)
    reduce(copy)
    array[...] = copy
    return array
