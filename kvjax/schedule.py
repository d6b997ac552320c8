"""Host-side decode schedule: the "plan" step before each decode kernel "run" (numpy only).

The decode kernel (``kvjax.pallas.decode``) runs ``P`` persistent programs; program ``p`` works through row ``p`` of
the schedule. A work item is (sequence, KV head, chunk of pages) and costs ``tokens * (k_width + v_width)`` plus a
small fixed overhead. Groups (sequence, KV head) whose cost exceeds the average load per program are split into
chunks first, so no item dominates; items are sorted longest first and dealt to the least-loaded program (LPT).
Dealing runs in rounds of ``P`` items (each round gives its items, longest first, to the programs in order of
load), vectorized with numpy over all layers at once; an item-by-item heap in Python would cost about a
microsecond per item (65K items for 32 layers at batch 256). Chunks of a split group write partial softmax states
to slots that ``merge`` in the kernel module combines afterwards. Measured host cost: bench/RESULTS.md.

The schedule depends only on page counts and widths. It covers ``headroom_pages`` pages past each sequence's last
one (the kernel masks tokens past the real length), so one plan serves every step until a sequence outgrows it or
the batch changes: ``DecodePlanner`` keeps it until then. All arrays are int32 with power-of-two bucketed shapes,
so a jitted step that takes them as ordinary arguments recompiles only when a bucket changes.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from typing import Sequence

import jax
import numpy as np

from kvjax.layout import HeadLayout

H100_SMS = 132

# Item fields, in this order along the last axis of ``DecodeSchedule.items``.
SEQ, HEAD, FIRST_PAGE, END_PAGE, SLOT = range(5)


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

    items [L, P, R, 5]: per program, its items (seq, kv_head, first_page, end_page, slot) in run order;
        slot is -1 when the item is its group's only chunk (the kernel writes the output directly).
    counts [L, P]: how many items of each row are real.
    merge_dest [L, M, 2]: (seq, kv_head) of each split group; padding rows hold seq = -1.
    merge_slots [L, M, S]: the partial slots of each split group (slot = m * S + chunk), -1 where unused.
    """

    items: np.ndarray
    counts: np.ndarray
    merge_dest: np.ndarray
    merge_slots: np.ndarray

    def layer(self, i: int) -> "DecodeSchedule":
        """The schedule of layer ``i`` (arrays without the leading layer axis)."""
        return DecodeSchedule(self.items[i], self.counts[i], self.merge_dest[i], self.merge_slots[i])

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
        """Mean over layers of (average program load / largest program load); 1.0 is perfect."""
        return float(np.mean(self.loads.mean(axis=1) / np.maximum(self.loads.max(axis=1), 1)))


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


def build_decode_schedule(lengths, layouts: HeadLayout | Sequence[HeadLayout], page_size: int,
                          num_programs: int | None = None, *, order: str = "lpt", headroom_pages: int = 0,
                          min_chunk_tokens: int = 256, item_overhead: int = 32 * 64) -> DecodePlan:
    """Plan decode for sequences of ``lengths`` tokens (new token included) over one layer or all layers.

    order: "lpt" (longest first to the least-loaded program) or "naive" (natural (seq, head, chunk) order dealt
    round-robin: the ablation). min_chunk_tokens: chunks are never made shorter than this (a chunk's fixed cost
    then outweighs balance). item_overhead: fixed cost of an item in the units of tokens * width.
    """
    if order not in ("lpt", "naive"):
        raise ValueError(f"order must be 'lpt' or 'naive', not {order!r}")
    _keep_heap()
    layouts = _as_layouts(layouts)
    P = num_programs or default_num_programs()
    lengths = np.asarray(lengths, np.int64)
    B, L, H = len(lengths), len(layouts), layouts[0].num_kv_heads
    width = np.array([[k + v for k, v in zip(lay.k_widths, lay.v_widths)] for lay in layouts], np.int64)  # [L,H]

    live = lengths > 0
    end_page = np.where(live, -(-lengths // page_size) + headroom_pages, 0)  # [B]
    window = np.array([lay.sliding_window or 0 for lay in layouts], np.int64)[:, None]  # [L, 1]
    first_page = np.where(window > 0, np.maximum(lengths[None] - window, 0) // page_size, 0)
    first_page = np.minimum(first_page, end_page[None])  # [L, B]
    pages = (end_page[None] - first_page)[:, :, None]  # [L, B, 1]

    # Split each (layer, seq, head) group into chunks no costlier than the average program load.
    cost = pages * page_size * width[:, None, :]  # [L, B, H]
    avg = np.maximum(cost.sum(axis=(1, 2), keepdims=True) / P, 1)
    min_pages = max(1, min_chunk_tokens // page_size)
    chunks = np.minimum(np.ceil(cost / avg), np.maximum(pages // min_pages, 1))
    chunk_pages = np.broadcast_to(-(-pages // np.maximum(chunks, 1)).astype(np.int64), cost.shape)
    chunks = np.where(pages > 0, -(-pages // np.maximum(chunk_pages, 1)), 0).reshape(L, B * H)
    chunk_pages = chunk_pages.reshape(L, B * H)

    # Items in dense [L, N] arrays (natural order: seq, head, chunk), padded with empty items.
    per_layer = chunks.sum(axis=1)
    N = int(per_layer.max(initial=0))
    n = chunks.ravel()
    group = np.repeat(np.arange(n.size), n)  # flat (layer, seq, head) of every item
    start = np.cumsum(per_layer) - per_layer
    k = np.arange(group.size) - np.repeat(np.cumsum(n) - n, n)  # chunk index within its group
    layer_of = group // (B * H)
    col = np.arange(group.size) - start[layer_of]  # position within its layer
    g = group % (B * H)
    seq, head = g // H, g % H
    p0 = first_page[layer_of, seq] + k * chunk_pages.ravel()[group]
    p1 = np.minimum(p0 + chunk_pages.ravel()[group], end_page[seq])
    fields = np.zeros((L, max(N, 1), 6), np.int32)  # per item: seq, head, first, end, slot, cost (0: no item)
    split = (n > 1)[group]
    # Partial slots for split groups: dense per layer, slot = merge_index * S + chunk.
    S = bucket(int(n.max(initial=1)))
    split_groups = (chunks > 1)
    m_of_group = np.cumsum(split_groups, axis=1) - 1  # [L, B*H] merge index of each split group
    M = bucket(int(split_groups.sum(axis=1).max(initial=0)))
    slot = np.where(split, m_of_group.ravel()[group] * S + k, -1)
    cost_item = (p1 - p0) * page_size * width[layer_of, head] + item_overhead
    width_n = fields.shape[1]
    fields.reshape(-1, 6)[layer_of * width_n + col] = np.stack([seq, head, p0, p1, slot, cost_item], axis=1)
    merge_dest = np.full((L, M, 2), -1, np.int32)
    merge_slots = np.full((L, M, S), -1, np.int32)
    lg, gg = np.nonzero(split_groups)
    merge_dest[lg, m_of_group[lg, gg]] = np.stack([gg // H, gg % H], axis=1)
    si = np.flatnonzero(split)
    merge_slots[layer_of[si], m_of_group.ravel()[group[si]], k[si]] = slot[si]

    # Deal: longest first (16-bit keys: LPT needs the order only roughly, and a radix sort is cheap) or natural.
    item_cost = fields[..., 5].astype(np.int64)
    if order == "lpt":
        key = 65535 - (item_cost * 65535 // max(int(item_cost.max(initial=1)), 1)).astype(np.uint16)
        by_cost = np.argsort(key, axis=1, kind="stable")  # [L, N]; empty items (cost 0) last
    else:
        by_cost = np.broadcast_to(np.arange(width_n), (L, width_n))
    sorted_cost = np.take_along_axis(item_cost, by_cost, axis=1)
    rounds = -(-N // P)
    R = bucket(rounds)
    table = np.full((L, P, R), -1, np.int64)  # item (column in fields) at each program and round
    loads = np.zeros((L, P), np.int64)
    rows = np.arange(L)[:, None]
    for r in range(rounds):
        dealt, c = by_cost[:, r * P:(r + 1) * P], sorted_cost[:, r * P:(r + 1) * P]
        targets = (np.argsort(loads, axis=1, kind="stable") if order == "lpt"
                   else np.broadcast_to(np.arange(P), (L, P)))[:, : dealt.shape[1]]
        table[rows, targets, r] = np.where(c > 0, dealt, -1)
        loads[rows, targets] += c
    counts = (table >= 0).sum(axis=2).astype(np.int32)
    items = fields.reshape(-1, 6)[(rows[:, :, None] * width_n + np.maximum(table, 0)).ravel(), :5]
    items[(table < 0).ravel()] = 0
    items = items.reshape(L, P, R, 5)

    capacity = np.where(live, end_page * page_size, 0)
    return DecodePlan(DecodeSchedule(items, counts, merge_dest, merge_slots), capacity, loads, per_layer)


def static_decode_schedule(batch: int, pages_per_seq: int, layout: HeadLayout, page_size: int,
                           num_programs: int | None = None) -> DecodeSchedule:
    """A schedule that needs no lengths: every sequence planned at the block table's full width.

    For callers with no host plan (e.g. inside a jitted step): correct for any lengths, balanced only when the
    sequences fill their tables. Built with numpy at trace time, so it becomes a constant of the step.
    """
    plan = build_decode_schedule(np.full(batch, pages_per_seq * page_size), layout, page_size, num_programs)
    return plan.schedule.layer(0)


class DecodePlanner:
    """Keeps one plan until a sequence outgrows it or the batch changes (the builder of vLLM / FlashInfer)."""

    def __init__(self, layouts, page_size: int, num_programs: int | None = None, *, headroom_pages: int = 1,
                 **options):
        self.layouts, self.page_size = _as_layouts(layouts), page_size
        self.num_programs = num_programs or default_num_programs()
        self.headroom_pages, self.options = headroom_pages, options
        self.plan: DecodePlan | None = None
        self.rebuilds = 0

    def __call__(self, lengths) -> DecodeSchedule:
        if self.plan is None or not self.plan.covers(lengths):
            self.plan = build_decode_schedule(lengths, self.layouts, self.page_size, self.num_programs,
                                              headroom_pages=self.headroom_pages, **self.options)
            self.rebuilds += 1
        return self.plan.schedule
