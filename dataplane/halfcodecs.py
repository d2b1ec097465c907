"""fp16/bf16 <-> fp32 codecs: how the 16-bit reduce kernels (`dataplane.reduce`) widen each
contribution into their fp32 scratch and narrow each result back, one class per backend.

Every codec takes a segment or a burst's rows of segments (2-D views, strided like the arena's
slots), and narrows with round-to-nearest-even bit for bit like ``astype`` (numpy's float16,
ml_dtypes' bfloat16) for every non-NaN value; a NaN stays a NaN (`dataplane.reduce`'s docstring
has the whole contract). Each instance owns scratch, so it belongs to one kernel.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "HalfCodec",
    "MlDtypesBfloat16Codec",
    "NumpyBfloat16Codec",
    "NumpyFloat16Codec",
    "TorchCodec",
    "fp16_table",
    "widen_bf16_by_shift",
]

# bfloat16 is the top half of a float32; these name the bit fiddling below.
_BF16_SHIFT = 16
_BF16_ROUND_HALF = 0x7FFF  # + the kept LSB = round half to even
_BF16_SIGN = 0x8000
_BF16_QUIET_NAN = 0x7FC0  # what ml_dtypes produces for any NaN (sign kept)


class HalfCodec(Protocol):
    def widen(self, dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None: ...

    def narrow(self, dst: NDArray[np.uint16], src: NDArray[np.float32]) -> None: ...


class TorchCodec:
    """fp16/bf16 <-> fp32 with torch's vectorised casts on zero-copy tensor views."""

    def __init__(self, torch: ModuleType, half: Any) -> None:
        self._from_numpy = torch.from_numpy
        self._half = half
        # The kernel hands us the same scratch view again and again: keep its tensor.
        self._last: NDArray[np.float32] | None = None
        self._last_t: Any = None

    def _tensor(self, a: NDArray[np.float32]) -> Any:
        if a is not self._last:
            self._last, self._last_t = a, self._from_numpy(a)
        return self._last_t

    def widen(self, dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None:
        self._tensor(dst).copy_(self._from_numpy(src.view(np.int16)).view(self._half))

    def narrow(self, dst: NDArray[np.uint16], src: NDArray[np.float32]) -> None:
        self._from_numpy(dst.view(np.int16)).view(self._half).copy_(self._tensor(src))


class NumpyFloat16Codec:
    """fp16 -> fp32 by table gather (~4 GB/s, vs ~1 GB/s for numpy's own cast)."""

    def __init__(self, table: NDArray[np.float32]) -> None:
        self._table = table
        self._idx = np.empty(0, np.intp)  # grow-once; np.take would allocate it from uint16

    def widen(self, dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None:
        n = src.size  # a segment, or a burst's rows of segments (`reduce._HalfKernel.add_rows`)
        if len(self._idx) < n:
            self._idx = np.empty(n, np.intp)
        idx = self._idx[:n].reshape(src.shape)
        np.copyto(idx, src)
        # mode="wrap" skips numpy's buffered bounds check; uint16 indices are always in range.
        np.take(self._table, idx, out=dst, mode="wrap")

    def narrow(self, dst: NDArray[np.uint16], src: NDArray[np.float32]) -> None:
        # numpy's own cast is slow (~1.3 GB/s) but is the reference; runs once per segment.
        np.copyto(dst.view(np.float16), src, casting="unsafe")


def widen_bf16_by_shift(dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None:
    wide = dst.view(np.uint32)
    np.copyto(wide, src)
    np.left_shift(wide, _BF16_SHIFT, out=wide)


class NumpyBfloat16Codec:
    """bf16 <-> fp32 with integer ops only: widening is a shift, narrowing is the RNE bit trick."""

    def __init__(self) -> None:
        self._bits = np.empty(0, np.uint32)
        self._nan = np.empty(0, np.bool_)

    def widen(self, dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None:
        widen_bf16_by_shift(dst, src)

    def narrow(self, dst: NDArray[np.uint16], src: NDArray[np.float32]) -> None:
        n = src.size  # a segment, or a burst's rows of segments (`reduce._HalfKernel.finish_rows`)
        if len(self._bits) < n:
            self._bits, self._nan = np.empty(n, np.uint32), np.empty(n, np.bool_)
        u = src.view(np.uint32)
        t, nan = self._bits[:n].reshape(src.shape), self._nan[:n].reshape(src.shape)
        # t = (u + 0x7fff + lsb) >> 16, lsb = bit 16 of u: ties go to the even neighbour, and
        # finite values past the largest bf16 carry into the exponent and become inf, as in
        # ml_dtypes. Only NaN bit patterns can wrap around, and they are overwritten below.
        np.right_shift(u, _BF16_SHIFT, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, _BF16_ROUND_HALF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, _BF16_SHIFT, out=t)
        np.isnan(src, out=nan)
        if nan.any():
            np.right_shift(u, _BF16_SHIFT, out=t, where=nan)
            np.bitwise_and(t, _BF16_SIGN, out=t, where=nan)
            np.bitwise_or(t, _BF16_QUIET_NAN, out=t, where=nan)
        np.copyto(dst, t, casting="unsafe")


class MlDtypesBfloat16Codec:
    """bf16 narrowing through ml_dtypes' RNE cast (~5 GB/s, about twice the integer trick)."""

    def __init__(self, bfloat16: Any) -> None:
        self._bfloat16 = np.dtype(bfloat16)

    def widen(self, dst: NDArray[np.float32], src: NDArray[np.uint16]) -> None:
        # The shift runs 15-20 GB/s, faster than ml_dtypes' cast loop, and is exact.
        widen_bf16_by_shift(dst, src)

    def narrow(self, dst: NDArray[np.uint16], src: NDArray[np.float32]) -> None:
        np.copyto(dst.view(self._bfloat16), src, casting="unsafe")


def fp16_table() -> NDArray[np.float32]:
    # Every fp16 bit pattern widened by numpy itself: exact, NaN payloads included.
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
