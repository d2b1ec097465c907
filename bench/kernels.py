"""Reduce-kernel throughput next to memcpy, measured in one run on the same buffers.

    python -m reduction_appliance.bench.kernels [--backend torch] \\
        [--sizes 64KiB,256KiB,1MiB,16MiB] [--json]

Per segment size and dtype it reports the median GB/s, counted in *input* bytes (what arrives on
the wire), of ``add`` (the per-contribution hot path), ``first`` and ``finish`` (avg, so its
divide pass is included), and of ``np.copyto`` of the same number of bytes from the same payload
buffer into the same accumulator memory. Absolute numbers drift +-30% between runs on shared
machines (the 2-core development machine: see docs/benchmarks.md), so the targets are checked
as ratios to copyto measured
side by side, interleaved round by round, or as floors far below the expected speed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypedDict

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.dtypes import DTYPES
from reduction_appliance.dataplane.reduce import (
    KernelTable,
    available_backends,
    element_view,
    select_kernels,
)
from reduction_appliance.dataplane.units import format_size, parse_size
from reduction_appliance.dataplane.wire import DType, Op

__all__ = [
    "DEFAULT_SIZES",
    "Row",
    "Target",
    "check_targets",
    "format_table",
    "main",
    "run",
]

DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 16 << 20)

# Targets: fp32 folding must keep up with memcpy while the segment is in cache; the 2-byte
# dtypes must stay clear of numpy's ~1 GB/s float16 cast (see dataplane/reduce.py).
FP32_ADD_VS_COPYTO = 0.70
FP32_TARGET_SIZES = (64 << 10, 1 << 20)  # inclusive range of segment sizes the ratio applies to
HALF_ADD_GBPS = 3.0

# One timed sample runs a batch of calls lasting about this long: long enough that
# perf_counter's resolution and the loop are noise, short enough to give many samples.
_SAMPLE_S = 0.5e-3
_ALIGN = 64  # receive slots are 64-byte aligned in the arena
_DTYPES = tuple(d.dtype for d in DTYPES)


class Row(TypedDict):
    backend: str
    dtype: str
    size: int
    copyto_gbps: float
    add_gbps: float
    first_gbps: float
    finish_gbps: float
    add_vs_copyto: float
    # fp32 only: bare np.add(acc, elements, acc), the ufunc alone: the ceiling for add
    # any kernel must create per call; the ceiling for fp32 add, shown to separate the kernel's
    # own Python overhead from the ufunc's.
    bare_add_gbps: float | None


class Target(TypedDict):
    name: str
    passed: bool
    worst: float
    at_size: int


def _segment_size(text: str) -> int:
    size = parse_size(text)
    if size <= 0 or size % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def _aligned_bytes(nbytes: int) -> NDArray[np.uint8]:
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + nbytes]


def _time_interleaved(calls: Sequence[Callable[[], object]], budget_s: float) -> list[float]:
    """Median seconds per call of each callable, sampled round-robin so drift hits all alike."""
    batch = []
    for f in calls:
        f()  # warm up: page faults, lazy scratch growth, torch dispatch caches
        t0 = time.perf_counter()
        f()
        per_call = max(time.perf_counter() - t0, 1e-7)
        batch.append(max(1, int(_SAMPLE_S / per_call)))
    samples: list[list[float]] = [[] for _ in calls]
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(samples[0]) < 5:
        for f, k, out in zip(calls, batch, samples, strict=True):
            t0 = time.perf_counter()
            for _ in range(k):
                f()
            out.append((time.perf_counter() - t0) / k)
    return [float(np.median(s)) for s in samples]


def _measure(table: KernelTable, dtype: DType, size: int, budget_s: float) -> Row:
    n = size // dtype.itemsize
    rng = np.random.default_rng(size)
    # Moderate values: repeated adds stay finite, and no subnormals slow the FPU.
    values = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    payload = _aligned_bytes(size)
    if dtype is DType.FLOAT32:
        payload.view(np.float32)[:] = values
    else:
        # Narrow with the kernels themselves so bf16 needs no ml_dtypes here.
        table.kernel(dtype, Op.SUM).finish(values, 1, payload)
    acc = _aligned_bytes(4 * n).view(np.float32)
    out = _aligned_bytes(size)
    copy_dst = acc.view(np.uint8)[:size]
    adder, avg = table.kernel(dtype, Op.SUM), table.kernel(dtype, Op.AVG)
    # Kernels take element views, built once per receive buffer by the aggregator.
    elements = element_view(payload, dtype)
    adder.first(acc, elements)
    calls: list[Callable[[], object]] = [
        lambda: np.copyto(copy_dst, payload),
        lambda: adder.add(acc, elements),
        lambda: adder.first(acc, elements),
        lambda: avg.finish(acc, 1, out),  # count 1: the divide runs, values stay put
    ]
    if dtype is DType.FLOAT32:
        calls.append(lambda: np.add(acc, elements, acc))
    copy_s, add_s, first_s, finish_s, *bare_s = _time_interleaved(calls, budget_s)
    gb = size / 1e9
    return Row(
        backend=table.backend,
        dtype=dtype.name,
        size=size,
        copyto_gbps=gb / copy_s,
        add_gbps=gb / add_s,
        first_gbps=gb / first_s,
        finish_gbps=gb / finish_s,
        add_vs_copyto=copy_s / add_s,
        bare_add_gbps=gb / bare_s[0] if bare_s else None,
    )


def run(
    backend: str | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    budget_s: float = 1.2,
    torch_threads: int | None = 1,
) -> list[Row]:
    """Measure every (size, dtype); ``budget_s`` is the sampling time per row.

    ``torch_threads`` (default 1) calls torch.set_num_threads first: the appliance runs one
    single-threaded data-plane process per core, and copyto here is single-threaded too.
    """
    table = select_kernels(backend)
    if table.backend == "torch" and torch_threads is not None:
        torch = importlib.import_module("torch")
        torch.set_num_threads(torch_threads)
    return [_measure(table, dt, size, budget_s) for size in sizes for dt in _DTYPES]


def check_targets(rows: Sequence[Row]) -> list[Target]:
    """The PASS/FAIL verdicts, worst case over the sizes each target covers."""
    lo, hi = FP32_TARGET_SIZES
    specs: list[tuple[str, str, Callable[[Row], float], float, Callable[[int], bool]]] = [
        (
            f"fp32 add >= {FP32_ADD_VS_COPYTO:.0%} of copyto, {format_size(lo)}-{format_size(hi)}",
            DType.FLOAT32.name,
            lambda r: r["add_vs_copyto"],
            FP32_ADD_VS_COPYTO,
            lambda s: lo <= s <= hi,
        ),
        (
            f"fp16 add >= {HALF_ADD_GBPS} GB/s",
            DType.FLOAT16.name,
            lambda r: r["add_gbps"],
            HALF_ADD_GBPS,
            lambda s: True,
        ),
        (
            f"bf16 add >= {HALF_ADD_GBPS} GB/s",
            DType.BFLOAT16.name,
            lambda r: r["add_gbps"],
            HALF_ADD_GBPS,
            lambda s: True,
        ),
    ]
    targets = []
    for name, dtype, metric, floor, covers in specs:
        mine = [r for r in rows if r["dtype"] == dtype and covers(r["size"])]
        if not mine:
            continue
        worst = min(mine, key=metric)
        targets.append(
            Target(
                name=name, passed=metric(worst) >= floor, worst=metric(worst), at_size=worst["size"]
            )
        )
    return targets


def format_table(rows: Sequence[Row], targets: Sequence[Target]) -> str:
    head = ("size", "dtype", "copyto", "add", "first", "finish", "add/copyto", "bare np.add")
    lines = [
        f"backend: {rows[0]['backend'] if rows else '-'}   (GB/s of input bytes, medians;"
        " bare np.add: fp32 ufunc alone, the ceiling for add)",
        "{:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>11} {:>12}".format(*head),
    ]
    for r in rows:
        bare = r["bare_add_gbps"]
        lines.append(
            f"{format_size(r['size']):>8} {r['dtype']:>9} {r['copyto_gbps']:8.2f} "
            f"{r['add_gbps']:8.2f}"
            f" {r['first_gbps']:8.2f} {r['finish_gbps']:8.2f} {r['add_vs_copyto']:11.2f}"
            f" {'-' if bare is None else f'{bare:.2f}':>12}"
        )
    for t in targets:
        verdict = "PASS" if t["passed"] else "FAIL"
        lines.append(f"{verdict}  {t['name']}: worst {t['worst']:.2f} at "
                     f"{format_size(t['at_size'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.kernels",
                                     description=__doc__)
    parser.add_argument("--backend", choices=available_backends(), help="default: best here")
    parser.add_argument(
        "--sizes",
        type=lambda s: [_segment_size(x) for x in s.split(",")],
        default=list(DEFAULT_SIZES),
        help="comma-separated segment sizes in input bytes, e.g. 64KiB,1MiB",
    )
    parser.add_argument("--budget", type=float, default=1.2, help="seconds sampled per row")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print rows and verdicts as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 if any target fails")
    args = parser.parse_args(argv)
    rows = run(args.backend, args.sizes, args.budget, args.torch_threads)
    targets = check_targets(rows)
    if args.json:
        print(json.dumps({"rows": rows, "targets": targets}, indent=2))
    else:
        print(format_table(rows, targets))
    return 1 if args.check and not all(t["passed"] for t in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
