"""The per-head kernels' merge (Pallas, Triton lowering): each (sequence, KV head)'s split work items folded into
its rows of the packed output, every partial read once.

``head_kernel``'s live launch and ``quant_head_kernel``'s launches leave a head's splits as consecutive work items
(``head_kernel.live_work``'s list: acc [items, G, width], m and l [items, G] in log2 units, ``width`` columns
whatever the head's own V width). ``head_kernel.merge_items`` merges them in XLA: a butterfly over every item of the
buffer, then a gather and a concatenation of the heads; on the int4 engine step those fusions cost about 2.6 ms of
the step's 15.4 (bench/results/eviction.md "Eviction on quantized pages: a work list a launch (H100)"). Here one
program a (head, query row) loads the row of its head's items at once ([16 items, width], masked to its count and
its V width), weights each by ``2^(m - max m)`` as ``pallas_util.merge_splits`` does, and stores the row's
``v_width`` columns where the packed output holds them. The layer's widths, offsets and output columns are inputs,
not statics, so the layers share one compiled merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.pallas_util import MASK, load_rows, log_sum, store_rows, whole_block
from kvjax.ops.tiles import tile

MAX_SPLITS = 16  # the most work items a head has (``head_kernel.live_work``'s splits): one load reads them all


def _kernel(dims_ref, first_ref, splits_ref, vw_ref, off_ref, acc_ref, m_ref, l_ref, out_ref, *lse, **static):
    """Program (r, row): query row ``row`` of flat head r (sequence r // heads, KV head r % heads)."""
    g, heads, width, interpret = static["g"], static["heads"], static["width"], static["interpret"]
    r, row = pl.program_id(0), pl.program_id(1)
    seq, head = r // heads, r % heads
    start = first_ref[r]
    count = jnp.where(start >= 0, splits_ref[r], 0)  # a head that stores nothing: no items, zeros out
    item = jnp.maximum(start, 0) + jnp.arange(MAX_SPLITS)
    live = jnp.arange(MAX_SPLITS) < count
    part = item * g + row
    vw = vw_ref[head]
    cols = jnp.arange(tile(width))[None, :]
    cols_ok = cols < vw
    m = plgpu.load(m_ref.at[part], mask=live, other=MASK)
    l = plgpu.load(l_ref.at[part], mask=live, other=0.0)
    acc = load_rows(acc_ref, part, width, 0, cols, cols_ok, live)
    top = jnp.max(m)
    w = jnp.where(l > 0, jnp.exp2(m - top), 0.0)
    total = jnp.sum(l * w)
    out = jnp.sum(acc * w[:, None], axis=0, keepdims=True) / jnp.where(total > 0, total, 1.0)
    at = off_ref[head] + row * vw
    store_rows(out_ref, jnp.full((1,), seq), dims_ref[0], at, cols, out, cols_ok, interpret=interpret)
    if lse:
        store_rows(
            lse[0], jnp.full((1,), r), g, row, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), log_sum(top, total))
        )


MERGES = ("kernel", "xla")


def check_merge(merge) -> None:
    """A per-head kernel's ``merge`` option, refused in one line unless one of ``MERGES``."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")


def merge_heads(acc, m, l, first, splits, layout: HeadLayout, dtype, *, with_lse: bool = False, interpret=False):
    """The packed output [B, out_cols] in ``dtype`` from the per-head kernels' work items: acc [items, G, width]
    float32 (a head's output in its first ``v_width`` columns), m and l [items, G] (log2 units); ``first`` [B x Hkv]
    int32: each (sequence, head)'s first item, -1 where it stores nothing (zeros out); ``splits``: its items, one
    count or [B x Hkv], at most 16. Equal to ``head_kernel.merge_at`` then ``packed_out`` (float32 sums in another
    order). ``with_lse``: also each query row's whole softmax denominator [B x Hkv, G] (``log_sum``; MASK where
    the head stores nothing)."""
    items, g, width = acc.shape
    heads = layout.num_kv_heads
    rows = first.shape[0]
    if rows % heads or m.shape != (items, g) or l.shape != (items, g) or g != layout.group_size:
        raise ValueError(
            f"acc [items, {layout.group_size}, width], m and l [items, G] and first [B x {heads}] expected"
        )
    if max(layout.v_widths) > width:
        raise ValueError(f"acc holds {width} columns an item; the layout's widest V head has {max(layout.v_widths)}")
    b = rows // heads
    splits = jnp.broadcast_to(jnp.asarray(splits, jnp.int32), (rows,))
    widths = np.asarray(layout.v_widths, np.int32)
    offsets = np.asarray(HeadLayout.offsets(layout.v_widths, g), np.int32)
    out_cols = int(widths.sum()) * g
    inputs = [
        jnp.asarray([out_cols], jnp.int32),  # the layer's, not static: one module for every layer
        first.astype(jnp.int32),
        splits,
        jnp.asarray(widths),
        jnp.asarray(offsets),
        acc.reshape(-1),
        m.reshape(-1),
        l.reshape(-1),
    ]
    shapes = [jax.ShapeDtypeStruct((b * out_cols,), dtype)]
    if with_lse:
        shapes.append(jax.ShapeDtypeStruct((rows * g,), jnp.float32))
    got = pl.pallas_call(
        functools.partial(_kernel, g=g, heads=heads, width=width, interpret=interpret),
        out_shape=shapes,
        grid=(rows, g),
        in_specs=[whole_block(x) for x in inputs],
        out_specs=[whole_block(x) for x in shapes],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kvjax_head_merge",
    )(*inputs)
    out = got[0].reshape(b, out_cols)
    return (out, got[1].reshape(rows, g)) if with_lse else out
