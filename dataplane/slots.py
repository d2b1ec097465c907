"""The preallocated slot arena of one data-plane core.

One anonymous mapping, allocated once and never resized: it is the memory a RoCE transport
registers as its memory region, so every view the aggregator hands out must point into it.

Layout (each region page-aligned, each buffer 64-byte aligned)::

    [ accumulators: capacity x 2 copies x (64 + 2 * max_payload) bytes, viewed as float32 ]
    [ results:      capacity x 2 copies x (64 + max_payload) bytes (narrowed fp16/bf16)     ]
    [ receive pool: rx_buffers x (header + max_payload) bytes: a whole datagram each      ]

Every accumulator and result buffer has 64 bytes in front of it, and a result's header is
packed into their last 48 (`header_before`): header and payload are then one contiguous
message, which an RDMA transport sends with one scatter entry and no copy.

An accumulator holds 2 * max_payload bytes because a 16-bit segment of max_payload bytes widens
to float32 twice its size. A receive buffer holds a datagram as it arrived, header then
payload, so any transport (one `recvmsg_into`, a completion of a posted receive) fills it the
same way; each buffer starts 16 bytes into its 64-byte-aligned stride so that the payload,
after the 48-byte header, is cache-line aligned for the kernels.
"""

from __future__ import annotations

import contextlib
import mmap
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .errors import AdmissionError, ConfigError
from .reduce import STORAGE
from .wire import HEADER_SIZE, DType

__all__ = ["RxPool", "SlotArena", "holdable_buffers", "receive_reserve"]

_ALIGN = 64
_PAGE = mmap.PAGESIZE
_RX_LEAD = _ALIGN - HEADER_SIZE % _ALIGN  # payload after the header lands cache-line aligned


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def receive_reserve(rx_buffers: int) -> int:
    """Receive buffers never held back for deterministic jobs: a full receive burst (64
    datagrams) always has somewhere to go."""
    return min(64, rx_buffers // 2)


def holdable_buffers(rx_buffers: int) -> int:
    """Receive buffers deterministic jobs may reserve, together, to hold early contributions
    (each job its own quota, `JobSpec.hold_buffers`, granted at admission)."""
    return rx_buffers - receive_reserve(rx_buffers)


class RxPool:
    """Fixed receive buffers with a free list. A buffer taken by a transport belongs to whoever
    it hands it to (the aggregator), which gives it back with `release` or keeps it (a
    contribution held back for rank-ordered summation)."""

    __slots__ = ("_free", "addresses", "buffer_bytes", "elements", "views")

    def __init__(self, buffers: NDArray[np.uint8]) -> None:
        # Made once, not per datagram: transports receive into `views` (or, with RDMA, into
        # `addresses`: where the NIC places a message), and the kernels take each payload as
        # elements of 4 or 2 bytes (see reduce.element_view).
        self.views = [memoryview(b) for b in buffers]
        self.addresses = [int(b.ctypes.data) for b in buffers]
        self.buffer_bytes = int(buffers.shape[1])
        self.elements: dict[int, list[NDArray[Any]]] = {
            size: [b[HEADER_SIZE:].view(STORAGE[d]) for b in buffers]
            for d, size in ((DType.FLOAT32, 4), (DType.FLOAT16, 2))
        }
        self._free = list(range(len(buffers) - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.views)

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, index: int) -> None:
        self._free.append(index)


def _layout(capacity: int, max_payload: int, rx_buffers: int
            ) -> tuple[int, int, int, int, int, int, int]:
    """Row stride, accumulator and result row bytes, the two regions' bytes, receive buffer
    stride and the receive region's bytes of an arena."""
    stride = _round_up(max_payload, _ALIGN)
    acc_row = _ALIGN + 2 * stride  # header lead, then the accumulator
    out_row = _ALIGN + stride
    acc_bytes = _round_up(capacity * 2 * acc_row, _PAGE)
    out_bytes = _round_up(capacity * 2 * out_row, _PAGE)
    rx_stride = _round_up(_RX_LEAD + HEADER_SIZE + max_payload, _ALIGN)
    rx_bytes = _round_up(rx_buffers * rx_stride, _PAGE)
    return stride, acc_row, out_row, acc_bytes, out_bytes, rx_stride, rx_bytes


def arena_bytes(capacity: int, max_payload: int, rx_buffers: int) -> int:
    """What one core's `SlotArena` maps: every page of it in use once jobs fill its slots."""
    *_, acc_bytes, out_bytes, _, rx_bytes = _layout(capacity, max_payload, rx_buffers)
    return acc_bytes + out_bytes + rx_bytes


class SlotArena:
    """`capacity` slot pairs of `max_payload` bytes plus a receive pool, in one mapping."""

    def __init__(self, capacity: int, max_payload: int, rx_buffers: int) -> None:
        if capacity < 1 or rx_buffers < 2 or max_payload < _ALIGN:
            raise ConfigError(
                f"slot arena needs capacity >= 1, rx_buffers >= 2 and max_payload >= {_ALIGN}; "
                f"got {capacity}, {rx_buffers}, {max_payload}"
            )
        self.capacity = capacity
        self.max_payload = max_payload
        _, acc_row, out_row, acc_bytes, out_bytes, rx_stride, rx_bytes = _layout(
            capacity, max_payload, rx_buffers)
        self.nbytes = acc_bytes + out_bytes + rx_bytes
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(whole.ctypes.data)  # what an RDMA transport registers, nbytes long
        self._acc_rows = whole[:acc_bytes][: capacity * 2 * acc_row].reshape(capacity, 2, acc_row)
        self._out_rows = whole[acc_bytes : acc_bytes + out_bytes][: capacity * 2 * out_row].reshape(
            capacity, 2, out_row
        )
        self._acc = self._acc_rows[:, :, _ALIGN:].view(np.float32)
        self._out = self._out_rows[:, :, _ALIGN:]
        rx = whole[acc_bytes + out_bytes :][: rx_buffers * rx_stride].reshape(
            rx_buffers, rx_stride)
        self.rx = RxPool(rx[:, _RX_LEAD : _RX_LEAD + HEADER_SIZE + max_payload])
        self._free_slots = list(range(capacity - 1, -1, -1))

    # -- slot allocation (one job takes a set of slot pairs; any indices will do) --
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self, count: int) -> list[int]:
        """`count` free slot pairs: consecutive ones where a run of them is free (the lowest
        such run), so that one kernel call can fold into several (`accumulator_rows`)."""
        free = self._free_slots
        if count > len(free):
            raise AdmissionError(
                f"job needs {count} slots but only {len(free)} of {self.capacity} "
                "are free on this core"
            )
        free.sort(reverse=True)  # lowest last: list.pop takes from the end
        for end in range(len(free) - 1, count - 2, -1):
            start = end - count + 1
            if free[start] - free[end] == count - 1:  # descending and distinct: consecutive
                taken = free[start:end + 1]
                del free[start:end + 1]
                return taken[::-1]
        return [free.pop() for _ in range(count)]

    def release(self, slots: list[int]) -> None:
        self._free_slots.extend(slots)

    def accumulator(self, slot: int, copy: int) -> NDArray[np.float32]:
        acc: NDArray[np.float32] = self._acc[slot, copy]
        return acc

    def accumulator_rows(self, first: int, count: int, copy: int) -> NDArray[np.float32]:
        """The accumulators of copy `copy` of slots first .. first + count - 1, as the rows of
        one view (one row per slot, each a whole accumulator)."""
        rows: NDArray[np.float32] = self._acc[first:first + count, copy]
        return rows

    def result_buffer(self, slot: int, copy: int) -> NDArray[np.uint8]:
        out: NDArray[np.uint8] = self._out[slot, copy][: self.max_payload]
        return out

    def result_rows(self, first: int, count: int, copy: int) -> NDArray[np.uint8]:
        """The result buffers of copy `copy` of slots first .. first + count - 1, as the rows
        of one view (`accumulator_rows`' counterpart: fp16/bf16 results are narrowed here)."""
        rows: NDArray[np.uint8] = self._out[first:first + count, copy, : self.max_payload]
        return rows

    def copy_buffers(self, slot: int, copy: int) -> tuple[
            NDArray[np.float32], NDArray[np.uint8], tuple[memoryview, memoryview]]:
        """A slot copy's accumulator, result buffer, and the places of its result header."""
        return (self.accumulator(slot, copy), self.result_buffer(slot, copy),
                (self.header_before(slot, copy, False), self.header_before(slot, copy, True)))

    def header_before(self, slot: int, copy: int, narrowed: bool) -> memoryview:
        """The 48 bytes right before the accumulator (`narrowed` False: fp32 results are the
        accumulator itself) or the result buffer (fp16/bf16 results)."""
        rows = self._out_rows if narrowed else self._acc_rows
        return memoryview(rows[slot, copy][_ALIGN - HEADER_SIZE : _ALIGN])

    # -- resource lifetime --
    def close(self) -> None:
        # Views into the mapping may outlive us in tests; the mapping then closes when they go.
        with contextlib.suppress(BufferError):
            self._map.close()

    def __enter__(self) -> SlotArena:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
