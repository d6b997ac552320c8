"""The prefill op's plan step: the static table of work items (prompt, query head, first query row), built at
trace time, and the tile arithmetic it shares with the kernel.

Balancing: a head class of width ``k + v`` gets query blocks ``block_q * 256 / (K + V columns loaded)`` rows tall
(capped), so every item does about the same work per key whatever its width; items then run longest first (causal
blocks late in the prompt see more keys), so the hardware scheduler packs the short ones into the tail.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.pallas_util import column_offsets
from kvjax.ops.tiles import loaded_columns, pow2_floor, tile


@dataclasses.dataclass(frozen=True)
class WidthClass:
    """The heads of one layer that share (k_width, v_width), with each head's column offsets in units of 16."""

    k_width: int
    v_width: int
    heads: tuple[int, ...]
    q_off: tuple[int, ...]  # start of the head's group of query heads in q (packed, K widths)
    k_off: tuple[int, ...]
    v_off: tuple[int, ...]
    o_off: tuple[int, ...]  # start of the head's group of outputs in out (packed, V widths)

    @property
    def k_tile(self) -> int:
        return tile(self.k_width)

    @property
    def v_tile(self) -> int:
        return tile(self.v_width)


def width_classes(layout: HeadLayout) -> tuple[tuple[WidthClass, ...], tuple[int, ...]]:
    """The layer's width classes, and the class index of every KV head."""
    offs = column_offsets(layout)
    pairs = list(dict.fromkeys(zip(layout.k_widths, layout.v_widths)))
    classes = []
    for kw, vw in pairs:
        heads = tuple(h for h in range(layout.num_kv_heads) if (layout.k_widths[h], layout.v_widths[h]) == (kw, vw))
        classes.append(WidthClass(kw, vw, heads, *(tuple(offs[n][h] // 16 for h in heads) for n in "qkvo")))
    class_of = tuple(pairs.index(p) for p in zip(layout.k_widths, layout.v_widths))
    return tuple(classes), class_of


# Bytes of K/V tiles one pipelined key loop keeps in flight, (num_stages - 1) x keys x loaded columns x itemsize,
# that fit Hopper's shared memory (each class has two such loops, plus its q tile): 2 x 128 x 176 x 2 (the odd-widths
# layer's widest class, 112+64, with 128 keys) compiled on the H100 at 8 warps and 3 stages; 2 x 128 x 256 x 2
# (an 80+80 class through 128-wide tiles) did not (272 KB asked for).
KV_TILE_BYTES = 2 * 128 * 176 * 2


def keys_per_step(block_k: int, rows: int, cols: int, itemsize: int, num_stages: int) -> int:
    """Keys per loop step: ``block_k`` (at most the query rows), halved until the K/V tiles fit shared memory."""
    keys = min(block_k, rows)
    while keys > 16 and max(num_stages - 1, 1) * keys * cols * itemsize > KV_TILE_BYTES:
        keys //= 2
    return keys


def block_rows(cls, block_q: int, seq_len: int, balanced: bool, max_rows: int, max_segments: int) -> int:
    """Query rows per item for a head class: taller for narrower heads when balanced."""
    cols = loaded_columns(cls.k_width, max_segments) + loaded_columns(cls.v_width, max_segments)
    rows = pow2_floor(block_q * 256 / cols) if balanced else block_q
    return max(16, min(rows, max_rows, 1 << math.ceil(math.log2(max(seq_len, 16)))))


def work_items(
    layout: HeadLayout, batch: int, seq_len: int, block_q: int, balanced: bool, max_rows: int, max_segments: int
) -> np.ndarray:
    """int32 [N, 3] items (prompt, query head, first query row), longest first when balanced."""
    classes, class_of = width_classes(layout)
    g = layout.group_size
    items, costs = [], []
    for h in range(layout.num_heads):
        cls = classes[class_of[h // g]]
        rows = block_rows(cls, block_q, seq_len, balanced, max_rows, max_segments)
        for q0 in range(0, seq_len, rows):
            for b in range(batch):
                items.append((b, h, q0))
                costs.append(rows * min(q0 + rows, seq_len) * (cls.k_width + cls.v_width))
    table = np.asarray(items, np.int32)
    if balanced:
        return table[np.argsort(-np.asarray(costs), kind="stable")]
    return table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]
