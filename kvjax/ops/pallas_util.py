"""Pieces the Pallas kernels share: masked row loads and stores in flat arrays, the block-table lookup of a token's
page, whole-array blocks, dot precision, the online softmax, and a fast lookup of the Triton dialect for their
lowering. Where heads' columns sit is ``ops.columns``."""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.columns import column_offsets

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked block must not make exp2(-inf + inf) NaN
# An index past every buffer, where masked lanes of a store point in interpret mode: it drops them instead of letting
# a masked lane's write-back collide with a real lane's store.
NOWHERE = int(np.iinfo(np.int32).max)


def register_triton_dialect() -> None:
    """Let MLIR's Python bindings find the Triton ("tt") dialect module by the first name they try. They look it up
    for every op the Pallas lowering builds and never remember a miss, so each op walked the import path: 70% of
    lowering a compressed model's decode kernels (bench/results/startup.md "Engine: first call of a step")."""
    try:
        from jax._src.lib.triton import dialect
    except ImportError:  # a jaxlib without the Triton dialect: nothing is lowered to it
        return
    sys.modules.setdefault("jaxlib.mlir.dialects.tt", dialect)


register_triton_dialect()


def page_of(table_ref, seq, tokens, page_size: int, ok=None):
    """In a kernel: the pages holding sequence ``seq``'s ``tokens`` (a vector, or one token), from the block table
    [B, pages_per_seq]. With ``ok``, a token where it is False reads no entry past the table (the index is clamped)
    and gets page 0: the caller masks what it loads from there."""
    if ok is None:
        return table_ref[seq, tokens // page_size]
    at = jnp.minimum(tokens // page_size, table_ref.shape[1] - 1)
    if jnp.ndim(tokens) == 0:  # one entry: read and selected, no masked load of a scalar
        return jnp.where(ok, table_ref[seq, at], 0)
    return plgpu.load(table_ref.at[seq, at], mask=ok, other=0)


def page_rows(table_ref, seq, tokens, page_size: int, ok=None):
    """In a kernel: rows of the flat page pool [num_pages * page_size, cols] holding sequence ``seq``'s ``tokens``
    (``page_of``'s pages; with ``ok``, page 0's rows where it is False)."""
    return page_of(table_ref, seq, tokens, page_size, ok) * page_size + tokens % page_size


def _mask(cols_ok, rows_ok):
    if rows_ok is None:
        return cols_ok
    return rows_ok[:, None] if cols_ok is None else rows_ok[:, None] & cols_ok


def load_rows(ref, rows, stride, offset, cols, cols_ok=None, rows_ok=None):
    """Flat ``ref`` read as rows ``stride`` wide: ``ref[rows, offset + cols]`` [R, C], 0 where ``cols_ok`` [1, C] or
    ``rows_ok`` [R] is false; with neither mask, plain vector loads."""
    mask = _mask(cols_ok, rows_ok)
    index = rows[:, None] * stride + offset + cols
    return plgpu.load(ref.at[index], mask=mask, other=None if mask is None else 0.0)


def store_rows(ref, rows, stride, offset, cols, values, cols_ok=None, rows_ok=None, *, interpret=False):
    """``ref[rows, offset + cols] = values`` for flat ``ref`` read as rows ``stride`` wide, where both masks allow.

    On the GPU a masked lane touches no memory, and the plain index keeps the store vectorized; interpret mode
    scatters every lane, and a masked column can wrap into the next row onto a real lane's index, so there its
    lanes point ``NOWHERE``."""
    mask = _mask(cols_ok, rows_ok)
    index = rows[:, None] * stride + offset + cols
    if interpret and mask is not None:
        index = jnp.where(mask, index, NOWHERE)
    plgpu.store(ref.at[index], values.astype(ref.dtype), mask=mask)


def whole_block(x) -> pl.BlockSpec:
    """The whole array as every program's block, whatever the grid's rank; a flat array's length stays out of the
    kernel's code (an element offset, not a block size), so layers of other widths share the compiled kernel."""
    if len(x.shape) == 1:
        return pl.BlockSpec((pl.Element(x.shape[0]),), lambda *_: (0,))
    return pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))


def dot_precision(dtype):
    """float32 inputs get exact (IEEE) dots; bf16/f16 use the tensor cores' native precision."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def online_update(carry, s, v, extra=None, precision=None):
    """The online-softmax update of (acc [R, VT], running max m [R], running sum l [R]) with a block's scores ``s``
    [R, T] in log2 units, its values ``v`` [T, VT] and ``extra(p)``, what else the weights ``p`` add to the output
    (None: nothing)."""
    acc, m, l = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    if extra is not None:
        acc = acc + extra(p)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1)


def merge_splits(acc, m, l, with_lse: bool = False):
    """The attention output [..., G, W] from S splits' partial softmax states: unnormalized sums ``acc`` [..., S, G,
    W], running maxima ``m`` and sums ``l`` [..., S, G] (log2 units), each split weighted by ``2^(m - max m)`` (a
    split that saw nothing, none); rows that saw nothing at all give zeros (float32). ``with_lse``: also each row's
    whole denominator, ``log_sum``'s [..., G]."""
    top = m.max(axis=-2, keepdims=True)
    w = jnp.where(l > 0, jnp.exp2(m - top), 0.0)
    total = (w * l).sum(axis=-2)
    out = (w[..., None] * acc).sum(axis=-3) / jnp.where(total > 0, total, 1.0)[..., None]
    return (out, log_sum(top.squeeze(-2), total)) if with_lse else out


def log_sum(top, total):
    """log2 of a softmax denominator from its merged maximum ``top`` and its sum ``total`` under it (log2 units); a
    row that saw nothing (``total`` 0) gives MASK, not -inf."""
    return jnp.where(total > 0, top + jnp.log2(jnp.where(total > 0, total, 1.0)), MASK)


def width_pairs(layout: HeadLayout) -> list[tuple[tuple[int, int], list[int]]]:
    """Each distinct (K width, V width) pair with its heads, in the order of their first head: a kernel each."""
    out: dict[tuple[int, int], list[int]] = {}
    for h, pair in enumerate(zip(layout.k_widths, layout.v_widths)):
        out.setdefault(pair, []).append(h)
    return list(out.items())


def by_width_pair(q, layout: HeadLayout, attend):
    """Packed outputs [B, out_cols] of a kernel run once per width pair (``width_pairs``): ``attend(kw, vw, heads,
    qh)`` gets the pair's heads' query columns ``qh`` [B, heads, G * kw] and returns their outputs [B, heads, G * vw];
    each head's lands at its place in the packed output."""
    offs, g = column_offsets(layout), layout.group_size
    outs: list = [None] * layout.num_kv_heads  # each head's output columns, in head order as out_cols holds them
    for (kw, vw), heads in width_pairs(layout):
        qh = jnp.stack([q[:, offs["q"][h] : offs["q"][h] + g * kw] for h in heads], axis=1)
        got = attend(kw, vw, heads, qh)
        for j, h in enumerate(heads):
            outs[h] = got[:, j]
    return jnp.concatenate(outs, axis=1)
