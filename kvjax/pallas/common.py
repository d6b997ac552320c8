"""Small pieces the kernels share: tile sizes, head width classes, and scalar lookups of static tables.

Kernels are written for Pallas's Triton lowering. Tiles must have power-of-two shapes, so a head of width ``w`` is
read through a ``tile(w)``-wide tile whose columns past ``w`` are masked (a masked lane fetches nothing). Heads of the
same (K width, V width) share one compiled code path (a "class"); a program picks its class with ``lax.switch``.
Decode reads runs of adjacent heads (``kvjax.runs``) the same way: runs of one shape form a ``RunClass``. How a
width is cut into power-of-two pieces (``segments``) lives in ``kvjax.runs``, whose cost model counts them too.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.runs import RunShape, head_runs, tile  # noqa: F401  (tile: re-exported for the kernels)

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked block must not make exp2(-inf + inf) NaN


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
    offs = _column_offsets(layout)
    pairs = list(dict.fromkeys(zip(layout.k_widths, layout.v_widths)))
    classes = []
    for kw, vw in pairs:
        heads = tuple(h for h in range(layout.num_kv_heads) if (layout.k_widths[h], layout.v_widths[h]) == (kw, vw))
        classes.append(WidthClass(kw, vw, heads, *(tuple(offs[n][h] // 16 for h in heads) for n in "qkvo")))
    class_of = tuple(pairs.index(p) for p in zip(layout.k_widths, layout.v_widths))
    return tuple(classes), class_of


def _column_offsets(layout: HeadLayout) -> dict[str, list[int]]:
    g = layout.group_size
    offs = dict(q=HeadLayout.offsets(layout.k_widths, g), k=HeadLayout.offsets(layout.k_widths),
                v=HeadLayout.offsets(layout.v_widths), o=HeadLayout.offsets(layout.v_widths, g))
    if any(o % 16 for lst in offs.values() for o in lst):
        raise ValueError(f"head widths must be multiples of 16 for the Pallas kernels: {layout}")
    return offs


@dataclasses.dataclass(frozen=True)
class RunClass(RunShape):
    """The runs of adjacent heads (``kvjax.runs``) of one layer that share a shape, with the column offsets of each
    run's first head in units of 16. A run of n heads is read like one head ``k_cols`` + ``v_cols`` wide whose
    score tile has n * G real rows; ``k_starts``/``v_starts`` say where each row's columns lie."""

    units: tuple[int, ...] = ()  # the runs' indices in the layer (the schedule's unit ids)
    q_off: tuple[int, ...] = ()
    k_off: tuple[int, ...] = ()
    v_off: tuple[int, ...] = ()
    o_off: tuple[int, ...] = ()


def run_classes(layout: HeadLayout, pack_tile: int) -> tuple[tuple[RunClass, ...], tuple[int, ...]]:
    """The layer's run classes (runs from ``kvjax.runs.head_runs(layout, pack_tile)``), and each run's class."""
    offs = _column_offsets(layout)
    runs = head_runs(layout, pack_tile)
    shapes = list(dict.fromkeys(r.shape for r in runs))
    classes = []
    for shape in shapes:
        units = tuple(u for u, r in enumerate(runs) if r.shape == shape)
        classes.append(RunClass(shape.k_widths, shape.v_widths, units,
                                *(tuple(offs[n][runs[u].first] // 16 for u in units) for n in "qkvo")))
    return tuple(classes), tuple(shapes.index(r.shape) for r in runs)


def load_columns(ref, lead: tuple, offset, cols, width: int, rows_ok=None):
    """``ref[*lead, offset + cols]``: a head ``width`` columns wide read through a ``cols``-wide tile. Tile columns
    past the width and rows not ``rows_ok`` [R] are masked (fetch nothing, read 0); with neither, the load has no
    mask at all, so it stays plain 16-byte vectors."""
    mask = None if rows_ok is None else rows_ok[:, None]
    if cols.shape[-1] != width:
        mask = (cols < width) if mask is None else mask & (cols < width)
    return plgpu.load(ref.at[(*lead, offset + cols)], mask=mask, other=None if mask is None else 0.0)


def lookup(index, keys, values):
    """``values[keys.index(index)]`` for a traced scalar ``index`` over a short static table (a chain of selects)."""
    out = jnp.int32(values[-1])
    for key, value in zip(keys[:-1], values[:-1]):
        out = jnp.where(index == key, jnp.int32(value), out)
    return out


def offset16(index, keys, values):
    """A column offset from a table in units of 16, multiplied back so the compiler sees 16-alignment."""
    return lookup(index, keys, values) * 16


def dot_precision(dtype):
    """float32 inputs get exact (IEEE) dots; bf16/f16 use the tensor cores' native precision."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
