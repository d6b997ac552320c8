"""The decode op's scheduling step (host, numpy): which program reads which pages of which work unit, for given lengths.

``build_decode_schedule`` returns a ``DecodeSchedule`` whose row ``p`` is the work of ``kernel.paged_decode``'s
persistent program ``p``: every visible page of every (sequence, unit) scheduled once, in chunks; a split group's
chunks write partial slots that ``merge.merge`` combines. ``DecodeConfig.order`` picks "lpt", "stream", "auto" or
"naive" (bench/results/kernels.md "Decode schedule: orders side by side"). A schedule depends only on page counts and
widths and covers ``headroom_pages`` past each sequence's last page, so one serves many steps
(``schedule_cache.ScheduleCache``); its arrays are int32 with power-of-two bucketed shapes. ``fixed_chunk_schedule``
is batch-invariant; ``static_decode_schedule`` needs no lengths.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.cost import unit_cost
from kvjax.ops.decode.units import head_runs
from kvjax.ops.tiles import pow2_ceil

# Item fields, in this order along the last axis of ``DecodeSchedule.items``.
SEQ, UNIT, FIRST_PAGE, END_PAGE, SLOT = range(5)
ITEM = np.dtype({"names": ["seq", "unit", "first_page", "end_page", "slot"], "formats": [np.int32] * 5})


def _rank_in_runs(counts) -> np.ndarray:
    """Each element's index within its run, for runs of ``counts`` elements laid end to end."""
    counts = np.asarray(counts, np.int64)
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    """Device-side schedule, one entry per layer along axis 0 (pass it into a jitted step as is).

    items [L, P, R, 5]: per program, its items (seq, unit, first_page, end_page, slot) in run order; a unit is a
        run of adjacent KV heads (``units.head_runs(layout, config)``);
        slot is -1 when the item is its group's only chunk (the kernel writes the output directly).
    counts [L, P]: how many items of each row are real.
    merge_dest [L, M, 2]: (seq, unit) of each split group; padding rows hold seq = -1.
    merge_range [L, M, 2]: (first slot, number of slots) of each split group's partials, which lie in adjacent
        slots in chunk order; (0, 0) in padding rows.
    num_slots: static; partial slots a layer may use (every slot is below it).
    config: static; how the units were cut and how the kernel runs, so scheduling and running agree (``for_run``:
        a change of order or of another schedule-only field compiles nothing new).
    index [1] int32: the layer the kernels read (``layer``).
    """

    items: np.ndarray
    counts: np.ndarray
    merge_dest: np.ndarray
    merge_range: np.ndarray
    num_slots: int = dataclasses.field(default=1, metadata=dict(static=True))
    config: DecodeConfig = dataclasses.field(default=DECODE, metadata=dict(static=True))
    index: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((1,), np.int32))

    def layer(self, i: int) -> DecodeSchedule:
        """The schedule for layer ``i``'s kernels: every layer's arrays, and ``i`` as a run-time operand the kernels
        index them by (a slice per layer would cost the decode step four copy kernels a layer: bench/results/engine.md
        "Engine: schedule read in place")."""
        layers, i = self.items.shape[0], operator.index(i)  # a float index is a TypeError, not truncated
        if not -layers <= i < layers:  # the kernels would read past the arrays
            raise IndexError(f"layer {i} of a schedule of {layers} layers")
        return dataclasses.replace(self, index=np.full((1,), i % layers, np.int32))

    @property
    def num_programs(self) -> int:
        return self.items.shape[-3]

    @property
    def shape(self) -> ScheduleShape:
        """The sizes a jitted step compiles for (besides the programs and layers)."""
        return ScheduleShape(self.items.shape[-2], self.merge_dest.shape[-2], self.num_slots)

    def padded(self, shape: ScheduleShape) -> DecodeSchedule:
        """The same schedule in arrays of ``shape`` (each size at least this schedule's): more rounds hold no
        items, more merge rows have no group, more slots go unused."""
        rounds, groups = shape.rounds - self.items.shape[-2], shape.groups - self.merge_dest.shape[-2]
        if min(rounds, groups, shape.slots - self.num_slots) < 0:
            raise ValueError(f"cannot pad a schedule of {self.shape} to {shape}")
        lead = [(0, 0)] * (self.items.ndim - 3)

        def grow(a, by, value):
            return np.pad(a, lead + [(0, by), (0, 0)], constant_values=value)

        items = np.pad(self.items, lead + [(0, 0), (0, rounds), (0, 0)])
        dest, ranges = grow(self.merge_dest, groups, -1), grow(self.merge_range, groups, 0)
        return dataclasses.replace(self, items=items, merge_dest=dest, merge_range=ranges, num_slots=shape.slots)


class ScheduleShape(NamedTuple):
    """A schedule's compiled sizes: item rounds per program, merge rows (split groups) and partial slots."""

    rounds: int
    groups: int
    slots: int

    def cover(self, other: ScheduleShape) -> ScheduleShape:
        """The smallest shape holding both."""
        return ScheduleShape(*map(max, self, other))

    def holds(self, other: ScheduleShape) -> bool:
        return all(a >= b for a, b in zip(self, other))


@dataclasses.dataclass
class BuiltSchedule:
    """A schedule and the host facts about it: what it covers and how well it balances."""

    schedule: DecodeSchedule
    capacity: np.ndarray  # [B] tokens each sequence may reach before the schedule must be rebuilt
    loads: np.ndarray  # [L, P] scheduled cost per program
    num_items: np.ndarray  # [L]
    floor: np.ndarray | int = 0  # [B] fewest tokens a sequence may have: a sliding window's first scheduled page

    def covers(self, lengths) -> bool:
        """The schedule reads every visible page of sequences of ``lengths``: none past its capacity, and none
        before its first page under a sliding window (a slot that now holds a shorter sequence)."""
        lengths = np.asarray(lengths)
        return (
            lengths.shape == self.capacity.shape
            and bool(np.all(lengths <= self.capacity))
            and bool(np.all(lengths >= self.floor))
        )

    @property
    def balance(self) -> float:
        """Mean over layers of (average program load / largest program load) as scheduled; 1.0 is perfect."""
        return load_balance(self.loads)


def as_layouts(layouts) -> tuple[HeadLayout, ...]:
    """One layout or a sequence of them as a tuple; every layer must have the same number of KV heads."""
    layouts = (layouts,) if isinstance(layouts, HeadLayout) else tuple(layouts)
    if len({lay.num_kv_heads for lay in layouts}) != 1:
        raise ValueError("all layers must have the same number of KV heads")
    return layouts


def _unit_costs(layouts: tuple[HeadLayout, ...], config: DecodeConfig) -> np.ndarray:
    """[L, U] cost of one token of every unit of every layer (``cost.unit_cost``); 0 past a layer's last unit."""
    runs = [head_runs(lay, config) for lay in layouts]
    out = np.zeros((len(layouts), max(map(len, runs))), np.int64)
    for i, (lay, layer) in enumerate(zip(layouts, runs)):
        out[i, : len(layer)] = [unit_cost(r.num_heads, r.k_cols, r.v_cols, lay.group_size, config) for r in layer]
    return out


def build_decode_schedule(
    lengths,
    layouts: HeadLayout | Sequence[HeadLayout],
    page_size: int,
    num_programs: int | None = None,
    *,
    config: DecodeConfig = DECODE,
    headroom_pages=0,
    fit: ScheduleShape | None = None,
    classes: Sequence[Sequence[int]] | None = None,
) -> BuiltSchedule:
    """Schedule decode for sequences of ``lengths`` tokens (new token included) over one layer or all layers, by
    ``config.order`` (module doc); ``headroom_pages``: pages scheduled past each sequence's last one (one number,
    or one per sequence). Every visible page of every (sequence, unit) is scheduled exactly once. ``fit``: "auto"
    takes the stream schedule only if its shape is within this one (a stream program may span many short groups).

    ``classes``: per layer, each unit's class, for kernels that run one class at a time over the layer's schedule
    (``quant_kernel``: one kernel a head class). Each (layer, class) is then scheduled over all programs on its own
    and each program's row holds its classes' items one class after another, slots numbered on through the layer:
    scheduled as one, a class's items sat on the few programs that drew them and the rest idled through its kernel
    (bench/results/quantization.md "Rate 0.5, and one head class at a time"). ``BuiltSchedule.loads`` then has a row a
    (layer, class), so ``balance`` is each kernel's."""
    if config.order == "auto":

        def by(order):
            options = dataclasses.replace(config, order=order)
            return build_decode_schedule(
                lengths,
                layouts,
                page_size,
                num_programs,
                config=options,
                headroom_pages=headroom_pages,
                classes=classes,
            )

        lpt = by("lpt")
        if lpt.balance >= config.auto_balance:
            return lpt
        stream = by("stream")
        return stream if fit is None or fit.holds(stream.schedule.shape) else lpt
    layouts = as_layouts(layouts)
    P = num_programs or config.num_programs()
    lengths = np.asarray(lengths, np.int64)
    unit_cost = _unit_costs(layouts, config)  # [L, H]: H units (runs) a layer
    window = np.array([lay.sliding_window or 0 for lay in layouts], np.int64)[:, None]  # [L, 1]
    owner = None
    if classes is not None:  # from here on a "layer" is a (layer, class) row of ``owner``'s layer
        owner, unit_cost = _by_class(unit_cost, classes)
        window = window[owner]
    page_cost = page_size * unit_cost[:, None, :]  # [L, 1, H]

    live = lengths > 0
    end_page = np.where(live, -(-lengths // page_size) + headroom_pages, 0)  # [B]
    first_page = np.where(window > 0, np.maximum(lengths[None] - window, 0) // page_size, 0)
    first_page = np.minimum(first_page, end_page[None])[:, :, None]  # [L, B, 1]
    pages = (end_page[None, :, None] - first_page) * (page_cost > 0)  # [L, B, H]: none for missing units
    capacity = np.where(live, end_page * page_size, 0)
    floor = np.where(first_page[..., 0] > 0, first_page[..., 0] * page_size + window, 0).max(axis=0)
    if config.order == "stream":
        snap = max(1, config.min_chunk_tokens // page_size // 4)
        schedule, loads, per_layer = _stream(
            np.broadcast_to(first_page, pages.shape), pages, page_cost, P, config.item_overhead, snap, config
        )
    else:
        schedule, loads, per_layer = _lpt(first_page, end_page, pages, page_cost, P, page_size, config)
    if owner is not None:
        schedule, per_layer = _join(schedule, owner, len(layouts)), np.bincount(owner, per_layer, len(layouts))
    return BuiltSchedule(schedule, capacity, loads, per_layer.astype(np.int64), floor)


def _by_class(unit_cost: np.ndarray, classes: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(owner [K], unit costs [K, H]): a row a (layer, class) present in it, layer-major, its layer's costs with
    every other class's units at 0 (units of cost 0 get no items)."""
    L, H = unit_cost.shape
    if len(classes) != L:
        raise ValueError(f"classes for {len(classes)} layers, the schedule has {L}")
    owner, rows = [], []
    for layer, given in enumerate(classes):
        cls = np.asarray(given)
        units = int((unit_cost[layer] > 0).sum())
        if cls.shape != (units,):
            raise ValueError(f"layer {layer} has {units} units, got classes {tuple(cls.tolist())}")
        for c in np.unique(cls):
            owner.append(layer)
            rows.append(np.where(np.pad(cls == c, (0, H - units)), unit_cost[layer], 0))
    return np.asarray(owner, np.int64), np.stack(rows)


def _join(s: DecodeSchedule, owner: np.ndarray, L: int) -> DecodeSchedule:
    """A schedule of (layer, class) rows (``owner``: each row's layer, nondecreasing) as one a layer: each
    program's items of a layer one row after another, and each row's partial slots and merge rows numbered on after
    the layer's earlier rows'."""
    K, P, R, _ = s.items.shape
    first = np.searchsorted(owner, owner)  # each row's layer's first row

    def on(per_row):  # [K, ...] -> what the earlier rows of the same layer hold in total
        before = np.cumsum(per_row, axis=0) - per_row
        return before - before[first]

    used = (s.merge_range[..., 0] + s.merge_range[..., 1]).max(axis=1)  # [K] slots each row uses
    slot_at = on(used)
    counts = np.zeros((L, P), np.int32)
    np.add.at(counts, owner, s.counts)
    items = np.zeros((L, P, pow2_ceil(int(counts.max(initial=1))), 5), np.int32)
    k, p, r = np.nonzero(np.arange(R) < s.counts[..., None])
    moved = s.items[k, p, r]
    moved[:, SLOT] = np.where(moved[:, SLOT] >= 0, moved[:, SLOT] + slot_at[k], -1)
    items[owner[k], p, on(s.counts)[k, p] + r] = moved

    valid = s.merge_dest[..., 0] >= 0  # [K, M]: a row's split groups fill its first merge rows
    groups = valid.sum(axis=1)
    k, m = np.nonzero(valid)
    at = on(groups)[k] + m
    dest = np.full((L, pow2_ceil(int(np.bincount(owner, groups, L).max(initial=1))), 2), -1, np.int32)
    ranges = np.zeros(dest.shape, np.int32)
    dest[owner[k], at] = s.merge_dest[k, m]
    ranges[owner[k], at] = s.merge_range[k, m] + np.stack([slot_at[k], np.zeros_like(k)], axis=1)
    slots = pow2_ceil(int(np.bincount(owner, used, L).max(initial=1)))
    return DecodeSchedule(items, counts, dest, ranges, slots, s.config)


def _lpt(first_page, end_page, pages, page_cost, P, page_size, config):
    """LPT (or, for order "naive", round-robin) items of each layer: groups costlier than a program's average load
    split into chunks of at least ``min_chunk_tokens``, then dealt in rounds of P. first_page [L, B, 1], end_page
    [B], pages [L, B, H], page_cost [L, 1, H]. Returns (schedule, loads [L, P], items per layer [L])."""
    order, item_overhead, min_chunk_tokens = config.order, config.item_overhead, config.min_chunk_tokens
    L, B, H = pages.shape
    # Split each (layer, seq, head) group into chunks no costlier than the average program load (in integers:
    # ceil(cost / max(total / P, 1))) and no shorter than min_chunk_tokens. Large batches split nothing.
    cost = pages * page_cost  # [L, B, H]
    total = np.maximum(cost.sum(axis=(1, 2)) // config.items_per_program, P)[:, None, None]
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
    merge = _merges(L, *np.zeros((3, 0), np.int64), H)
    if T < n.size or n.max(initial=0) > 1:
        n = n.ravel().astype(np.int64)
        fields, item_cost = np.repeat(fields, np.append(n, 1), axis=0), np.repeat(item_cost, n)
        split = np.flatnonzero(n > 1)  # flat (layer, seq, head) of the groups of several chunks
        if split.size:
            ns = n[split]
            merge = _merges(L, split // (B * H), split % (B * H), ns, H)
            k = _rank_in_runs(ns)  # chunk index within its group
            item = np.repeat((np.cumsum(n) - n)[split], ns) + k
            group = np.repeat(split, ns)
            cp = np.broadcast_to(chunk_pages, cost.shape).ravel()[group]
            p0 = fields[item, FIRST_PAGE] + k * cp
            p1 = np.minimum(p0 + cp, end_page[fields[item, SEQ]])
            fields[item, FIRST_PAGE], fields[item, END_PAGE] = p0, p1
            fields[item, SLOT] = np.repeat(merge.begin, ns) + k
            item_cost[item] = (p1 - p0) * page_cost.ravel()[group // (B * H) * H + group % H] + item_overhead

    # Per layer, the items' columns and costs in dealing order, padded to whole rounds of P with column N (no
    # item) and cost 0. LPT order: longest first, ties in natural order, by sorting 64-bit keys (cost, column).
    start = np.cumsum(per_layer) - per_layer
    costs = np.zeros((L, N), np.int64)
    if np.all(per_layer == N):
        costs[:] = item_cost.reshape(L, N)
    else:
        for i in range(L):
            costs[i, : per_layer[i]] = item_cost[start[i] : start[i] + per_layer[i]]
    cbits, pbits = max(N - 1, 1).bit_length(), max(P - 1, 1).bit_length()
    if int(costs.sum(axis=1).max()).bit_length() + max(cbits, pbits) > 63:
        raise ValueError("too much work to schedule with 64-bit sort keys")
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

    prog, loads = _deal(dealt, order, pbits)
    R = pow2_ceil(rounds)
    table = np.full((L, P, R), T, np.int32)  # the item at each program and round; T: none
    where = prog * R + (np.arange(L)[:, None, None] * (P * R) + np.arange(rounds)[:, None])
    np.put(table, where, np.where(col < per_layer[:, None, None], col + start[:, None, None], T))
    counts = (table < T).sum(axis=2, dtype=np.int32)
    # Whole items move as records of five int32 fields: twice as fast as gathering rows of an int32 matrix.
    items = np.take(fields.view(ITEM).ravel(), table).view(np.int32).reshape(L, P, R, 5)

    return merge.schedule(items, counts, config), loads, per_layer


@dataclasses.dataclass
class _Merges:
    """The merge rows of a schedule's split groups and where each group's partial slots begin."""

    dest: np.ndarray  # [L, M, 2]
    range: np.ndarray  # [L, M, 2]
    begin: np.ndarray  # [groups]: each split group's first slot in its layer
    num_slots: int

    def schedule(self, items, counts, config: DecodeConfig) -> DecodeSchedule:
        return DecodeSchedule(items, counts, self.dest, self.range, self.num_slots, config.for_run())


def _merges(L: int, layer, group, chunks, H: int) -> _Merges:
    """Merge rows for split groups given in layer-major order by ``layer``, flat (seq, unit) ``group`` = seq * H +
    unit, and ``chunks`` each: a group's partials take the next ``chunks`` slots of its layer, in chunk order."""
    per = np.bincount(layer, minlength=L)  # split groups per layer
    used = np.bincount(layer, weights=chunks, minlength=L).astype(np.int64)  # slots per layer
    m = _rank_in_runs(per)  # the group's merge row in its layer
    begin = (np.cumsum(chunks) - chunks) - (np.cumsum(used) - used)[layer]
    M = pow2_ceil(int(per.max(initial=1)))
    dest, ranges = np.full((L, M, 2), -1, np.int32), np.zeros((L, M, 2), np.int32)
    dest[layer, m] = np.stack([group // H, group % H], axis=1)
    ranges[layer, m] = np.stack([begin, chunks], axis=1)
    return _Merges(dest, ranges, begin, pow2_ceil(int(used.max(initial=1))))


def _deal(dealt, order: str, pbits: int):
    """The program of every item of ``dealt`` [L, rounds, P] (their costs, longest first per round for LPT), and
    the programs' loads [L, P]: LPT gives each round's items to the programs in order of load (ties by program:
    sorting 64-bit keys (load, program)); naive deals them round-robin."""
    L, rounds, P = dealt.shape
    if order != "lpt":
        return np.broadcast_to(np.arange(P), (L, rounds, P)), dealt.sum(axis=1)
    prog = np.empty((L, rounds, P), np.int64)
    key = np.tile(np.arange(P), (L, 1))
    for r in range(rounds):
        if r:
            key.sort(axis=1)
        prog[:, r] = key & ((1 << pbits) - 1)
        key += dealt[:, r] << pbits
    loads = np.empty((L, P), np.int64)
    np.put_along_axis(loads, key & ((1 << pbits) - 1), key >> pbits, axis=1)
    return prog, loads


def fixed_chunk_schedule(
    lengths,
    layouts: HeadLayout | Sequence[HeadLayout],
    page_size: int,
    num_programs: int | None = None,
    *,
    chunk_pages: int,
    splits: int,
    config: DecodeConfig = DECODE,
) -> BuiltSchedule:
    """A batch-invariant schedule: how a sequence is split and merged depends on its own length alone.

    Chunk k of every group covers pages ``[k * chunk_pages, (k + 1) * chunk_pages)`` and always goes through the merge,
    which folds a group's chunks in chunk order (its result depends on the group alone); a sequence may have at most
    ``splits`` chunks. Under a sliding window, chunks wholly before the window's first page are left out. A schedule
    covers a sequence until it leaves its last chunk or its window leaves its first one (``capacity``). Items are dealt
    to programs longest first, round-robin; where an item runs changes nothing in its result.
    """
    layouts = as_layouts(layouts)
    P = num_programs or config.num_programs()
    lengths = np.asarray(lengths, np.int64)
    unit_cost = _unit_costs(layouts, config)  # [L, H]
    B, L, H, C = len(lengths), len(layouts), unit_cost.shape[1], chunk_pages
    live = lengths > 0
    last = np.where(live, (-(-lengths // page_size) - 1) // C, -1)  # [B] last chunk index
    capacity = np.where(live, (last + 1) * C * page_size, 0)
    first = np.zeros((L, B), np.int64)
    floor = np.zeros(B, np.int64)
    for i, lay in enumerate(layouts):
        if lay.sliding_window:
            first[i] = np.maximum(lengths - lay.sliding_window, 0) // page_size // C
            capacity = np.minimum(
                capacity, np.where(live, (first[i] + 1) * C * page_size + lay.sliding_window - 1, capacity)
            )
            floor = np.maximum(floor, np.where(first[i] > 0, first[i] * C * page_size + lay.sliding_window, 0))
    if int((last + 1).max(initial=0)) > splits:
        raise ValueError(f"a sequence needs {int(last.max()) + 1} chunks of {C} pages, more than splits={splits}")
    # Items: (layer, seq, unit, chunk) for every live unit and chunk first..last, layer-major.
    chunks = np.where(live[None], last[None] - first + 1, 0)[:, :, None] * (unit_cost[:, None, :] > 0)  # [L, B, H]
    n = chunks.ravel()
    group = np.repeat(np.arange(n.size), n)
    local = _rank_in_runs(n)  # the chunk's place among its group's chunks
    k = local + np.repeat(first[:, :, None].repeat(H, 2).ravel(), n)
    layer, seq, unit = group // (B * H), group % (B * H) // H, group % H
    per_layer = np.bincount(layer, minlength=L)
    real = np.flatnonzero(n)
    merge = _merges(L, real // (B * H), real % (B * H), n[real], H)
    begin = np.zeros(n.size, np.int64)
    begin[real] = merge.begin
    slot = np.repeat(begin, n) + local  # chunks in slot order
    tokens = np.minimum((k + 1) * C * page_size, capacity[seq]) - k * C * page_size
    cost = tokens * unit_cost[layer, unit] + config.item_overhead
    # Deal each layer's items longest first, round-robin over the programs.
    order = np.lexsort((-cost, layer))
    rank = _rank_in_runs(per_layer)
    prog, turn = rank % P, rank // P
    R = pow2_ceil(int(turn.max(initial=0)) + 1)
    items = np.zeros((L, P, R, 5), np.int32)
    o = order
    items[layer[o], prog, turn] = np.stack([seq[o], unit[o], k[o] * C, (k[o] + 1) * C, slot[o]], axis=1)
    counts = np.zeros((L, P), np.int32)
    np.add.at(counts, (layer[o], prog), 1)
    loads = np.zeros((L, P), np.int64)
    np.add.at(loads, (layer[o], prog), cost[o])
    return BuiltSchedule(merge.schedule(items, counts, config), capacity, loads, per_layer, floor)


def _stream(first_page, pages, page_cost, P, item_overhead, snap_pages, config):
    """Equal shares of each layer's work, cut at page boundaries: program p takes the stretch from p/P to
    (p+1)/P of the layer's groups laid end to end (stream-K's split), so it gets one to a few items (the ends of
    the groups it spans) and every program gets the same load up to a page. A cut within ``snap_pages`` of a
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
    g = np.clip(
        np.searchsorted(worth, target, side="right") - 1,
        layer_first[:-1, None],
        np.maximum(layer_first[1:, None] - 1, 0),
    )
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
    merge = _merges(L, g_layer[split_groups], real[split_groups] % (B * H), pieces[split_groups], H)
    begin = np.zeros(n, np.int64)
    begin[split_groups] = merge.begin
    slot = np.where(split[grp], begin[grp] + chunk, -1)

    # The table: items of each (layer, program) in line order.
    row = layer * P + prog  # nondecreasing along the line
    per_row = np.bincount(row, minlength=L * P)
    counts = per_row.reshape(L, P).astype(np.int32)
    rank = _rank_in_runs(per_row)
    R = pow2_ceil(int(counts.max(initial=1)))
    items = np.zeros((L * P * R, 5), np.int32)
    items[row * R + rank] = np.stack([g_seq[grp], g_unit[grp], first, end, slot], axis=1)
    items = items.reshape(L, P, R, 5)
    cost = (b - a) * g_cost[grp] + item_overhead
    loads = np.bincount(row, weights=cost, minlength=L * P).reshape(L, P).astype(np.int64)
    return merge.schedule(items, counts, config), loads, np.bincount(layer, minlength=L)


def compiled_shape(
    layouts: HeadLayout | Sequence[HeadLayout],
    max_batch: int,
    num_programs: int | None = None,
    *,
    config: DecodeConfig = DECODE,
    splits: int = 0,
    classes: int = 1,
) -> ScheduleShape:
    """A shape that holds the LPT schedule of any lengths of up to ``max_batch`` sequences (with ``splits``, the
    batch-invariant schedule of sequences of up to ``splits`` chunks), so a step compiled for it serves them all.

    LPT splits only groups costlier than a program's average load, into chunks no costlier than it: at most
    ``P * items_per_program`` split groups with ``2 * P * items_per_program`` partial slots among them, and
    ``groups + slots`` items dealt ``P`` a round. The stream schedule's split groups and slots are within the
    same bounds (its ``P - 1`` cuts), its rounds are not ("auto" keeps it only where it fits). Scheduled a class
    at a time (``build_decode_schedule``'s ``classes``, at most ``classes`` a layer), each class has those bounds,
    and its rounds round up once more."""
    P = num_programs or config.num_programs()
    groups = max_batch * max(len(head_runs(lay, config)) for lay in as_layouts(layouts))
    if splits:
        return ScheduleShape(pow2_ceil(-(-groups * splits // P)), pow2_ceil(groups), pow2_ceil(groups * splits))
    split = classes * (P * config.items_per_program + 1)
    slots = 2 * split
    rounds = -(-(groups + slots) // P) + classes - 1
    return ScheduleShape(pow2_ceil(rounds), pow2_ceil(min(groups, split)), pow2_ceil(slots))


def realized_loads(schedule: DecodeSchedule, lengths, layouts: Sequence[HeadLayout], page_size: int) -> np.ndarray:
    """[L, P] work each program meets at ``lengths`` (which the schedule covers), in the cost model the schedule
    was built with: its items' token loops stop at the real lengths, so an aged schedule's loads differ from the
    scheduled ones.
    Its balance: ``load_balance``."""
    lengths = np.asarray(lengths, np.int64)
    items = schedule.items.astype(np.int64)
    seq, unit, first, end = (items[..., f] for f in (SEQ, UNIT, FIRST_PAGE, END_PAGE))
    tokens = np.maximum(np.minimum(end * page_size, lengths[seq]) - first * page_size, 0)
    width = _unit_costs(as_layouts(layouts), schedule.config)[np.arange(len(items))[:, None, None], unit]
    cost = tokens * width + schedule.config.item_overhead
    real = np.arange(items.shape[2]) < schedule.counts[..., None]
    return np.where(real, cost, 0).sum(axis=2)


def load_balance(loads: np.ndarray) -> float:
    """Mean over layers of (average program load / largest program load) of [L, P] loads; 1.0 is perfect."""
    return float(np.mean(loads.mean(axis=1) / np.maximum(loads.max(axis=1), 1)))


def static_decode_schedule(
    batch: int,
    pages_per_seq: int,
    layout: HeadLayout,
    page_size: int,
    num_programs: int | None = None,
    config: DecodeConfig = DECODE,
) -> DecodeSchedule:
    """A schedule that needs no lengths: every sequence scheduled at the block table's full width.

    For callers with no host schedule (e.g. inside a jitted step): correct for any lengths, balanced only when the
    sequences fill their tables. Built with numpy at trace time, so it becomes a constant of the step.
    """
    built = build_decode_schedule(
        np.full(batch, pages_per_seq * page_size), layout, page_size, num_programs, config=config
    )
    return built.schedule.layer(0)
