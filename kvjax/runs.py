"""Runs: adjacent KV heads that one decode work item reads together.

A decode item scores a group's G query heads against one KV head's K rows in a 16-row score tile, and reads the
head through a power-of-two tile. Narrow heads of a compressed layer fill few of those rows, pay the per-token work
(page lookup, softmax) alone, and round their widths up to a tile (48 on a 64-wide tile, 80 on a 128-wide one).
Adjacent heads have adjacent columns in the packed K and V rows, so a run of ``n`` of them can be read as one
wider head: one page lookup per token, ``n * G`` rows of the score tile filled (each row masked to its own head's
columns of q), one tile over the run's K columns and one over its V columns (padding only once per run). Each row
keeps its own softmax, so the result is exact.

``head_runs`` picks the runs of a layer by dynamic programming over the cost model of a token (``run_cost``: K
tile + V tile, at least a 128+128 run's, + ``token_cost``), with at most 16 rows and tiles at most ``max_tile``
wide; ``max_tile`` 0 keeps every head alone (the layout as it is). Measured, a narrow run costs about as much as a
full one, so the fewest runs win. The schedule (``kvjax.schedule``) plans runs as its work units, and the decode
kernel reads them; both take them from here, so they agree.

Only adjacent heads can form a run, but the order of a layer's KV heads is free: permuting them (each with its
query heads, and W_o's rows alike) leaves the model's output unchanged. ``order_heads`` finds the order whose runs
cost least (48 next to 80, 96 next to 32), and compression folds it into the weights (``RankPlan.head_order``):
on a rate-0.5 layer, 13% faster than the drawn order at batch 32 and 128 x 4K (bench/RESULTS.md, fifth session).
"""
from __future__ import annotations

import dataclasses
import functools
import math

from kvjax.layout import HeadLayout

ROWS = 16  # rows of the kernels' score tile: the tensor cores' smallest M
TOKEN_COST = 32  # a token's fixed cost (page lookup, softmax) in columns of width, as the schedule weighs it
FLOOR_TILE = 128  # a token of a run costs at least one of a run of FLOOR_TILE + FLOOR_TILE columns (see run_cost)
PACK_TILE = 256  # the decode schedule's default widest tile a run of several heads may read (0: one head per unit)
EXACT_ORDER_HEADS = 10  # order_heads searches every partition of up to this many KV heads (3^n steps)


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


def run_cost(k_widths, v_widths, group_size: int, max_tile: int, token_cost: int = TOKEN_COST) -> float:
    """A token's cost in a run of these heads: K tile + V tile columns, but at least ``2 * FLOOR_TILE``, plus
    ``token_cost``; inf where the run is not allowed (more than 16 rows, or several heads through a tile wider than
    ``max_tile``).

    The floor is measured (bench/RESULTS.md, fifth session): in the H100's mixed-width layers, splitting two narrow
    runs (32+16 and 64+32 tile columns) off the rate-0.7 layer made it 40% slower, and a layer's time follows its
    number of runs (about 26 us each at batch 32 x 4K) more than its tile columns. Priced right by the schedule, such
    narrow runs still cost about 0.55-0.6 of a full one, and 160-192-column runs about a full one; the floor is the
    simple bound that picks the fewest runs and balanced best."""
    n = len(k_widths)
    kt, vt = tile(sum(k_widths)), tile(sum(v_widths))
    if n > 1 and (max_tile <= 0 or n * group_size > ROWS or max(kt, vt) > max_tile):
        return math.inf
    return max(kt + vt, 2 * FLOOR_TILE) + token_cost


@functools.lru_cache(maxsize=None)
def head_runs(layout: HeadLayout, max_tile: int = 0, token_cost: int = TOKEN_COST) -> tuple[Run, ...]:
    """The layer's KV heads cut into runs of adjacent heads, cheapest first by the cost model (see module doc).

    max_tile: widest tile a run may read for its K or for its V columns (0 or less: one head per run)."""
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    n = layout.num_kv_heads
    best, start = [0.0] + [math.inf] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for first in range(max(0, end - max(ROWS // g, 1)), end):
            cost = best[first] + run_cost(k[first:end], v[first:end], g, max_tile, token_cost)
            if cost < best[end]:
                best[end], start[end] = cost, first
    runs, end = [], n
    while end:
        first = start[end]
        runs.append(Run(k[first:end], v[first:end], first=first))
        end = first
    return tuple(reversed(runs))


def runs_cost(layout: HeadLayout, max_tile: int = PACK_TILE, token_cost: int = TOKEN_COST) -> float:
    """A token's cost over all the layer's runs (``head_runs``)."""
    return sum(run_cost(r.k_widths, r.v_widths, layout.group_size, max_tile, token_cost)
               for r in head_runs(layout, max_tile, token_cost))


def permuted(layout: HeadLayout, order) -> HeadLayout:
    """The layout with its KV heads in ``order`` (new position -> old head)."""
    return dataclasses.replace(layout, k_widths=tuple(layout.k_widths[h] for h in order),
                               v_widths=tuple(layout.v_widths[h] for h in order))


def order_heads(layout: HeadLayout, max_tile: int = PACK_TILE, token_cost: int = TOKEN_COST) -> tuple[int, ...]:
    """The order of the layer's KV heads (new position -> old head) whose runs cost least; the identity when it is
    already as cheap. Exact (the best partition of the heads into runs, by dynamic programming over subsets) for
    up to ``EXACT_ORDER_HEADS`` heads; past that, the cheaper of the given order and the heads sorted by width."""
    n, identity = layout.num_kv_heads, tuple(range(layout.num_kv_heads))
    if n > EXACT_ORDER_HEADS:
        by_width = tuple(sorted(identity, key=lambda h: (layout.k_widths[h] + layout.v_widths[h], h)))
        return min((identity, by_width), key=lambda o: runs_cost(permuted(layout, o), max_tile, token_cost))
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    members = [tuple(h for h in range(n) if m >> h & 1) for m in range(1 << n)]
    cost = [run_cost([k[h] for h in hs], [v[h] for h in hs], g, max_tile, token_cost) if hs else 0.0
            for hs in members]
    best, part = [0.0] + [math.inf] * ((1 << n) - 1), [0] * (1 << n)
    for m in range(1, 1 << n):
        low = m & -m  # the lowest head of m is in the run chosen for it: each partition is counted once
        rest = sub = m ^ low
        while True:
            c = cost[sub | low] + best[m ^ (sub | low)]
            if c < best[m]:
                best[m], part[m] = c, sub | low
            if not sub:
                break
            sub = (sub - 1) & rest
    if runs_cost(layout, max_tile, token_cost) <= best[-1]:
        return identity
    order, m = [], (1 << n) - 1
    while m:
        order += members[part[m]]
        m ^= part[m]
    return tuple(order)
