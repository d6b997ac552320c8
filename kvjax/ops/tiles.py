"""Power-of-two arithmetic, written once: Triton tiles have power-of-two shapes (head widths need not), and
schedules and step shapes are bucketed to powers of two."""

from __future__ import annotations

import math


def tile(width: int) -> int:
    """The power-of-two tile width (at least 16) that holds ``width`` columns."""
    return max(16, 1 << math.ceil(math.log2(width)))


def pow2_floor(n: float) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 << max(0, int(math.floor(math.log2(max(n, 1)))))


def pow2_ceil(n: float) -> int:
    """The smallest power of two >= n (1 for n <= 1): the bucketed sizes of schedules and of the steps' shapes,
    so that a jitted function sees few distinct shapes."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def is_pow2(n, at_least: int = 1) -> bool:
    """``n`` is an integer power of two of at least ``at_least`` (a bool is no integer here)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= at_least and not n & (n - 1)


def segments(width: int, max_segments: int, min_saving: int = 0) -> tuple[tuple[int, int, int], ...]:
    """How a head ``width`` columns wide is read: (start, tile, columns) power-of-two pieces, widest first, at most
    ``max_segments`` (the last padded to its tile), or one tile where pieces do not each save ``min_saving`` columns.

    Why: one tile wastes up to 60% of its columns (80 on a 128 tile); exact pieces (80 = 64 + 16) load only the
    head's columns at the price of one more dot per piece."""
    pieces: list[tuple[int, int, int]] = []
    start = 0
    while start < width:
        rest = width - start
        t = tile(rest) if len(pieces) == max_segments - 1 else max(16, pow2_floor(rest))
        pieces.append((start, t, min(t, rest)))
        start += t
    if tile(width) - sum(t for _, t, _ in pieces) < min_saving * (len(pieces) - 1):
        return ((0, tile(width), width),)
    return tuple(pieces)


def loaded_columns(width: int, max_segments: int, min_saving: int = 0) -> int:
    """Columns a head ``width`` wide loads per row when read as ``segments`` (its pieces' tiles together)."""
    return sum(t for _, t, _ in segments(width, max_segments, min_saving))
