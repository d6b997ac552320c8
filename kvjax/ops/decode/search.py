"""Searches over a layer's runs for compression: the head order whose runs cost least, and widths moved between
heads so runs fill their tiles.

The order of a layer's KV heads is free: permuting them (each with its query heads, and W_o's rows alike) leaves
the model's output unchanged, so compression stores them in the order ``order_heads`` finds (48 next to 80, 96 next
to 32). Widths can move too, at a price in accuracy: ``fill_runs`` moves a few 16-column steps between heads,
keeping the layer's totals. Both price runs with the decode op's cost model (``cost.token_cost``); the bytes are
the same for every candidate of a layer, so they are left out.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.cost import ROWS, loaded, token_cost
from kvjax.ops.decode.units import head_runs, run_cost
from kvjax.ops.tiles import tile

EXACT_ORDER_HEADS = 10  # order_heads searches every partition of up to this many KV heads (3^n steps)


def runs_cost(layout: HeadLayout, config: DecodeConfig = DECODE) -> float:
    """A token's cost over all the layer's runs (``head_runs``)."""
    return sum(run_cost(r.k_widths, r.v_widths, layout.group_size, config) for r in head_runs(layout, config))


def permuted(layout: HeadLayout, order) -> HeadLayout:
    """The layout with its KV heads in ``order`` (new position -> old head)."""
    return dataclasses.replace(
        layout, k_widths=tuple(layout.k_widths[h] for h in order), v_widths=tuple(layout.v_widths[h] for h in order)
    )


def order_heads(layout: HeadLayout, config: DecodeConfig = DECODE) -> tuple[int, ...]:
    """The order of the layer's KV heads (new position -> old head) whose runs cost least; the identity when it is
    already as cheap. Exact (the best partition of the heads into runs, by dynamic programming over subsets) for
    up to ``EXACT_ORDER_HEADS`` heads; past that, the cheaper of the given order and the heads sorted by width."""
    n, identity = layout.num_kv_heads, tuple(range(layout.num_kv_heads))
    if n > EXACT_ORDER_HEADS:
        by_width = tuple(sorted(identity, key=lambda h: (layout.k_widths[h] + layout.v_widths[h], h)))
        return min((identity, by_width), key=lambda o: runs_cost(permuted(layout, o), config))
    k, v, g = layout.k_widths, layout.v_widths, layout.group_size
    costs = [run_cost([k[h] for h in hs], [v[h] for h in hs], g, config) if hs else 0.0 for hs in _members(n)]
    best, part = _best_partition(costs)
    if runs_cost(layout, config) <= best:
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


def _partition(layout: HeadLayout, order, config: DecodeConfig) -> tuple[tuple[int, ...], ...]:
    """The heads of each run of the layout in ``order`` (as heads of ``layout``)."""
    return tuple(
        tuple(order[r.first + i] for i in range(r.num_heads)) for r in head_runs(permuted(layout, order), config)
    )


def _shift_options(losses) -> dict[int, tuple[float, tuple[int, ...]]]:
    """For a run's heads (row h: the loss of shifting head h by ``j - m`` steps): per total shift of the run, the
    least loss and the heads' shifts that reach it (a min-plus convolution)."""
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
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


def _priced_costs(layout: HeadLayout, lk, lv, price, config: DecodeConfig) -> list[float]:
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
        costs.append(
            min(token_cost(len(hs), a, b, g, config) + pa + pb for a, pa in tk.items() for b, pb in tv.items())
        )
    return costs


def fill_runs(
    layout: HeadLayout, config: DecodeConfig = DECODE, max_shift: int = 32, k_loss=None, v_loss=None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K and V widths moved between the layer's heads so its runs fill their tiles: each head's width moves by at
    most ``max_shift`` columns (steps of 16, within [16, head_dim]), the layer's K total and V total stay, and the
    runs (at their best head order) cost least; among the cheapest, the least loss. Returns the widths unchanged
    when no move makes the runs cheaper, by tiles and by the columns the kernel loads (``loaded_cost``).

    Why: a run's time follows its tiles more than its bytes (bench/results/kernels.md "Decode: filled tiles"), so a
    rate-0.5 layer whose runs hold K 128 + V 208, K 256 + V 176 and K 128 + V 128 columns is slower than the same
    columns moved into two runs of K 256 + V 256.

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
    candidates = {_partition(layout, order_heads(layout, config), config)}
    candidates |= {
        tuple(tuple(by_width[i : i + size]) for i in range(0, n, size))
        for size in range(1, max(ROWS // layout.group_size, 1) + 1)
    }
    if n <= EXACT_ORDER_HEADS:
        candidates |= {
            _best_partition(_priced_costs(layout, lk, lv, price, config))[1]
            for price in ((-16, -16), (-8, -8), (0, 0), (-16, 0), (0, -16))
        }
    best_key, best = (runs_cost(layout, config) - 8) * 1e3, (k, v)  # cheaper runs only
    for part in sorted(candidates):
        key, widths = _fill(layout, part, lk, lv, config)
        if key < best_key:
            best_key, best = key, widths
    filled = dataclasses.replace(layout, k_widths=best[0], v_widths=best[1])
    if loaded_cost(filled, config) >= loaded_cost(layout, config):
        return k, v  # cheaper tiles, but the kernel would not load fewer columns
    return best


def loaded_cost(layout: HeadLayout, config: DecodeConfig = DECODE) -> float:
    """A token's cost over the layer's runs at their best head order, counting the tile columns the kernel computes
    on (``cost.loaded``: 160 = 128 + 32) rather than whole tiles; ``fill_runs`` keeps only moves that lower it
    (moves that were cheaper by tiles alone measured no gain on a rate-0.7 layer: bench/results/kernels.md "Decode:
    filled tiles")."""
    lay = permuted(layout, order_heads(layout, config))
    return sum(
        token_cost(r.num_heads, loaded(r.k_cols, config), loaded(r.v_cols, config), layout.group_size, config)
        for r in head_runs(lay, config)
    )


def _fill(layout: HeadLayout, part, lk, lv, config: DecodeConfig):
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
                cost = token_cost(len(heads), tile(kk + 16 * dk), tile(vv + 16 * dv), g, config)
                if not math.isfinite(cost):
                    continue
                moved = np.full_like(key, math.inf)  # key shifted by (dk, dv): the totals after this run
                src = key[max(0, -dk) : 2 * span + 1 - max(0, dk), max(0, -dv) : 2 * span + 1 - max(0, dv)]
                moved[max(0, dk) : max(0, dk) + src.shape[0], max(0, dv) : max(0, dv) + src.shape[1]] = src
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
