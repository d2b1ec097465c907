"""The thread that drives an `ApplianceClient` for torch: tensors in, futures out, several rounds
on the wire at once.

`RoundPump.submit(tensors, op)` returns a `torch.futures.Future` at once. One daemon thread per
pump takes submissions in order (so every rank numbers its rounds alike), starts one appliance
round per tensor, and keeps up to the client's `lanes` rounds in flight while it waits for
results (with more than one lane, outstanding all_reduces overlap on the wire instead of
queueing behind each other). A future completes with its tensor list when all its rounds are
done, or fails with the first `ReductionError` (`AllreduceTimeout`, `JobAborted`, ...) once
none of its rounds is still writing into the tensors. A tensor wider than one lane's window is
cut into up to `lanes` rounds (`RoundPipeline.rounds_for`), so that alone it still uses every
slot the job has. If the thread itself dies, every pending and later future fails with the
reason: a caller never waits on a future nobody will complete.

Tensors are reduced in place. CPU tensors that are contiguous go straight to the wire; others
are staged through a contiguous copy, and CUDA tensors through pinned host buffers taken from a
pool and given back. A CUDA tensor is copied out once the work its caller's stream queued
before `submit` has run (an event recorded there), and copied back synchronously before its
future completes, so a consumer on any stream reads the result. The CUDA path runs only where
a GPU does: `bench.ddp_steps --device cuda` (examples/README.md) is its check.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import torch
from numpy.typing import NDArray

from reduction_appliance.dataplane.dtypes import DTYPES
from reduction_appliance.dataplane.errors import ReductionError

from .client import ApplianceClient
from .pipeline import Outcome

__all__ = ["APPLIANCE_DTYPES", "PinnedPool", "RoundPump", "numpy_view", "refuse_unreducible"]

APPLIANCE_DTYPES = tuple(getattr(torch, d.name) for d in DTYPES)  # what the appliance reduces


def numpy_view(t: torch.Tensor) -> NDArray[Any]:
    """A numpy array sharing `t`'s memory (a contiguous CPU tensor of an appliance dtype)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def refuse_unreducible(t: torch.Tensor) -> None:
    """Raise `ReductionError` for a tensor the appliance cannot reduce in place: a dtype it
    does not reduce, or elements that share memory (an expand()ed view)."""
    if t.dtype not in APPLIANCE_DTYPES:
        raise ReductionError(f"the appliance reduces float32, float16 and bfloat16, "
                             f"not {t.dtype}")
    if any(step == 0 and n > 1 for step, n in zip(t.stride(), t.shape, strict=True)):
        raise ReductionError(
            f"all_reduce writes its result into the tensor, and this one's elements "
            f"share memory (shape {tuple(t.shape)}, stride {t.stride()}: an expand()ed "
            "view): pass a clone()")


class PinnedPool:
    """Reusable pinned host buffers for CUDA tensors: one per round in flight, given back after."""

    def __init__(self) -> None:
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        free = self._free.setdefault(dtype, [])
        # By position: list.remove would compare tensors with ==, elementwise (an error as
        # soon as the pool holds two buffers).
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]
        if fitting:
            buf = free.pop(min(fitting, key=lambda i: free[i].numel()))
        else:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=torch.cuda.is_available())
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.dtype, []).append(buf)


@dataclass
class _Collective:
    tensors: list[torch.Tensor]
    op: str
    future: torch.futures.Future[Any]
    rounds: set[int] = field(default_factory=set)
    # (the caller's tensor, the contiguous host copy the round reduces, its pooled buffer)
    staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(
        default_factory=list)
    # CUDA tensors: recorded on the submitting thread's current streams, so the pump copies
    # them only once the work queued there before the call (the gradient itself) has run.
    ready: list[torch.cuda.Event] = field(default_factory=list)
    error: BaseException | None = None


class RoundPump:
    """Owns `client` (nothing else may use it) and one thread that drives it."""

    def __init__(self, client: ApplianceClient, name: str) -> None:
        self._client = client
        self._pool = PinnedPool()
        self._inbox: queue.SimpleQueue[_Collective | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._death: BaseException | None = None
        self._abandon = False
        # A byte on this pair wakes the thread out of its wait for datagrams.
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._waker.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tensors: list[torch.Tensor], op: str) -> torch.futures.Future[Any]:
        """Allreduce `tensors` in place with `op` ("sum", "avg", "min", "max")."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self._lock:
            if self._closed:
                reason = (f": its thread died: {self._death!r}" if self._death else "")
                fut.set_exception(ReductionError(f"the appliance round pump is closed{reason}"))
                return fut
            devices = {t.device for t in tensors if t.device.type == "cuda"}
            ready = [torch.cuda.current_stream(d).record_event() for d in devices]
            self._inbox.put(_Collective(list(tensors), op, fut, ready=ready))
        self._poke()
        return fut

    def close(self, timeout_s: float = 60.0, *, abandon: bool = False) -> None:
        """Finish what was submitted (or with `abandon`, fail it at once), then stop the
        thread. The client stays open. Safe to call again, and after the thread died (its
        socket pair is released then too)."""
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._abandon = abandon
                self._inbox.put(None)
        if first:
            self._poke()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._wake.close()
        self._waker.close()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: it is awake anyway
            self._waker.send(b"!")

    # ---- the thread ----
    def _run(self) -> None:
        active: dict[int, _Collective] = {}
        stopping = False
        try:
            while True:
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stopping = True
                    else:
                        self._start(item, active)
                if stopping and self._abandon:
                    self._settle(self._client.abandon("the process group was aborted"), active)
                if stopping and not active:
                    return
                self._settle(self._client.progress(wake=self._wake), active)
                with contextlib.suppress(BlockingIOError):
                    while self._wake.recv(4096):
                        pass
        except BaseException as exc:
            self._die_of(exc)
            failed = {id(c): c for c in active.values()}
            with contextlib.suppress(queue.Empty):
                while (item := self._inbox.get_nowait()) is not None:
                    failed[id(item)] = item
            for coll in failed.values():
                if not coll.future.done():
                    coll.future.set_exception(ReductionError(
                        f"the appliance round pump died: {exc!r}"))
            raise

    def _die_of(self, exc: BaseException) -> None:
        with self._lock:
            self._closed = True
            if self._death is None:
                self._death = exc

    def _settle(self, outcomes: list[Outcome], active: dict[int, _Collective]) -> None:
        for outcome in outcomes:
            coll = active.pop(outcome.ticket)
            coll.rounds.discard(outcome.ticket)
            if outcome.error is not None and coll.error is None:
                coll.error = outcome.error
            if not coll.rounds:
                self._complete(coll)

    def _start(self, coll: _Collective, active: dict[int, _Collective]) -> None:
        try:
            for t in coll.tensors:
                refuse_unreducible(t)
            for event in coll.ready:
                event.synchronize()
            for t in coll.tensors:
                if t.device.type != "cpu":
                    buf = self._pool.take(t.dtype, t.numel())
                    host = buf[:t.numel()]
                    host.copy_(t.detach().reshape(-1))
                    coll.staged.append((t, host, buf))
                elif not t.is_contiguous():
                    host = t.detach().contiguous()
                    coll.staged.append((t, host, None))
                else:
                    host = t.detach()
                flat = numpy_view(host.reshape(-1))
                for chunk in np.array_split(
                        flat, self._client.pipeline.rounds_for(flat.nbytes)):
                    round_no = self._client.start(chunk, coll.op)
                    coll.rounds.add(round_no)
                    active[round_no] = coll
        except Exception as exc:  # a bad tensor fails its own collective, not the pump
            coll.error = exc
        if not coll.rounds:
            self._complete(coll)

    def _complete(self, coll: _Collective) -> None:
        try:
            self._write_back(coll)
        except BaseException as exc:  # the thread dies of it: this caller must not wait
            # Closed before the caller hears: its next submit is refused, never queued to a
            # thread on its way out.
            self._die_of(exc)
            if not coll.future.done():
                coll.future.set_exception(ReductionError(
                    f"the appliance round pump died: {exc!r}"))
            raise

    def _write_back(self, coll: _Collective) -> None:
        for t, host, buf in coll.staged:
            if coll.error is None:
                # Past autograd, as Gloo writes: a parameter (a leaf that requires grad) or a
                # view of one may be all_reduced in place.
                t.detach().copy_(host.view_as(t))
            if buf is not None:
                self._pool.give_back(buf)
        if coll.error is not None:
            coll.future.set_exception(coll.error)
        else:
            coll.future.set_result(coll.tensors)
