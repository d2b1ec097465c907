"""How fast this machine runs Python just now: a figure to read a benchmark's ratios with.

    python -m reduction_appliance.bench.gauge [--repeat 9]

On a shared machine the same code runs at different speeds from one hour to the next. On the
development machine (2 vCPUs) `bench.hotpath` read a worker's Python at 10.3 us per segment in
one hour and at 14-18 us in others, with the hypervisor stealing under 3% of the CPU. Where the
appliance is CPU-bound (its data path is Python) and Gloo is link-bound (C++), the ratio
between them follows that speed, so each benchmark run prints this gauge before and after it.

The gauge is the median of nine timings of a plain interpreter loop: under a second of CPU, no
allocation, no I/O. Lower is faster. The median, not the best: on the development machine
consecutive timings of the loop read 60-63 ms for seconds on end with a single 42 ms among them,
and the best of a few picks such a moment, not the speed a run of a minute meets. It says
nothing absolute; compare it between runs on one machine (docs/benchmarks.md quotes what it
read next to `bench.hotpath`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

__all__ = ["framing", "interpreter_ms", "main"]

_ITERATIONS = 1_000_000


def _loop() -> float:
    """Seconds for one pass of the reference loop."""
    start = time.perf_counter()
    x = 0
    for i in range(_ITERATIONS):
        x = i * 2
    del x
    return time.perf_counter() - start


def interpreter_ms(repeat: int = 9) -> float:
    """Milliseconds for a million turns of a plain Python loop, the median of `repeat`
    timings."""
    if repeat < 1:
        raise ValueError(f"repeat is at least 1, not {repeat}")
    return statistics.median(_loop() for _ in range(repeat)) * 1e3


def framing(before_ms: float, after_ms: float) -> str:
    """The line a benchmark prints about the gauge taken before and after its run."""
    return (f"this machine's Python (bench.gauge: a million loop turns, lower is faster): "
            f"{before_ms:.1f} ms before the run, {after_ms:.1f} ms after")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.gauge",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9, help="timings; the median is shown")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    timings = [_loop() * 1e3 for _ in range(args.repeat)]
    print(f"{statistics.median(timings):.1f} ms for a million turns of a plain Python loop "
          f"(median; lower is faster); timings {', '.join(f'{t:.1f}' for t in timings)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
