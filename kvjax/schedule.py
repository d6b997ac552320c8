"""Host-side decode schedule: the "plan" step before each decode kernel "run" (numpy only).

The decode kernel (``kvjax.pallas.decode``) runs ``P`` persistent programs; program ``p`` works through row ``p`` of
the schedule. A work unit is a run of adjacent KV heads (``kvjax.runs``; one head when packing is off), a group is
(sequence, unit), and a work item is a chunk of a group's pages. A token of a unit costs its K + V columns (the
bytes), plus its tiles' columns (the instructions: padded columns fetch nothing but are computed on), plus 32 (the
per-token work that does not shrink with width); an item adds a small fixed overhead.

Orders (``order``):
- "lpt": groups costlier than the average load are split into chunks, the items sorted longest first and dealt to
  the least-loaded program (longest processing time first), in rounds of ``P`` items vectorized over all layers
  (sorting packed 64-bit keys).
- "stream": each layer's groups laid end to end and cut into ``P`` equal shares at page boundaries (stream-K's
  split), so every program plans the same load up to a page, with one to a few items.
- "auto" (the default): the LPT plan when it balances to within 5% of perfect, else the stream plan.
- "naive": natural order dealt round-robin (the ablation).

LPT balances many small items well and splits nothing it need not, but cannot cut items to fit: on Llama-shaped
rate-0.5 and 0.7 layers at batch 32 (units of runs of heads) it planned 0.65-0.84 of a perfect balance, where
stream plans 0.98-0.99 and ran 14-22% faster; with many groups per program (batch 256 x 512 tokens) LPT balances
at 0.97 and stream's extra cuts and merges made it 8% slower (bench/RESULTS.md). Chunks of a split group write
partial softmax states to slots that ``merge`` in the kernel module combines afterwards. Measured host cost:
bench/RESULTS.md.

The schedule depends only on page counts and widths. It covers ``headroom_pages`` pages past each sequence's last
one (the kernel stops at the real length), so one plan serves every step until a sequence outgrows it or the
batch changes: ``DecodePlanner`` keeps it until then, and builds the next one ahead on a background thread. All
arrays are int32 with power-of-two bucketed shapes, so a jitted step that takes them as ordinary arguments
recompiles only when a bucket changes.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import math
from typing import Sequence

import jax
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.runs import FLOOR_TILE, PACK_TILE, TOKEN_COST, head_runs, tile

H100_SMS = 132

# Item fields, in this order along the last axis of ``DecodeSchedule.items``.
SEQ, UNIT, FIRST_PAGE, END_PAGE, SLOT = range(5)
ITEM = np.dtype({"names": ["seq", "unit", "first_page", "end_page", "slot"], "formats": [np.int32] * 5})
ITEM_OVERHEAD = 32 * 64  # an item's fixed cost, in tokens * width
# Defaults, measured best on the H100 (bench/RESULTS.md, "Fourth session"; kvjax.runs' PACK_TILE and FLOOR_TILE:
# "Fifth session"):
ORDER = "auto"  # how items reach programs: "auto", "stream" (equal shares of the work), "lpt" or "naive"
AUTO_BALANCE = 0.95  # "auto" keeps the LPT plan when it balances at least this well, else cuts equal shares
TILE_WEIGHT = 1  # weight of a unit's tile columns in its token cost (see _unit_costs)
FIXED_CHUNK_TOKENS = 512  # batch-invariant plans split every sequence at multiples of this (fixed_chunk_schedule)


def bucket(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def default_num_programs() -> int:
    """Two programs per SM of the first GPU (the H100's 132 SMs where there is none).

    One per SM left the H100 latency-bound (4 warps per SM: rate-0.5 decode at batch 32, 4K took 255 us against
    165 us with two); more than two split groups into more chunks without gaining (bench/RESULTS.md)."""
    try:
        dev = jax.devices("gpu")[0]
        return 2 * int(getattr(dev, "core_count", 0) or H100_SMS)
    except RuntimeError:
        return 2 * H100_SMS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    """Device-side schedule, one entry per layer along axis 0 (pass it into a jitted step as is).

    items [L, P, R, 5]: per program, its items (seq, unit, first_page, end_page, slot) in run order; a unit is a
        run of adjacent KV heads (``kvjax.runs.head_runs(layout, pack_tile)``; one head each when pack_tile is 0);
        slot is -1 when the item is its group's only chunk (the kernel writes the output directly).
    counts [L, P]: how many items of each row are real.
    merge_dest [L, M, 2]: (seq, unit) of each split group; padding rows hold seq = -1.
    merge_slots [L, M, S]: the partial slots of each split group (slot = m * S + chunk), -1 where unused.
    pack_tile: static; how the units were cut, so the kernel reads the same runs.
    """

    items: np.ndarray
    counts: np.ndarray
    merge_dest: np.ndarray
    merge_slots: np.ndarray
    pack_tile: int = dataclasses.field(default=PACK_TILE, metadata=dict(static=True))

    def layer(self, i: int) -> "DecodeSchedule":
        """The schedule of layer ``i`` (arrays without the leading layer axis)."""
        return DecodeSchedule(self.items[i], self.counts[i], self.merge_dest[i], self.merge_slots[i], self.pack_tile)

    @property
    def num_programs(self) -> int:
        return self.items.shape[-3]


@dataclasses.dataclass
class DecodePlan:
    """A schedule and the host facts about it: what it covers and how well it balances."""

    schedule: DecodeSchedule
    capacity: np.ndarray  # [B] tokens each sequence may reach before the plan must be rebuilt
    loads: np.ndarray  # [L, P] planned cost per program
    num_items: np.ndarray  # [L]

    def covers(self, lengths) -> bool:
        lengths = np.asarray(lengths)
        return lengths.shape == self.capacity.shape and bool(np.all(lengths <= self.capacity))

    @property
    def balance(self) -> float:
        """Mean over layers of (average program load / largest program load) as planned; 1.0 is perfect."""
        return load_balance(self.loads)


@functools.cache
def _keep_heap() -> None:
    """Ask glibc to keep freed memory: a plan's numpy temporaries are ~0.5 MB each, and returning them to the OS
    after every plan means faulting them in again next time (5x slower in the VMs measured). Once per process."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _as_layouts(layouts) -> tuple[HeadLayout, ...]:
    layouts = (layouts,) if isinstance(layouts, HeadLayout) else tuple(layouts)
    if len({lay.num_kv_heads for lay in layouts}) != 1:
        raise ValueError("all layers must have the same number of KV heads")
    return layouts


def _unit_costs(layouts: tuple[HeadLayout, ...], token_cost: int = TOKEN_COST, pack_tile: int = PACK_TILE,
                tile_weight: int = TILE_WEIGHT, floor_tile: int = FLOOR_TILE) -> np.ndarray:
    """[L, U] cost of one token of every unit (run of heads): its K + V columns (the bytes) plus ``tile_weight``
    times the columns of its tiles (the instructions: a K and a V tile as wide as the wider of the two; padded
    columns fetch nothing but are computed on), at least what a unit of ``floor_tile`` + ``floor_tile`` columns
    costs (a narrower step takes as long: ``kvjax.runs.run_cost``), plus ``token_cost`` for the per-token work
    that does not scale with width (page lookup, softmax). Layers with fewer units than the most have 0 past their
    last (they get no items)."""
    runs = [head_runs(lay, pack_tile) for lay in layouts]
    width_cost = lambda k, v: k + v + tile_weight * 2 * tile(max(k, v))  # noqa: E731
    floor = width_cost(floor_tile, floor_tile) if floor_tile else 0
    out = np.zeros((len(layouts), max(map(len, runs))), np.int64)
    for i, layer in enumerate(runs):
        out[i, :len(layer)] = [max(width_cost(r.k_cols, r.v_cols), floor) + token_cost for r in layer]
    return out


def build_decode_schedule(lengths, layouts: HeadLayout | Sequence[HeadLayout], page_size: int,
                          num_programs: int | None = None, *, order: str = ORDER, headroom_pages=0,
                          min_chunk_tokens: int = 256, item_overhead: int = ITEM_OVERHEAD,
                          items_per_program: int = 1, token_cost: int = TOKEN_COST, tile_weight: int = TILE_WEIGHT,
                          pack_tile: int = PACK_TILE, floor_tile: int = FLOOR_TILE) -> DecodePlan:
    """Plan decode for sequences of ``lengths`` tokens (new token included) over one layer or all layers.

    headroom_pages: pages planned past each sequence's last one (one number, or one per sequence). order: "stream",
    "lpt" or "naive" (module doc). min_chunk_tokens: LPT never makes chunks shorter than this (a chunk's fixed cost
    then outweighs balance); stream moves a cut within a quarter of it of a group's edge to the edge.
    item_overhead: fixed cost of an item in the units of tokens * width. items_per_program (LPT): groups are split
    into chunks no costlier than 1 / items_per_program of the average program load. token_cost: a token's fixed
    cost, in columns. tile_weight: weight of the tile columns in a token's cost (0 weighs only bytes and the fixed
    part). pack_tile: work units are runs of adjacent heads read through tiles at most this wide (``kvjax.runs``;
    0: one head per unit). floor_tile: a unit's token costs at least one of ``floor_tile`` + ``floor_tile``
    columns (0: no floor). The defaults measured best on the H100 (bench/kernels.py --only autotune).
    """
    if order not in ("auto", "lpt", "naive", "stream"):
        raise ValueError(f"order must be 'auto', 'lpt', 'naive' or 'stream', not {order!r}")
    if order == "auto":
        options = dict(headroom_pages=headroom_pages, min_chunk_tokens=min_chunk_tokens, item_overhead=item_overhead,
                       items_per_program=items_per_program, token_cost=token_cost, tile_weight=tile_weight,
                       pack_tile=pack_tile, floor_tile=floor_tile)
        plan = build_decode_schedule(lengths, layouts, page_size, num_programs, order="lpt", **options)
        if plan.balance >= AUTO_BALANCE:
            return plan
        return build_decode_schedule(lengths, layouts, page_size, num_programs, order="stream", **options)
    _keep_heap()
    layouts = _as_layouts(layouts)
    P = num_programs or default_num_programs()
    lengths = np.asarray(lengths, np.int64)
    unit_cost = _unit_costs(layouts, token_cost, pack_tile, tile_weight, floor_tile)  # [L, H]: H units (runs) a layer
    B, L, H = len(lengths), len(layouts), unit_cost.shape[1]
    page_cost = page_size * unit_cost[:, None, :]  # [L, 1, H]

    live = lengths > 0
    end_page = np.where(live, -(-lengths // page_size) + headroom_pages, 0)  # [B]
    window = np.array([lay.sliding_window or 0 for lay in layouts], np.int64)[:, None]  # [L, 1]
    first_page = np.where(window > 0, np.maximum(lengths[None] - window, 0) // page_size, 0)
    first_page = np.minimum(first_page, end_page[None])[:, :, None]  # [L, B, 1]
    pages = (end_page[None, :, None] - first_page) * (page_cost > 0)  # [L, B, H]: none for missing units
    capacity = np.where(live, end_page * page_size, 0)
    if order == "stream":
        schedule, loads, per_layer = _stream(np.broadcast_to(first_page, pages.shape), pages, page_cost, P,
                                             item_overhead, max(1, min_chunk_tokens // page_size // 4), pack_tile)
        return DecodePlan(schedule, capacity, loads, per_layer)

    # Split each (layer, seq, head) group into chunks no costlier than the average program load (in integers:
    # ceil(cost / max(total / P, 1))) and no shorter than min_chunk_tokens. Large batches split nothing.
    cost = pages * page_cost  # [L, B, H]
    total = np.maximum(cost.sum(axis=(1, 2)) // items_per_program, P)[:, None, None]
    chunk_pages, n = pages, np.broadcast_to(pages > 0, cost.shape)  # pages per chunk, chunks per group
    if np.any(cost.max(axis=(1, 2), keepdims=True) * P > total):
        chunks = np.minimum(-(-cost * P // total), np.maximum(pages // max(1, min_chunk_tokens // page_size), 1))
        chunk_pages = -(-pages // np.maximum(chunks, 1))
        n = np.where(pages > 0, -(-pages // np.maximum(chunk_pages, 1)), 0)
    n = n.reshape(L, B * H)
    per_layer = n.sum(axis=1)
    T, N = int(per_layer.sum()), max(int(per_layer.max(initial=0)), 1)

    # Items, layer-major in natural order: each group's first chunk, repeated for the later chunks of split groups
    # (fixed below), then one empty item at index T that pads the table.
    fields = np.zeros((L * B * H + 1, 5), np.int32)
    first = fields[:-1].reshape(L, B, H, 5)
    first[..., SEQ] = np.arange(B)[:, None]
    first[..., UNIT] = np.arange(H)
    first[..., FIRST_PAGE] = first_page
    first[..., END_PAGE] = first_page + chunk_pages
    first[..., SLOT] = -1
    item_cost = (chunk_pages * page_cost + item_overhead).ravel()
    merge_dest, merge_slots = np.full((L, 1, 2), -1, np.int32), np.full((L, 1, 1), -1, np.int32)
    if T < n.size or n.max(initial=0) > 1:
        n = n.ravel().astype(np.int64)
        fields, item_cost = np.repeat(fields, np.append(n, 1), axis=0), np.repeat(item_cost, n)
        split = np.flatnonzero(n > 1)  # flat (layer, seq, head) of the groups of several chunks
        if split.size:
            # Partial slots, dense per layer: slot = m * S + chunk, m the group's merge index in its layer.
            ns, layer = n[split], split // (B * H)
            per = np.bincount(layer, minlength=L)
            m = np.arange(split.size) - (np.cumsum(per) - per)[layer]
            S, M = bucket(int(ns.max())), bucket(int(per.max()))
            k = np.arange(ns.sum()) - np.repeat(np.cumsum(ns) - ns, ns)  # chunk index within its group
            item = np.repeat((np.cumsum(n) - n)[split], ns) + k
            group = np.repeat(split, ns)
            cp = np.broadcast_to(chunk_pages, cost.shape).ravel()[group]
            p0 = fields[item, FIRST_PAGE] + k * cp
            p1 = np.minimum(p0 + cp, end_page[fields[item, SEQ]])
            slot = np.repeat(m * S, ns) + k
            fields[item, FIRST_PAGE], fields[item, END_PAGE], fields[item, SLOT] = p0, p1, slot
            item_cost[item] = (p1 - p0) * page_cost.ravel()[group // (B * H) * H + group % H] + item_overhead
            merge_dest, merge_slots = np.full((L, M, 2), -1, np.int32), np.full((L, M, S), -1, np.int32)
            merge_dest[layer, m] = np.stack([split % (B * H) // H, split % H], axis=1)
            merge_slots[np.repeat(layer, ns), np.repeat(m, ns), k] = slot

    # Per layer, the items' columns and costs in dealing order, padded to whole rounds of P with column N (no
    # item) and cost 0. LPT order: longest first, ties in natural order, by sorting 64-bit keys (cost, column).
    start = np.cumsum(per_layer) - per_layer
    costs = np.zeros((L, N), np.int64)
    if np.all(per_layer == N):
        costs[:] = item_cost.reshape(L, N)
    else:
        for i in range(L):
            costs[i, :per_layer[i]] = item_cost[start[i]:start[i] + per_layer[i]]
    cbits, pbits = max(N - 1, 1).bit_length(), max(P - 1, 1).bit_length()
    if int(costs.sum(axis=1).max()).bit_length() + max(cbits, pbits) > 63:
        raise ValueError("too much work to plan with 64-bit sort keys")
    rounds = -(-N // P)
    col = np.full((L, rounds * P), N, np.int64)
    dealt = np.zeros((L, rounds * P), np.int64)
    if order == "lpt":
        top = int(costs.max(initial=0))
        key = (top - costs) << cbits | np.arange(N)
        key.sort(axis=1)
        col[:, :N], dealt[:, :N] = key & ((1 << cbits) - 1), top - (key >> cbits)
    else:
        col[:, :N], dealt[:, :N] = np.arange(N), costs
    col, dealt = col.reshape(L, rounds, P), dealt.reshape(L, rounds, P)

    # Deal in rounds of P: LPT gives each round's items, longest first, to the programs in order of load (ties by
    # program: sorting 64-bit keys (load, program)); naive deals them round-robin.
    if order == "lpt":
        prog = np.empty((L, rounds, P), np.int64)
        key = np.tile(np.arange(P), (L, 1))
        for r in range(rounds):
            if r:
                key.sort(axis=1)
            prog[:, r] = key & ((1 << pbits) - 1)
            key += dealt[:, r] << pbits
        loads = np.empty((L, P), np.int64)
        np.put_along_axis(loads, key & ((1 << pbits) - 1), key >> pbits, axis=1)
    else:
        prog = np.broadcast_to(np.arange(P), (L, rounds, P))
        loads = dealt.sum(axis=1)
    R = bucket(rounds)
    table = np.full((L, P, R), T, np.int32)  # the item at each program and round; T: none
    where = prog * R + (np.arange(L)[:, None, None] * (P * R) + np.arange(rounds)[:, None])
    np.put(table, where, np.where(col < per_layer[:, None, None], col + start[:, None, None], T))
    counts = (table < T).sum(axis=2, dtype=np.int32)
    # Whole items move as records of five int32 fields: twice as fast as gathering rows of an int32 matrix.
    items = np.take(fields.view(ITEM).ravel(), table).view(np.int32).reshape(L, P, R, 5)

    return DecodePlan(DecodeSchedule(items, counts, merge_dest, merge_slots, pack_tile), capacity, loads, per_layer)


def fixed_chunk_schedule(lengths, layouts: HeadLayout | Sequence[HeadLayout], page_size: int,
                         num_programs: int | None = None, *, chunk_pages: int, splits: int,
                         token_cost: int = TOKEN_COST, tile_weight: int = TILE_WEIGHT, pack_tile: int = PACK_TILE,
                         floor_tile: int = FLOOR_TILE, item_overhead: int = ITEM_OVERHEAD) -> DecodePlan:
    """A batch-invariant plan: how a sequence is split and merged depends on its own length alone.

    Chunk k of every group covers pages ``[k * chunk_pages, (k + 1) * chunk_pages)`` and always goes through the
    merge, into partial slot position k of ``splits`` (a fixed count, so the merge's sums have one shape whatever
    the batch). Under a sliding window, chunks wholly before the window's first page are left out. A plan covers a
    sequence until it leaves its last chunk or its window leaves its first one (``capacity``). Items are dealt to
    programs longest first, round-robin; where an item runs changes nothing in its result.
    """
    layouts = _as_layouts(layouts)
    P = num_programs or default_num_programs()
    lengths = np.asarray(lengths, np.int64)
    unit_cost = _unit_costs(layouts, token_cost, pack_tile, tile_weight, floor_tile)  # [L, H]
    B, L, H, C = len(lengths), len(layouts), unit_cost.shape[1], chunk_pages
    live = lengths > 0
    last = np.where(live, (-(-lengths // page_size) - 1) // C, -1)  # [B] last chunk index
    capacity = np.where(live, (last + 1) * C * page_size, 0)
    first = np.zeros((L, B), np.int64)
    for i, lay in enumerate(layouts):
        if lay.sliding_window:
            first[i] = np.maximum(lengths - lay.sliding_window, 0) // page_size // C
            capacity = np.minimum(capacity, np.where(live, (first[i] + 1) * C * page_size + lay.sliding_window - 1,
                                                     capacity))
    if int((last + 1).max(initial=0)) > splits:
        raise ValueError(f"a sequence needs {int(last.max()) + 1} chunks of {C} pages, more than splits={splits}")
    # Items: (layer, seq, unit, chunk) for every live unit and chunk first..last, layer-major.
    chunks = np.where(live[None], last[None] - first + 1, 0)[:, :, None] * (unit_cost[:, None, :] > 0)  # [L, B, H]
    n = chunks.ravel()
    group = np.repeat(np.arange(n.size), n)
    k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first[:, :, None].repeat(H, 2).ravel(), n)
    layer, seq, unit = group // (B * H), group % (B * H) // H, group % H
    per_layer = np.bincount(layer, minlength=L)
    groups_per_layer = np.bincount(np.flatnonzero(n) // (B * H), minlength=L)
    M = bucket(int(groups_per_layer.max(initial=1)))
    real = np.flatnonzero(n)
    m_of = np.zeros(n.size, np.int64)
    m_of[real] = np.arange(real.size) - np.repeat(np.cumsum(groups_per_layer) - groups_per_layer, groups_per_layer)
    slot = m_of[group] * splits + k
    merge_dest, merge_slots = np.full((L, M, 2), -1, np.int32), np.full((L, M, splits), -1, np.int32)
    merge_dest[real // (B * H), m_of[real]] = np.stack([real % (B * H) // H, real % H], axis=1)
    merge_slots[layer, m_of[group], k] = slot
    tokens = np.minimum((k + 1) * C * page_size, capacity[seq]) - k * C * page_size
    cost = tokens * unit_cost[layer, unit] + item_overhead
    # Deal each layer's items longest first, round-robin over the programs.
    order = np.lexsort((-cost, layer))
    rank = np.arange(order.size) - np.repeat(np.cumsum(per_layer) - per_layer, per_layer)
    prog, turn = rank % P, rank // P
    R = bucket(int(turn.max(initial=0)) + 1)
    items = np.zeros((L, P, R, 5), np.int32)
    o = order
    items[layer[o], prog, turn] = np.stack([seq[o], unit[o], k[o] * C, (k[o] + 1) * C, slot[o]], axis=1)
    counts = np.zeros((L, P), np.int32)
    np.add.at(counts, (layer[o], prog), 1)
    loads = np.zeros((L, P), np.int64)
    np.add.at(loads, (layer[o], prog), cost[o])
    return DecodePlan(DecodeSchedule(items, counts, merge_dest, merge_slots, pack_tile), capacity, loads, per_layer)


def _stream(first_page, pages, page_cost, P, item_overhead, snap_pages, pack_tile):
    """Equal shares of each layer's work, cut at page boundaries: program p takes the stretch from p/P to
    (p+1)/P of the layer's groups laid end to end (stream-K's split), so it gets one to a few items (the ends of
    the groups it spans) and every program plans the same load up to a page. A cut within ``snap_pages`` of a
    group's edge moves to the edge (no slivers). first_page, pages: [L, B, H]; page_cost [L, 1, H].

    Returns (schedule, loads [L, P], items per layer [L]). Vectorized over all layers: every group and every cut
    is a point on one line of pages, layer after layer."""
    L, B, H = pages.shape
    pc = np.broadcast_to(page_cost, pages.shape).ravel()
    real = np.flatnonzero(pages.ravel() > 0)  # groups with work, layer-major in natural (seq, unit) order
    g_pages, g_cost, g_first = pages.ravel()[real], pc[real], first_page.ravel()[real]
    g_layer, g_seq, g_unit = real // (B * H), real % (B * H) // H, real % H
    n = len(real)
    line = np.concatenate([[0], np.cumsum(g_pages)])  # where each group starts on the page line
    worth = np.concatenate([[0], np.cumsum(g_pages * g_cost)])  # the same points in cost
    per_group = np.bincount(g_layer, minlength=L)
    layer_first = np.concatenate([[0], np.cumsum(per_group)])  # first group of each layer
    total = worth[layer_first[1:]] - worth[layer_first[:-1]]  # [L]

    # Cuts p = 1 .. P-1 of every layer at its equal shares, as (group, page in the group), then on the line.
    target = worth[layer_first[:-1], None] + np.arange(1, P) * total[:, None] // P  # [L, P-1]
    g = np.clip(np.searchsorted(worth, target, side="right") - 1, layer_first[:-1, None],
                np.maximum(layer_first[1:, None] - 1, 0))
    g = np.minimum(g, max(n - 1, 0))
    if n:
        k = np.clip(np.rint((target - worth[g]) / g_cost[g]).astype(np.int64), 0, g_pages[g])
        k = np.where(k < snap_pages, 0, np.where(g_pages[g] - k < snap_pages, g_pages[g], k))
        cut = line[g] + k
    else:
        cut = np.zeros((L, P - 1), np.int64)
    start = line[layer_first[:-1]]  # [L]: each layer's start on the line (program 0 starts there)
    cut = np.where(total[:, None] > 0, np.maximum.accumulate(cut, axis=1), start[:, None])
    cuts = np.concatenate([start[:, None], cut], axis=1)  # [L, P], nondecreasing along the whole line

    # Items: each group cut at the distinct cuts strictly inside it (a group's items are adjacent on the line).
    flat = cuts.ravel()
    inner = np.unique(flat)
    owner = np.searchsorted(line, inner, side="right") - 1  # the group each distinct cut falls in
    inside = (owner < n) & (inner > line[np.minimum(owner, n)])
    cut_at, owner = inner[inside], owner[inside]  # sorted, grouped by group
    pieces = 1 + np.bincount(owner, minlength=n)  # [n]
    grp = np.repeat(np.arange(n), pieces)
    before = np.cumsum(pieces) - pieces
    chunk = np.arange(len(grp)) - before[grp]  # index of the item in its group
    inner_before = before - np.arange(n)  # cuts of earlier groups

    def inner_cut(i):  # the i-th inner cut (clipped: where it is not used, any value will do)
        return cut_at[np.minimum(i, len(cut_at) - 1)] if len(cut_at) else line[grp]

    a = np.where(chunk == 0, line[grp], inner_cut(inner_before[grp] + chunk - 1))  # each item's stretch [a, b)
    b = np.where(chunk == pieces[grp] - 1, line[grp + 1], inner_cut(inner_before[grp] + chunk))
    layer = g_layer[grp]
    # the last cut at or before each item's start: count the cuts at or before it (cheaper from the cuts' side)
    prog = np.cumsum(np.bincount(np.searchsorted(a, flat, side="left"), minlength=len(a) + 1))[:-1] - 1 - layer * P
    first = g_first[grp] + (a - line[grp])
    end = first + (b - a)

    # Partial slots for the groups cut into several items.
    split = pieces > 1
    split_groups = np.flatnonzero(split)
    m_of = np.full(n, -1, np.int64)
    per_layer_split = np.bincount(g_layer[split_groups], minlength=L)
    m_of[split_groups] = np.arange(len(split_groups)) - np.repeat(np.cumsum(per_layer_split) - per_layer_split,
                                                                  per_layer_split)
    S, M = bucket(int(pieces.max(initial=1))), bucket(int(per_layer_split.max(initial=1)))
    slot = np.where(split[grp], m_of[grp] * S + chunk, -1)
    merge_dest, merge_slots = np.full((L, M, 2), -1, np.int32), np.full((L, M, S), -1, np.int32)
    if len(split_groups):
        merge_dest[g_layer[split_groups], m_of[split_groups]] = np.stack(
            [g_seq[split_groups], g_unit[split_groups]], axis=1)
        it = split[grp]
        merge_slots[layer[it], m_of[grp[it]], chunk[it]] = slot[it]

    # The table: items of each (layer, program) in line order.
    row = layer * P + prog  # nondecreasing along the line
    per_row = np.bincount(row, minlength=L * P)
    counts = per_row.reshape(L, P).astype(np.int32)
    rank = np.arange(len(a)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    R = bucket(int(counts.max(initial=1)))
    items = np.zeros((L * P * R, 5), np.int32)
    items[row * R + rank] = np.stack([g_seq[grp], g_unit[grp], first, end, slot], axis=1)
    items = items.reshape(L, P, R, 5)
    cost = (b - a) * g_cost[grp] + item_overhead
    loads = np.bincount(row, weights=cost, minlength=L * P).reshape(L, P).astype(np.int64)
    schedule = DecodeSchedule(items, counts, merge_dest, merge_slots, pack_tile)
    return schedule, loads, np.bincount(layer, minlength=L)


def realized_loads(schedule: DecodeSchedule, lengths, layouts: Sequence[HeadLayout], page_size: int,
                   item_overhead: int = ITEM_OVERHEAD, token_cost: int = TOKEN_COST,
                   tile_weight: int = TILE_WEIGHT, floor_tile: int = FLOOR_TILE) -> np.ndarray:
    """[L, P] work each program meets at ``lengths`` (which the plan covers), in the cost model the plan was built
    with: its items' token loops stop at the real lengths, so an aged plan's loads differ from the planned ones.
    Its balance: ``load_balance``."""
    lengths = np.asarray(lengths, np.int64)
    items = schedule.items.astype(np.int64)
    seq, unit, first, end = (items[..., f] for f in (SEQ, UNIT, FIRST_PAGE, END_PAGE))
    tokens = np.maximum(np.minimum(end * page_size, lengths[seq]) - first * page_size, 0)
    width = _unit_costs(_as_layouts(layouts), token_cost, schedule.pack_tile, tile_weight, floor_tile)[
        np.arange(len(items))[:, None, None], unit]
    cost = tokens * width + item_overhead
    real = np.arange(items.shape[2]) < schedule.counts[..., None]
    return np.where(real, cost, 0).sum(axis=2)


def load_balance(loads: np.ndarray) -> float:
    """Mean over layers of (average program load / largest program load) of [L, P] loads; 1.0 is perfect."""
    return float(np.mean(loads.mean(axis=1) / np.maximum(loads.max(axis=1), 1)))


def static_decode_schedule(batch: int, pages_per_seq: int, layout: HeadLayout, page_size: int,
                           num_programs: int | None = None) -> DecodeSchedule:
    """A schedule that needs no lengths: every sequence planned at the block table's full width.

    For callers with no host plan (e.g. inside a jitted step): correct for any lengths, balanced only when the
    sequences fill their tables. Built with numpy at trace time, so it becomes a constant of the step.
    """
    plan = build_decode_schedule(np.full(batch, pages_per_seq * page_size), layout, page_size, num_programs)
    return plan.schedule.layer(0)


@functools.cache
def _planning_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One worker for all planners: builds run beside the steps (numpy drops the GIL in its loops). Started here,
    with the planner: a step that started it would wait out the GIL's switch interval while it runs a build."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-plan")
    pool.submit(int).result()
    return pool


class DecodePlanner:
    """Keeps one plan until a sequence outgrows it or the batch changes (the builder of vLLM / FlashInfer).

    Each sequence is planned ``min(headroom_tokens, length)`` tokens past its length, in whole pages, so a plan
    lives about ``headroom_tokens`` steps. The kernel loops only up to the real lengths: spare pages cost no
    bandwidth, only balance, as the plan weighs sequences by lengths they reach only as it ages. At 128 tokens the
    rebuilds cost a small fraction of a percent of a step and an aged plan balances nearly as well as a fresh one;
    each doubling halves the rebuilds but about doubles the balance lost (``bench/kernels.py --only schedule``
    measures both). Capping at the length keeps rows that barely started (padding rows have length 1) from weighing
    like long ones.

    ahead: when the sequences that grew in the last step will outgrow the plan within ``headroom_tokens // 4``
    steps, the next plan is built on a background thread for the lengths expected then (those sequences one token
    longer per step, the others as they are), and taken then if it covers the lengths (else the step builds one),
    so steps do not wait for builds. ``rebuilds`` counts the plans taken (the engine's plan id), ``built_ahead``
    those of them built ahead.
    """

    def __init__(self, layouts, page_size: int, num_programs: int | None = None, *, headroom_tokens: int = 128,
                 ahead: bool = True, chunk_pages: int = 0, splits: int = 0, **options):
        """``chunk_pages`` > 0 plans batch-invariantly (``fixed_chunk_schedule``, with ``splits`` slots a group)."""
        self.layouts, self.page_size = _as_layouts(layouts), page_size
        self.chunk_pages, self.splits = chunk_pages, splits
        self.num_programs = num_programs or default_num_programs()
        self.headroom_tokens, self.ahead, self.options = headroom_tokens, ahead, options
        self.plan: DecodePlan | None = None
        self.rebuilds = self.built_ahead = 0
        self._next: concurrent.futures.Future | None = None
        self._last = np.zeros(0, np.int64)  # the lengths of the previous call
        if ahead:
            _planning_thread()

    def build(self, lengths) -> DecodePlan:
        """A plan for these lengths with this planner's headroom, built in the calling thread."""
        lengths = np.asarray(lengths)
        if self.chunk_pages:
            return fixed_chunk_schedule(lengths, self.layouts, self.page_size, self.num_programs,
                                        chunk_pages=self.chunk_pages, splits=self.splits, **self.options)
        headroom = -(-np.minimum(self.headroom_tokens, lengths) // self.page_size)
        return build_decode_schedule(lengths, self.layouts, self.page_size, self.num_programs,
                                     headroom_pages=headroom, **self.options)

    def __call__(self, lengths) -> DecodeSchedule:
        lengths = np.asarray(lengths)
        last, self._last = self._last, lengths.copy()
        if self.plan is None or not self.plan.covers(lengths):
            ahead, self._next = self._next, None
            plan = ahead.result() if ahead is not None else None
            if plan is not None and plan.covers(lengths):
                self.built_ahead += 1
            else:
                plan = self.build(lengths)
            self.plan, self.rebuilds = plan, self.rebuilds + 1
        elif self.ahead and self._next is None and last.shape == lengths.shape and np.any(grows := lengths > last):
            steps_left = int((self.plan.capacity - lengths)[grows].min())
            if steps_left <= self.headroom_tokens // 4:
                expected = np.where(grows, lengths + steps_left + 1, lengths)
                self._next = _planning_thread().submit(self.build, expected)
        return self.plan.schedule
