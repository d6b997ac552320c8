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

The widths can move too, at a price: ``fill_runs`` moves a few 16-column steps between a layer's heads (the
layer's totals kept) so that its runs fill their tiles. Compression does so when asked (``fill_tiles``), moving
the columns whose energy matters least; unlike the order, that changes the model's output.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from kvjax.layout import HeadLayout

ROWS = 16  # rows of the kernels' score tile: the tensor cores' smallest M
TOKEN_COST = 32  # a token's fixed cost (page lookup, softmax) in columns of width, as the schedule weighs it
FLOOR_TILE = 128  # a token of a run costs at least one of a run of FLOOR_TILE + FLOOR_TILE columns (see run_cost)
PACK_TILE = 256  # the decode schedule's default widest tile a run of several heads may read (0: one head per unit)
PIECE_SAVING = 64  # decode reads a run's K (or V) columns as two pieces only where that saves this many columns
EXACT_ORDER_HEADS = 10  # order_heads searches every partition of up to this many KV heads (3^n steps)


def tile(width: int) -> int:
    """Power-of-two tile width (>= 16) that holds ``width`` columns."""
    return max(16, 1 << math.ceil(math.log2(width)))


def pow2_floor(n: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(n, 1)))))


def segments(width: int, max_segments: int, min_saving: int = 0) -> tuple[tuple[int, int, int], ...]:
    """How a head ``width`` columns wide is read: (start, tile, columns) pieces with power-of-two tiles, widest
    first, at most ``max_segments`` of them (the last one padded to its tile when the width needs more).

    One piece (``tile(width)``) wastes up to 60% of the columns (80 on a 128 tile); exact pieces (80 = 64 + 16)
    load and multiply only the head's own columns, at the price of one more (smaller) dot per piece. So pieces are
    taken only where they load at least ``min_saving`` fewer columns per extra piece than one tile would."""
    pieces, start = [], 0
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
    return _priced(len(k_widths), tile(sum(k_widths)), tile(sum(v_widths)), group_size, max_tile, token_cost)


def _priced(num_heads: int, k_tile: int, v_tile: int, group_size: int, max_tile: int, token_cost: int) -> float:
    """``run_cost``'s rule for a run of ``num_heads`` heads read through ``k_tile`` + ``v_tile`` columns (the
    callers that already know a run's tiles, or count its loaded columns instead, use it directly)."""
    if num_heads > 1 and (max_tile <= 0 or num_heads * group_size > ROWS or max(k_tile, v_tile) > max_tile):
        return math.inf
    return max(k_tile + v_tile, 2 * FLOOR_TILE) + token_cost


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
    costs = [run_cost([k[h] for h in hs], [v[h] for h in hs], g, max_tile, token_cost) if hs else 0.0
             for hs in _members(n)]
    best, part = _best_partition(costs)
    if runs_cost(layout, max_tile, token_cost) <= best:
        return identity
    return tuple(h for hs in part for h in hs)


def _members(n: int) -> list[tuple[int, ...]]:
    """The heads of every subset mask of n heads."""
    return [tuple(h for h in range(n) if m >> h & 1) for m in range(1 << n)]


def _best_partition(costs) -> tuple[float, tuple[tuple[int, ...], ...]]:
    """The partition of n heads into runs of least total cost (``costs[mask]``: a run of the heads in the mask), by
    dynamic programming over subsets; and its cost."""
    full = len(costs) - 1
    best, part = [0.0] + [math.inf] * full, [0] * (full + 1)
    for m in range(1, full + 1):
        low = m & -m  # the lowest head of m is in the run chosen for it: each partition is counted once
        rest = sub = m ^ low
        while True:
            c = costs[sub | low] + best[m ^ (sub | low)]
            if c < best[m]:
                best[m], part[m] = c, sub | low
            if not sub:
                break
            sub = (sub - 1) & rest
    runs, m = [], full
    members = _members(full.bit_length())
    while m:
        runs.append(members[part[m]])
        m ^= part[m]
    return best[full], tuple(runs)


def _partition(layout: HeadLayout, order, max_tile: int, token_cost: int) -> tuple[tuple[int, ...], ...]:
    """The heads of each run of the layout in ``order`` (as heads of ``layout``)."""
    return tuple(tuple(order[r.first + i] for i in range(r.num_heads))
                 for r in head_runs(permuted(layout, order), max_tile, token_cost))


def _shift_options(losses) -> dict[int, tuple[float, tuple[int, ...]]]:
    """For a run's heads (row h: the loss of shifting head h by ``j - m`` steps): per total shift of the run, the
    least loss and the heads' shifts that reach it (a min-plus convolution)."""
    best = {0: (0.0, ())}
    for loss in losses:
        m = (len(loss) - 1) // 2
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for total, (acc, shifts) in best.items():
            for j, cost in enumerate(loss):
                t = total + j - m
                if math.isfinite(cost) and (t not in nxt or acc + cost < nxt[t][0]):
                    nxt[t] = (acc + cost, shifts + (j - m,))
        best = nxt
    return best


def _priced_costs(layout: HeadLayout, lk, lv, price, max_tile: int, token_cost: int) -> list[float]:
    """Per subset mask of the heads: the least cost of their run when its K and V totals may move as far as its
    heads may (``lk``/``lv``: inf where a head's shift is out of range), every 16-column step of K priced at
    ``price[0]`` columns and of V at ``price[1]`` (a Lagrangian relaxation of keeping the layer's totals: -16 makes
    a column that fills a tile free). Its best partition is a candidate for ``fill_runs``."""
    n, g, m = layout.num_kv_heads, layout.group_size, (lk.shape[1] - 1) // 2

    def reach(t):  # each head's least and greatest allowed shift
        ok = np.isfinite(t)
        return ok.argmax(1) - m, t.shape[1] - 1 - ok[:, ::-1].argmax(1) - m

    (lo_k, hi_k), (lo_v, hi_v) = reach(lk), reach(lv)

    def tiles(total, lo, hi, unit_price):  # {tile: least priced shift} over the run's reachable totals
        out: dict[int, float] = {}
        for step in range(lo, hi + 1):
            t, p = tile(total + 16 * step), unit_price * step + 1e-3 * abs(step)
            out[t] = min(out.get(t, math.inf), p)
        return out

    costs = [0.0]
    for hs in _members(n)[1:]:
        idx = list(hs)
        tk = tiles(sum(layout.k_widths[h] for h in hs), int(lo_k[idx].sum()), int(hi_k[idx].sum()), price[0])
        tv = tiles(sum(layout.v_widths[h] for h in hs), int(lo_v[idx].sum()), int(hi_v[idx].sum()), price[1])
        costs.append(min(_priced(len(hs), a, b, g, max_tile, token_cost) + pa + pb
                         for a, pa in tk.items() for b, pb in tv.items()))
    return costs


def fill_runs(layout: HeadLayout, max_tile: int = PACK_TILE, max_shift: int = 32, k_loss=None, v_loss=None,
              token_cost: int = TOKEN_COST) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K and V widths moved between the layer's heads so its runs fill their tiles: each head's width moves by at
    most ``max_shift`` columns (steps of 16, within [16, head_dim]), the layer's K total and V total stay, and the
    runs (at their best head order) cost least; among the cheapest, the least loss. Returns the widths unchanged
    when no move makes the runs cheaper, by tiles and by the columns the kernel loads (``loaded_cost``).

    Why: a run's time follows its tiles more than its bytes (bench/RESULTS.md, sixth session), so a rate-0.5 layer
    whose runs hold K 128 + V 208, K 256 + V 176 and K 128 + V 128 columns is slower than the same columns moved
    into two runs of K 256 + V 256.

    ``k_loss[h][j]`` (and ``v_loss``): what moving head h's width by ``16 * (j - max_shift // 16)`` columns costs
    (compression: the share of the head's energy it drops, negative where it adds); by default the columns moved.
    Searched per candidate partition of the heads into runs (the best runs of the given widths, the heads sorted by
    width in blocks of each allowed run size, and the best partitions when moved columns are priced instead of
    balanced), by dynamic programming over the partition's runs (``_fill``). A heuristic: on small random layers it
    misses the cheapest widths about once in 40."""
    n, d, m = layout.num_kv_heads, layout.head_dim, max_shift // 16
    steps = np.arange(-m, m + 1)

    def losses(widths, given):
        table = np.abs(steps)[None, :].repeat(n, 0).astype(float) if given is None else np.array(given, float)
        moved = np.asarray(widths)[:, None] + 16 * steps[None, :]
        table[(moved < 16) | (moved > d)] = math.inf
        return table

    k, v = layout.k_widths, layout.v_widths
    lk, lv = losses(k, k_loss), losses(v, v_loss)
    by_width = sorted(range(n), key=lambda h: (k[h] + v[h], h))
    candidates = {_partition(layout, order_heads(layout, max_tile, token_cost), max_tile, token_cost)}
    candidates |= {tuple(tuple(by_width[i:i + size]) for i in range(0, n, size))
                   for size in range(1, max(ROWS // layout.group_size, 1) + 1)}
    if n <= EXACT_ORDER_HEADS:
        candidates |= {_best_partition(_priced_costs(layout, lk, lv, price, max_tile, token_cost))[1]
                       for price in ((-16, -16), (-8, -8), (0, 0), (-16, 0), (0, -16))}
    best_key, best = (runs_cost(layout, max_tile, token_cost) - 8) * 1e3, (k, v)  # cheaper runs only
    for part in sorted(candidates):
        key, widths = _fill(layout, part, lk, lv, max_tile, token_cost)
        if key < best_key:
            best_key, best = key, widths
    filled = dataclasses.replace(layout, k_widths=best[0], v_widths=best[1])
    if loaded_cost(filled, max_tile, token_cost) >= loaded_cost(layout, max_tile, token_cost):
        return k, v  # cheaper tiles, but the kernel would not load fewer columns
    return best


def loaded_cost(layout: HeadLayout, max_tile: int = PACK_TILE, token_cost: int = TOKEN_COST) -> float:
    """A token's cost over the layer's runs at their best head order, counted by the columns the decode kernel loads
    (a run's K or V columns read as two pieces where that saves ``PIECE_SAVING``: 160 = 128 + 32) instead of by
    tiles. ``fill_runs`` checks its moves with it: by tiles alone, the rate-0.7 layer's moves promised 15% and
    measured nothing, since the kernel already read its 160-column run as 128 + 32 (bench/RESULTS.md, sixth
    session)."""
    lay = permuted(layout, order_heads(layout, max_tile, token_cost))
    loaded = functools.partial(loaded_columns, max_segments=2, min_saving=PIECE_SAVING)
    return sum(_priced(r.num_heads, loaded(r.k_cols), loaded(r.v_cols), layout.group_size, max_tile, token_cost)
               for r in head_runs(lay, max_tile, token_cost))


def _fill(layout: HeadLayout, part, lk, lv, max_tile: int, token_cost: int):
    """``fill_runs`` for one partition of the heads into runs: (runs' cost * 1e3 + loss, (k widths, v widths)).

    Dynamic programming over the runs, on the K and V totals shifted so far ([-span, span] steps each); a run's
    options are its total shifts, each at the least loss its heads reach it with (``_shift_options``). Losses stay
    far below the 16e3 of one step in cost, so cost comes first and loss second."""
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    span = (lk.shape[1] - 1) // 2 * layout.num_kv_heads
    key = np.full((2 * span + 1,) * 2, math.inf)  # [K shift, V shift] so far -> least cost * 1e3 + loss
    key[span, span] = 0.0
    choices = []
    for heads in part:
        ok, ov = _shift_options(lk[list(heads)]), _shift_options(lv[list(heads)])
        kk, vv = sum(k[h] for h in heads), sum(v[h] for h in heads)
        new, arg = np.full_like(key, math.inf), np.zeros(key.shape + (2,), np.int64)
        for dk, (loss_k, _) in ok.items():
            for dv, (loss_v, _) in ov.items():
                cost = _priced(len(heads), tile(kk + 16 * dk), tile(vv + 16 * dv), g, max_tile, token_cost)
                if not math.isfinite(cost):
                    continue
                moved = np.full_like(key, math.inf)  # key shifted by (dk, dv): the totals after this run
                src = key[max(0, -dk):2 * span + 1 - max(0, dk), max(0, -dv):2 * span + 1 - max(0, dv)]
                moved[max(0, dk):max(0, dk) + src.shape[0], max(0, dv):max(0, dv) + src.shape[1]] = src
                moved += cost * 1e3 + loss_k + loss_v
                better = moved < new
                new[better], arg[better] = moved[better], (dk, dv)
        choices.append((heads, ok, ov, arg))
        key = new
    widths = [list(k), list(v)]
    if not math.isfinite(key[span, span]):
        return math.inf, (k, v)
    i = j = span
    for heads, ok, ov, arg in reversed(choices):  # back from "totals kept" to each run's shifts
        dk, dv = (int(x) for x in arg[i, j])
        for h, sk, sv in zip(heads, ok[dk][1], ov[dv][1]):
            widths[0][h] += 16 * sk
            widths[1][h] += 16 * sv
        i, j = i - dk, j - dv
    return key[span, span], (tuple(widths[0]), tuple(widths[1]))
