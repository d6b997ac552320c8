"""Runs: adjacent KV heads that one decode work item reads together.

A decode item scores a group's G query heads against one KV head's K rows in a 16-row score tile, and reads the
head through a power-of-two tile. Narrow heads of a compressed layer fill few of those rows, pay the per-token work
(page lookup, softmax) alone, and round their widths up to a tile (48 on a 64-wide tile, 80 on a 128-wide one).
Adjacent heads have adjacent columns in the packed K and V rows, so a run of ``n`` of them can be read as one
wider head: one page lookup per token, ``n * G`` rows of the score tile filled (each row masked to its own head's
columns of q), one tile over the run's K columns and one over its V columns (padding only once per run). Each row
keeps its own softmax, so the result is exact.

``head_runs`` picks the runs of a layer by dynamic programming over the tile cost model of a token (K tile + V
tile + ``token_cost``), with at most 16 rows and tiles at most ``max_tile`` wide; ``max_tile`` 0 keeps every head
alone (the layout as it is). The schedule (``kvjax.schedule``) plans runs as its work units, and the decode kernel
reads them; both take them from here, so they agree.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from kvjax.layout import HeadLayout

ROWS = 16  # rows of the kernels' score tile: the tensor cores' smallest M
TOKEN_COST = 32  # a token's fixed cost (page lookup, softmax) in columns of width, as the schedule weighs it


def tile(width: int) -> int:
    """Power-of-two tile width (>= 16) that holds ``width`` columns."""
    return max(16, 1 << math.ceil(math.log2(width)))


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The K and V widths of adjacent heads read as one unit; what the kernel compiles for (runs of one shape share
    code, their offsets differ)."""

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return len(self.k_widths)

    @property
    def k_cols(self) -> int:
        return sum(self.k_widths)

    @property
    def v_cols(self) -> int:
        return sum(self.v_widths)

    @property
    def k_starts(self) -> tuple[int, ...]:
        """Each head's first column among the run's K columns (its V columns: ``v_starts``)."""
        return tuple(HeadLayout.offsets(self.k_widths))

    @property
    def v_starts(self) -> tuple[int, ...]:
        return tuple(HeadLayout.offsets(self.v_widths))

    @property
    def shape(self) -> "RunShape":
        return RunShape(self.k_widths, self.v_widths)


@dataclasses.dataclass(frozen=True)
class Run(RunShape):
    """KV heads ``first .. first + num_heads - 1`` of a layer, read as one unit."""

    first: int = 0


@functools.lru_cache(maxsize=None)
def head_runs(layout: HeadLayout, max_tile: int = 0, token_cost: int = TOKEN_COST) -> tuple[Run, ...]:
    """The layer's KV heads cut into runs of adjacent heads, cheapest first by the cost model (see module doc).

    max_tile: widest tile a run may read for its K or for its V columns (0 or less: one head per run)."""
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    n = layout.num_kv_heads
    if max_tile <= 0 or g > ROWS // 2:
        return tuple(Run((k[h],), (v[h],), first=h) for h in range(n))
    best, start = [0] + [math.inf] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for first in range(max(0, end - ROWS // g), end):
            kt, vt = tile(sum(k[first:end])), tile(sum(v[first:end]))
            if end - first > 1 and max(kt, vt) > max_tile:
                continue
            cost = best[first] + kt + vt + token_cost
            if cost < best[end]:
                best[end], start[end] = cost, first
    runs, end = [], n
    while end:
        first = start[end]
        runs.append(Run(k[first:end], v[first:end], first=first))
        end = first
    return tuple(reversed(runs))
