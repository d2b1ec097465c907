"""Reduce kernels: fold one rank's contribution to a segment into an fp32 accumulator.

The aggregator keeps one fp32 accumulator per slot and calls, per segment and round::

    kernel.first(acc, payload)          # first contribution: widen into acc
    kernel.add(acc, payload)            # every later one: acc = op(acc, widen(payload))
    kernel.finish(acc, count, out)      # avg: divide; narrow back to the wire dtype

Byte order: tensor payloads travel in the host's native element order, which is little-endian on
every supported host (x86-64, aarch64); only the 48-byte header (``wire.py``) is big-endian.
Swapping bytes would cost a full pass per contribution for no benefit, so ``select_kernels``
refuses to run on a big-endian host instead of silently mis-reading tensors.

Payloads arrive as views of their storage type (``element_view``: float32 for FLOAT32, uint16
bits for FLOAT16/BFLOAT16) into the receive arena; the aggregator builds those views once per
receive buffer, because at 64 KiB even one ``view()`` per call (~0.3 us) costs 20% of the
throughput. Views at any byte offset are handled correctly (numpy and torch both read unaligned
elements), but only 64-byte-aligned slots get the measured speeds.

Why the kernels look the way they do (numbers from the development machine, in the README's
Results; re-measure with ``python -m reduction_appliance.bench.kernels``):

- fp32 is ``np.add(acc, x, acc)`` on views: memory-bound like memcpy (three streams instead of
  two), so no other library could beat it; at 64 KiB the per-call Python cost starts to show.
- numpy converts float16 at ~1 GB/s, so fp16/bf16 are first widened into a per-kernel fp32
  scratch chunk (torch ``copy_``: 20-60 GB/s; pure numpy: a 65536-entry table gather or a shift),
  then folded with the same numpy ufunc as fp32. Chunks keep scratch in cache and bounded;
  mixing dtypes inside ``torch.add_`` would instead allocate a full-size fp32 temporary per call
  (torch's profiler shows ``aten::to`` allocating 4 MiB for a 1 Mi-element add; ``copy_`` into
  our scratch allocates nothing), which is what makes it collapse on 16 MiB tensors.
- Folding with numpy ufuncs in every backend makes MIN/MAX/NaN/-0 semantics identical to
  ``np.minimum``/``np.maximum`` everywhere.

Rounding: results are narrowed with round-to-nearest-even and are bit-identical to
``acc.astype(np.float16)`` / ``acc.astype(ml_dtypes.bfloat16)`` for every non-NaN value
(including inf, overflow to inf, -0 and subnormals). A NaN stays a NaN, but its sign and payload
bits are unspecified: torch canonicalises bf16 NaN to 0xffff where ml_dtypes gives 0x7fc0.

Process state this module deliberately leaves to its caller, the per-core data-plane process:
a table (and every kernel in it) belongs to one thread, since kernels own scratch buffers;
torch's intra-op thread pool should be one thread (``torch.set_num_threads(1)``); and numpy
warns when a sum overflows or inf meets -inf (``np.seterr(all="ignore")`` once at start: such
values are the trainer's business, e.g. its loss scaler's, and the appliance forwards them).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from .dtypes import DTYPES
from .errors import ConfigError
from .halfcodecs import (
    HalfCodec,
    MlDtypesBfloat16Codec,
    NumpyBfloat16Codec,
    NumpyFloat16Codec,
    TorchCodec,
    fp16_table,
)
from .spec import KERNEL_BACKENDS
from .wire import DType, Op

__all__ = [
    "BACKENDS",
    "KERNEL_MODULES",
    "STORAGE",
    "KernelTable",
    "SegmentKernel",
    "available_backends",
    "element_view",
    "select_kernels",
]

#: Every backend this module knows, best first.
BACKENDS = KERNEL_BACKENDS

# Elements per widening chunk. torch: 1 MiB of 2-byte input, the size up to which its casts were
# measured at in-cache speed; smaller chunks measured slower (16 MiB fp16 add: 5.8 GB/s with
# 64 Ki-element chunks, 8.1 with 512 Ki) as per-chunk Python overhead outweighs locality.
# The shift-based bf16 widening behaves like torch's casts and uses the same chunk. numpy's fp16
# table gather needs an intp index (8 bytes/element): 64 Ki elements keep index, scratch and the
# 256 KiB table inside the 2 MiB L2.
_WIDE_CHUNK = (1 << 20) // 2
_GATHER_CHUNK = 1 << 16

_FOLD: Mapping[Op, np.ufunc] = {Op.SUM: np.add, Op.AVG: np.add, Op.MIN: np.minimum,
                                Op.MAX: np.maximum}

STORAGE: Mapping[DType, np.dtype[Any]] = {d.dtype: d.storage for d in DTYPES}


def element_view(payload: NDArray[np.uint8], dtype: DType) -> NDArray[Any]:
    """The payload bytes as the elements a kernel of `dtype` takes (raises on a partial one)."""
    return payload.view(STORAGE[dtype])


class SegmentKernel(Protocol):
    """Folds contributions of one (dtype, op) into an fp32 accumulator, in place. Payloads are
    `element_view`s: float32 for FLOAT32, the uint16 bits for FLOAT16/BFLOAT16."""

    def first(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        """acc = widened copy of the first contribution; len(acc) == len(payload)."""
        ...

    def add(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        """acc = op(acc, widened payload) in place (sum/avg: add, min: minimum, max: maximum)."""
        ...

    def first_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        """`first` for each row of two 2-D views of equal shape (several slots at once)."""
        ...

    def add_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        """`add` for each row of two 2-D views of equal shape (several slots at once)."""
        ...

    def finish(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> NDArray[np.uint8]:
        """Finalise acc in place (avg: divide by count); return the result bytes in the input
        dtype. FLOAT32 returns ``acc.view(np.uint8)`` (``out`` unused); FLOAT16/BFLOAT16 narrow
        into ``out[:len(acc) * 2]`` and return that view."""
        ...

    #: Whether `finish` does work per call worth sharing (fp16/bf16 narrow; fp32 returns a
    #: view): the burst path finishes several copies with one `finish_rows` only then.
    narrows: bool

    def finish_rows(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> list[NDArray[np.uint8]]:
        """`finish` for each row of `acc` (several slots' accumulators, each row one segment)
        into the same row of `out`, with one cast for all of them; each row's result bytes."""
        ...


@dataclass(frozen=True)
class KernelTable:
    """One kernel per (dtype, op), all from one backend, chosen once at start."""

    backend: str
    _kernels: Mapping[tuple[DType, Op], SegmentKernel] = field(repr=False)
    # Better backends skipped because they cannot load here, each with why ("torch (No module
    # named 'torch')"): a fallback the daemon logs once and status shows.
    passed_over: tuple[str, ...] = ()

    def kernel(self, dtype: DType, op: Op) -> SegmentKernel:
        return self._kernels[(dtype, op)]


# --- kernels ------------------------------------------------------------------------------------


class _Kernel:
    """What every kernel shares: the fold ufunc, avg's divide, the input view and its checks."""

    def __init__(self, op: Op) -> None:
        self._fold = _FOLD[op]
        self._avg = op is Op.AVG

    @staticmethod
    def _elements(payload: NDArray[Any], n: int) -> NDArray[Any]:
        if len(payload) != n:
            raise ValueError(f"payload holds {len(payload)} elements, accumulator {n}")
        return payload

    @staticmethod
    def _same_shape(acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        if acc.shape != payload.shape:  # never broadcast one row over several
            raise ValueError(f"payload rows {payload.shape}, accumulator rows {acc.shape}")

    # Every backend folds row by row; fp32 overrides these with one ufunc call for all rows.
    def first_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        for a, x in zip(acc, payload, strict=True):
            self.first(a, x)

    def add_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        for a, x in zip(acc, payload, strict=True):
            self.add(a, x)

    narrows = False

    def finish_rows(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> list[NDArray[np.uint8]]:
        if len(acc) != len(out):
            raise ValueError(f"{len(acc)} accumulator rows, {len(out)} result rows")
        return [self.finish(a, count, o) for a, o in zip(acc, out, strict=True)]

    def first(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        raise NotImplementedError

    def finish(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> NDArray[np.uint8]:
        raise NotImplementedError

    def add(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        raise NotImplementedError

    def _finalise(self, acc: NDArray[np.float32], count: int) -> None:
        if self._avg:
            if count < 1:
                raise ValueError(f"average over {count} contributions")
            np.divide(acc, np.float32(count), out=acc)


class _Float32Kernel(_Kernel):
    # add() is the hot path and at 64 KiB the ufunc itself takes ~1 us, so every ~100 ns of
    # Python around it costs ~10% of throughput: no view, the cheapest exact length check,
    # positional `out` (cheaper than keyword). The check stays: without it a one-element
    # payload would silently broadcast.

    def first(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        np.copyto(acc, self._elements(payload, len(acc)))

    def add(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        if len(payload) != len(acc):
            raise ValueError(f"payload holds {len(payload)} elements, accumulator {len(acc)}")
        self._fold(acc, payload, acc)

    def first_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        np.copyto(acc, payload)

    def add_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        self._fold(acc, payload, out=acc)

    def finish(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> NDArray[np.uint8]:
        self._finalise(acc, count)
        return acc.view(np.uint8)


class _Float32ExtremumKernel(_Float32Kernel):
    def add(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        # numpy 2.4 deprecates a positional `out` for minimum/maximum (not for add).
        if len(payload) != len(acc):
            raise ValueError(f"payload holds {len(payload)} elements, accumulator {len(acc)}")
        self._fold(acc, payload, out=acc)


class _HalfKernel(_Kernel):
    """fp16/bf16: widen chunk by chunk into fp32 scratch, then fold like fp32. A burst's rows
    (consecutive slots, `dataplane.runs`) up to a chunk take one cast and one fold, as fp32's
    do: row by row, the casts' fixed cost per call made a 16-bit datagram cost three times a
    fp32 one (bench.hotpath)."""

    def __init__(self, op: Op, codec: HalfCodec, chunk: int) -> None:
        super().__init__(op)
        self._codec = codec
        self._chunk = chunk
        self._buf = np.empty(0, np.float32)  # grows to at most `chunk` elements, once
        self._view = self._buf
        self._rows_view = self._buf.reshape(0, 0)

    def _scratch(self, n: int) -> NDArray[np.float32]:
        # Hand out the identical view for a repeated size so codecs can cache its tensor.
        if len(self._view) != n:
            if len(self._buf) < n:
                self._buf = np.empty(n, np.float32)
            self._view = self._buf[:n]
        return self._view

    def _scratch_rows(self, shape: tuple[int, ...]) -> NDArray[np.float32]:
        # The same for a burst's rows: bursts of one shape recur (a GRO receive's segments).
        if self._rows_view.shape != shape:
            n = shape[0] * shape[1]
            if len(self._buf) < n:
                self._buf = np.empty(n, np.float32)
            self._rows_view = self._buf[:n].reshape(shape)
        return self._rows_view

    def first_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        if acc.size > self._chunk:
            super().first_rows(acc, payload)
            return
        self._codec.widen(acc, payload)

    def add_rows(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        self._same_shape(acc, payload)
        if acc.size > self._chunk:
            super().add_rows(acc, payload)
            return
        tmp = self._scratch_rows(acc.shape)
        self._codec.widen(tmp, payload)
        self._fold(acc, tmp, out=acc)

    def first(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        x, n, step = self._elements(payload, len(acc)), len(acc), self._chunk
        if n <= step:
            self._codec.widen(acc, x)
            return
        for i in range(0, n, step):
            self._codec.widen(acc[i : i + step], x[i : i + step])

    def add(self, acc: NDArray[np.float32], payload: NDArray[Any]) -> None:
        x, n, step = self._elements(payload, len(acc)), len(acc), self._chunk
        if n <= step:  # the common case: no slicing overhead
            tmp = self._scratch(n)
            self._codec.widen(tmp, x)
            self._fold(acc, tmp, out=acc)
            return
        for i in range(0, n, step):
            a = acc[i : i + step]
            tmp = self._scratch(len(a))
            self._codec.widen(tmp, x[i : i + step])
            self._fold(a, tmp, out=a)

    def finish(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> NDArray[np.uint8]:
        n, step = len(acc), self._chunk
        if len(out) < 2 * n:
            raise ValueError(f"out holds {len(out)} bytes, result needs {2 * n}")
        self._finalise(acc, count)
        result = out[: 2 * n]
        dst = result.view(np.uint16)
        if n <= step:
            self._codec.narrow(dst, acc)
        else:
            for i in range(0, n, step):
                self._codec.narrow(dst[i : i + step], acc[i : i + step])
        return result

    narrows = True

    def finish_rows(
        self, acc: NDArray[np.float32], count: int, out: NDArray[np.uint8]
    ) -> list[NDArray[np.uint8]]:
        # One narrowing for the rows: torch's cast costs about 3 us a call whatever its size
        # up to a chunk, so a burst's 7 results narrowed one by one cost 3-4 times this.
        rows, n = acc.shape
        if len(out) != rows or out.shape[1] < 2 * n:
            raise ValueError(f"result rows {out.shape}, accumulator rows {acc.shape}")
        if acc.size > self._chunk:
            return super().finish_rows(acc, count, out)
        self._finalise(acc, count)
        result = out[:, : 2 * n]
        self._codec.narrow(result.view(np.uint16), acc)
        return list(result)


# --- selection ----------------------------------------------------------------------------------


def _why_not(name: str) -> str | None:
    """None when the module imports, else why not (the exception, in one line)."""
    try:
        importlib.import_module(name)
    except (ImportError, OSError) as exc:  # OSError: a wheel whose shared libraries fail to load
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


# The module each backend imports beyond numpy (which is always there).
KERNEL_MODULES: Mapping[str, str] = {"torch": "torch", "numpy+ml_dtypes": "ml_dtypes"}


def _why_backend_not(backend: str) -> str | None:
    needs = KERNEL_MODULES.get(backend)
    return None if needs is None else _why_not(needs)


def unavailable_backends() -> dict[str, str]:
    """Backends that cannot load in this process, best first, each with why."""
    return {b: reason for b in BACKENDS if (reason := _why_backend_not(b)) is not None}


def available_backends() -> tuple[str, ...]:
    """Backends usable in this process, best first ("numpy" is always last and always there)."""
    missing = unavailable_backends()
    return tuple(b for b in BACKENDS if b not in missing)


def _build(backend: str) -> KernelTable:
    # DType -> (zero-argument factory of a fresh codec, since codecs own scratch; chunk elements)
    codecs: dict[DType, tuple[Callable[[], HalfCodec], int]]
    if backend == "torch":
        torch = importlib.import_module("torch")
        codecs = {
            DType.FLOAT16: (lambda: TorchCodec(torch, torch.float16), _WIDE_CHUNK),
            DType.BFLOAT16: (lambda: TorchCodec(torch, torch.bfloat16), _WIDE_CHUNK),
        }
    else:
        table = fp16_table()
        codecs = {DType.FLOAT16: (lambda: NumpyFloat16Codec(table), _GATHER_CHUNK)}
        if backend == "numpy+ml_dtypes":
            bfloat16 = importlib.import_module("ml_dtypes").bfloat16
            codecs[DType.BFLOAT16] = (lambda: MlDtypesBfloat16Codec(bfloat16), _WIDE_CHUNK)
        else:
            codecs[DType.BFLOAT16] = (NumpyBfloat16Codec, _WIDE_CHUNK)
    kernels: dict[tuple[DType, Op], SegmentKernel] = {}
    for op in Op:
        extremum = op in (Op.MIN, Op.MAX)
        kernels[(DType.FLOAT32, op)] = (_Float32ExtremumKernel if extremum else _Float32Kernel)(op)
        for dtype, (codec, chunk) in codecs.items():
            kernels[(dtype, op)] = _HalfKernel(op, codec(), chunk)
    return KernelTable(backend, kernels)


def select_kernels(prefer: str | None = None) -> KernelTable:
    """Build the kernel table once at start: the best available backend, or ``prefer``.

    Raises ConfigError (the operator's configuration is at fault) when ``prefer`` is unknown or
    not installed here, naming the usable choices, and on a big-endian host, whose native element
    order would disagree with the wire's little-endian payloads.
    """
    if sys.byteorder != "little":
        raise ConfigError("tensor payloads are little-endian; this host is big-endian")
    # A named backend imports only its own module: a core told "numpy" must not pay torch's
    # import (seconds and hundreds of MB per core) just to learn what else it could have had.
    if prefer is not None and prefer in BACKENDS and _why_backend_not(prefer) is None:
        return _build(prefer)
    missing = unavailable_backends()
    usable = tuple(b for b in BACKENDS if b not in missing)
    if prefer is None:
        best = _build(usable[0])
        skipped = tuple(f"{b} ({missing[b]})" for b in BACKENDS[:BACKENDS.index(usable[0])])
        return replace(best, passed_over=skipped)
    why = "unknown" if prefer not in BACKENDS else "not available here"
    raise ConfigError(f"dataplane.kernels: {prefer!r} is {why}; choose one of "
                      f"{', '.join(usable)}")
