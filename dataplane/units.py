"""Byte sizes for people: the one parser (command lines, configs) and the one formatter
(tables, status, reports). Binary units throughout: 1 KiB = 1024 bytes. And lists of ranks
for people: a job of a thousand ranks that lost a rack is "ranks 0-511", not 512 numbers."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["format_ranks", "format_size", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """`64MiB`, `1KiB`, `4096`, `2g` -> bytes; ValueError says what a size looks like."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (e.g. 4096, 1KiB, 64MiB)")
    return int(digits) * _UNITS[unit]


def format_size(n: float) -> str:
    """1536 -> '1.5 KiB', 67108864 -> '64 MiB', 100 -> '100 B'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            if unit == "B" or n == int(n):
                return f"{n:.0f} {unit}"
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_ranks(ranks: Iterable[int], runs: int = 8) -> str:
    """[0, 1, 2, 3, 7, 9, 10] -> '0-3, 7, 9, 10': runs of consecutive ranks (two as two), the
    first `runs` of them, then how many ranks the rest hold ('0-3, 7, and 40 more')."""
    ordered = sorted(set(ranks))
    spans: list[tuple[int, int]] = []
    for rank in ordered:
        if spans and rank == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], rank)
        else:
            spans.append((rank, rank))
    shown = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}"
             for a, b in spans[:runs]]
    rest = sum(b - a + 1 for a, b in spans[runs:])
    return ", ".join(shown + ([f"and {rest} more"] if rest else []))
