"""The prefill op's work, laid out at trace time: the tile classes its kernel compiles for (``tile_classes``), each
layer's head table (``head_table``: every KV head's class, widths and column offsets, read by the kernel at run time)
and the work items (``work_items``: prompt, query head, first query row).

The kernel's code and grid depend on the model's classes and the chunk shape, never on the layer, so XLA compiles it
once for all layers (bench/results/startup.md "Engine: compile times"). A class's query blocks are sized so that
every item does about the same work per key whatever its widths, and items run longest first.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.tiles import pow2_floor, tile

CLASS = columns.HEAD_FIELDS  # the column a head table row adds to ``columns.head_columns``: the head's tile class


@dataclasses.dataclass(frozen=True)
class TileClass:
    """Heads read through a ``k_tile``-wide K tile and a ``v_tile``-wide V tile; ``*_masked``: some head of the class
    is narrower than its tile, so loads mask columns past each head's width (else they stay plain vectors)."""

    k_tile: int
    v_tile: int
    k_masked: bool
    v_masked: bool

    @property
    def cols(self) -> int:
        return self.k_tile + self.v_tile


def tile_for(width: int, tile_widths: tuple[int, ...]) -> int:
    """The narrowest of ``tile_widths`` that holds ``width`` columns (a power-of-two tile past the widest)."""
    return next((t for t in sorted(tile_widths) if t >= width), tile(width))


def tile_classes(layouts, tile_widths: tuple[int, ...]) -> tuple[TileClass, ...]:
    """The classes of every head of ``layouts`` (the layers that share a kernel), in first-seen order."""
    seen: dict[tuple[int, int], list[bool]] = {}
    for layout in layouts:
        for kw, vw in zip(layout.k_widths, layout.v_widths):
            kt, vt = tile_for(kw, tile_widths), tile_for(vw, tile_widths)
            masked = seen.setdefault((kt, vt), [False, False])
            masked[0] |= kw < kt
            masked[1] |= vw < vt
    return tuple(TileClass(kt, vt, *m) for (kt, vt), m in seen.items())


def class_of(layout: HeadLayout, classes: tuple[TileClass, ...], tile_widths: tuple[int, ...]) -> tuple[int, ...]:
    """Each KV head's class index."""
    pairs = [(c.k_tile, c.v_tile) for c in classes]
    return tuple(
        pairs.index((tile_for(kw, tile_widths), tile_for(vw, tile_widths)))
        for kw, vw in zip(layout.k_widths, layout.v_widths)
    )


def head_table(layout: HeadLayout, classes: tuple[TileClass, ...], tile_widths: tuple[int, ...]) -> np.ndarray:
    """int32 [num_kv_heads, HEAD_FIELDS + 1]: each KV head's ``columns.head_columns`` row, then its class."""
    cls = np.asarray(class_of(layout, classes, tile_widths), np.int32)[:, None]
    return np.concatenate([columns.head_columns(layout), cls], axis=1)


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


def block_rows(cls: TileClass, block_q: int, seq_len: int, balanced: bool, max_rows: int) -> int:
    """Query rows per item for a class: taller for narrower tiles when balanced."""
    rows = pow2_floor(block_q * 256 / cls.cols) if balanced else block_q
    return max(16, min(rows, max_rows, 1 << math.ceil(math.log2(max(seq_len, 16)))))


def num_items(
    layout: HeadLayout,
    classes: tuple[TileClass, ...],
    tile_widths: tuple[int, ...],
    batch: int,
    seq_len: int,
    block_q: int,
    balanced: bool,
    max_rows: int,
) -> int:
    """How many work items the layer's chunks of ``seq_len`` rows have."""
    heads_class = class_of(layout, classes, tile_widths)
    blocks = [
        -(-seq_len // block_rows(classes[heads_class[h // layout.group_size]], block_q, seq_len, balanced, max_rows))
        for h in range(layout.num_heads)
    ]
    return batch * sum(blocks)


def work_items(
    layout: HeadLayout,
    classes: tuple[TileClass, ...],
    heads_class: tuple[int, ...],
    batch: int,
    seq_len: int,
    block_q: int,
    balanced: bool,
    max_rows: int,
    count: int | None = None,
) -> np.ndarray:
    """int32 [count, 3] items (prompt, query head, first query row), longest first when balanced; rows past the
    layer's own items (``count``: the most any layer sharing the kernel has) start at ``seq_len``: they do nothing."""
    g = layout.group_size
    items, costs = [], []
    for h in range(layout.num_heads):
        cls = classes[heads_class[h // g]]
        rows = block_rows(cls, block_q, seq_len, balanced, max_rows)
        for q0 in range(0, seq_len, rows):
            for b in range(batch):
                items.append((b, h, q0))
                costs.append(rows * min(q0 + rows, seq_len) * cls.cols)
    table = np.asarray(items, np.int32)
    if balanced:
        table = table[np.argsort(-np.asarray(costs), kind="stable")]
    else:
        table = table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]
    if count is not None and count > len(table):
        table = np.concatenate([table, np.tile(np.asarray([[0, 0, seq_len]], np.int32), (count - len(table), 1))])
    return table
