"""Work units of decode: runs of adjacent KV heads that one work item reads as one wider head.

A run's heads have adjacent columns in the packed K and V rows, so the kernel reads ``n`` of them with one page lookup
per token, ``n * G`` rows of its score tile (each row masked to its own head's columns, so every row keeps its own exact
softmax) and one tile over the run's K columns and one over its V columns. ``head_runs`` cuts a layer into the runs that
cost least by the op's cost model (``cost.token_cost``); the schedule is built over these runs and the kernel reads
them, so both take them from here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.cost import ROWS, token_cost
from kvjax.ops.tiles import tile


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The K and V widths of adjacent heads read as one unit: what the kernel compiles for (runs of one shape
    share code; their offsets differ)."""

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
    def shape(self) -> RunShape:
        return RunShape(self.k_widths, self.v_widths)


@dataclasses.dataclass(frozen=True)
class Run(RunShape):
    """KV heads ``first .. first + num_heads - 1`` of a layer, read as one unit."""

    first: int = 0


def run_cost(k_widths, v_widths, group_size: int, config: DecodeConfig = DECODE) -> float:
    """A token's cost in a run of these heads by their tiles (``cost.token_cost``; inf where not allowed, where
    several heads have fewer than ``config.pack_min_cols`` K or V columns together, or more than
    ``config.pack_max_heads`` heads)."""
    n = len(k_widths)
    if n > config.pack_max_heads or (n > 1 and min(sum(k_widths), sum(v_widths)) < config.pack_min_cols):
        return math.inf
    return token_cost(len(k_widths), tile(sum(k_widths)), tile(sum(v_widths)), group_size, config)


@functools.cache
def head_runs(layout: HeadLayout, config: DecodeConfig = DECODE) -> tuple[Run, ...]:
    """The layer's KV heads cut into the runs of adjacent heads that cost least together (dynamic programming over
    the cut points); ``config.pack_tile`` 0 keeps every head alone."""
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    n = layout.num_kv_heads
    best, start = [0.0] + [math.inf] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for first in range(max(0, end - max(ROWS // g, 1)), end):
            c = best[first] + run_cost(k[first:end], v[first:end], g, config)
            if c < best[end]:
                best[end], start[end] = c, first
    runs, end = [], n
    while end:
        first = start[end]
        runs.append(Run(k[first:end], v[first:end], first=first))
        end = first
    return tuple(reversed(runs))
