"""The one table of the element types the appliance reduces: wire code, names, numpy types.

Everything that maps a dtype (the numpy client, the kernels, the lab's workers and reference,
the benchmarks' command lines) reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .wire import DType

__all__ = ["DTYPES", "DTypeInfo", "by_numpy", "by_short", "info", "short_names"]


@dataclass(frozen=True)
class DTypeInfo:
    dtype: DType  # the wire's code
    short: str  # command lines: fp32, fp16, bf16
    name: str  # numpy's and torch's name: float32, float16, bfloat16
    numpy: np.dtype[Any]  # the element type of a numpy array of it
    storage: np.dtype[Any]  # what the kernels view its bits as (16-bit floats: uint16)


DTYPES: tuple[DTypeInfo, ...] = (
    DTypeInfo(DType.FLOAT32, "fp32", "float32", np.dtype(np.float32), np.dtype(np.float32)),
    DTypeInfo(DType.FLOAT16, "fp16", "float16", np.dtype(np.float16), np.dtype(np.uint16)),
    DTypeInfo(DType.BFLOAT16, "bf16", "bfloat16", np.dtype(ml_dtypes.bfloat16),
              np.dtype(np.uint16)),
)

_BY_WIRE = {d.dtype: d for d in DTYPES}
_BY_SHORT = {d.short: d for d in DTYPES}
_BY_NUMPY = {d.numpy: d for d in DTYPES}


def info(dtype: DType) -> DTypeInfo:
    return _BY_WIRE[dtype]


def by_short(short: str) -> DTypeInfo:
    """fp32/fp16/bf16 -> its row; KeyError names the choices."""
    try:
        return _BY_SHORT[short]
    except KeyError:
        raise KeyError(f"unknown dtype {short!r}; choose from {', '.join(_BY_SHORT)}") from None


def short_names(text: str) -> list[str]:
    """A command line's comma-separated dtypes, each short (fp32) or numpy's name (float32),
    as short names in the order given, repeats dropped; ValueError names the choices."""
    by_name = {**{d.name: d.short for d in DTYPES}, **{d.short: d.short for d in DTYPES}}
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in by_name]
    if bad or not items:
        raise ValueError(f"unknown dtype {', '.join(map(repr, bad or [text]))}; choose from "
                         f"{', '.join(_BY_SHORT)} (or {', '.join(d.name for d in DTYPES)})")
    return list(dict.fromkeys(by_name[x] for x in items))


def by_numpy(dtype: np.dtype[Any]) -> DTypeInfo | None:
    return _BY_NUMPY.get(dtype)
