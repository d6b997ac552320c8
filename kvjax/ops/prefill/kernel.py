"""The prefill op's run step: causal flash attention for a batch of prompts whose KV heads have their own K and V
widths, writing their K/V into the pages (Pallas, Triton lowering).

One program per work item (prompt, query head, block of query rows) from the static table ``plan.work_items``
builds at trace time. Heads sharing (K width, V width) share one code path chosen by ``lax.switch``. A width that is
not a power of two is read as exact power-of-two pieces (80 = 64 + 16), one dot per piece, so no multiply is spent
on padding and 128-key steps fit shared memory. Steps left of the diagonal load without row masks; with pages, the
program of a group's first query head stores the diagonal K/V blocks it has loaded into the cache
(``input_output_aliases``: in place when the caller donates the pages).

Why Triton: masked loads at 16-column offsets inside packed rows and per-token page addresses for the cache write,
as in decode, plus a CPU interpreter for CI; Triton picks Hopper's wgmma for the dots. How it compares with cuDNN:
bench/RESULTS.md "Prefill vs cuDNN".
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.grouped import visible
from kvjax.ops.pallas_util import LOG2E, MASK, dot_precision, load_columns, lookup, offset16
from kvjax.ops.prefill.config import PREFILL, PrefillConfig
from kvjax.ops.prefill.plan import block_rows, keys_per_step, width_classes, work_items
from kvjax.ops.tiles import loaded_columns, segments


def _attend_block(
    cls,
    item,
    refs,
    *,
    group,
    seq_len,
    page_size,
    window,
    scale,
    block_q,
    block_k,
    balanced,
    max_rows,
    max_segments,
    num_stages,
    write_pages,
    prefix,
):
    """One item of a class (static widths): flash attention of its query rows (``prefix``: after the keys before
    its chunk, read from the pages), output store, cache write."""
    if write_pages:
        table_ref, q_ref, k_ref, v_ref, kp_in, vp_in, out_ref, kp_ref, vp_ref = refs
    else:
        table_ref, q_ref, k_ref, v_ref, out_ref = refs
    b, h, q0, length, start = item
    kw, vw = cls.k_width, cls.v_width
    k_pieces, v_pieces = segments(kw, max_segments), segments(vw, max_segments)
    bq = block_rows(cls, block_q, seq_len, balanced, max_rows, max_segments)
    cols = loaded_columns(kw, max_segments) + loaded_columns(vw, max_segments)
    bk = keys_per_step(block_k, bq, cols, jnp.dtype(k_ref.dtype).itemsize, num_stages)
    precision = dot_precision(k_ref.dtype)
    kv_head, gi = h // group, h % group
    qo = offset16(kv_head, cls.heads, cls.q_off) + gi * kw
    ko, vo = offset16(kv_head, cls.heads, cls.k_off), offset16(kv_head, cls.heads, cls.v_off)
    oo = offset16(kv_head, cls.heads, cls.o_off) + gi * vw

    rows = q0 + jnp.arange(bq)
    row_ok = (rows < seq_len)[:, None]

    def cols_of(t):
        return jnp.arange(t)[None, :]

    qs = [
        plgpu.load(q_ref.at[b, rows[:, None], qo + a + cols_of(t)], mask=row_ok & (cols_of(t) < w), other=0.0)
        for a, t, w in k_pieces
    ]
    qs = [(q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype) for q in qs]  # scores come out in log2 units
    q_end = jnp.minimum(q0 + bq, length)  # keys past the last live query row are never needed
    writer = (gi == 0) & write_pages

    def scores(ks):
        return functools.reduce(
            operator.add, [plgpu.dot(q, k, trans_b=True, precision=precision) for q, k in zip(qs, ks)]
        )

    def prefix_body(j, carry):  # keys before the chunk, read from the pages at absolute positions
        keys = j * bk + jnp.arange(bk)
        ok = keys < start
        src = _page_rows(table_ref, b, keys, page_size, ok)[:, None]
        ks = [load_columns(kp_in, (src,), ko + a, cols_of(t), w, ok) for a, t, w in k_pieces]
        vs = [load_columns(vp_in, (src,), vo + a, cols_of(t), w, ok) for a, t, w in v_pieces]
        seen = ok[None, :] & visible(start + rows[:, None], keys[None, :], window)
        return _softmax_step(carry, jnp.where(seen, scores(ks), MASK), vs, precision)

    def body(j, carry, masked):
        keys = j * bk + jnp.arange(bk)
        keys_ok = (keys < seq_len) if masked else None  # left of the diagonal every key exists: no row mask
        ks = [load_columns(k_ref, (b, keys[:, None]), ko + a, cols_of(t), w, keys_ok) for a, t, w in k_pieces]
        vs = [load_columns(v_ref, (b, keys[:, None]), vo + a, cols_of(t), w, keys_ok) for a, t, w in v_pieces]
        s = scores(ks)
        if masked:
            s = jnp.where(visible(rows[:, None], keys[None, :], window), s, MASK)
        if write_pages and masked:  # the item's own keys (>= q0) all lie in masked steps
            tok_ok = (keys >= q0) & (keys < length) & writer
            dest = jnp.where(tok_ok, _page_rows(table_ref, b, start + keys, page_size, tok_ok), kp_ref.shape[0])
            _store_rows(kp_ref, dest, tok_ok, ko, k_pieces, ks)
            _store_rows(vp_ref, dest, tok_ok, vo, v_pieces, vs)
        return _softmax_step(carry, s, vs, precision)

    carry = (
        tuple(jnp.zeros((bq, t), jnp.float32) for _, t, _ in v_pieces),
        jnp.full((bq,), MASK, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    if prefix:
        carry = _prefix_steps(prefix_body, carry, q0 < length, start + q0, start, bk, window)
    accs, _, l = _key_steps(body, carry, q0 < length, q0, q_end, bk, window)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    for acc, (a, t, w) in zip(accs, v_pieces):
        o_mask = row_ok & (cols_of(t) < w)
        plgpu.store(
            out_ref.at[b, jnp.where(o_mask, rows[:, None], seq_len), oo + a + cols_of(t)],
            (acc * inv_l[:, None]).astype(out_ref.dtype),
            mask=o_mask,
        )


def _softmax_step(carry, s, vs, precision):
    """One online-softmax step: scores ``s`` [rows, keys] (log2 units) against value tiles ``vs``."""
    accs, m, l = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    pv = p.astype(vs[0].dtype)
    accs = tuple(acc * alpha[:, None] + plgpu.dot(pv, v, precision=precision) for acc, v in zip(accs, vs))
    return accs, m_new, l * alpha + p.sum(axis=1)


def _page_rows(table_ref, b, positions, page_size, ok):
    """Rows of the flattened page pool [num_pages * page_size, cols] holding sequence b's ``positions``."""
    page = plgpu.load(table_ref.at[b, jnp.minimum(positions // page_size, table_ref.shape[1] - 1)], mask=ok, other=0)
    return page * page_size + positions % page_size


def _store_rows(ref, dest, ok, offset, pieces, tiles):
    """Store the ``ok`` rows of a head's column ``tiles`` at flattened page rows ``dest``."""
    for (a, t, w), x in zip(pieces, tiles):
        cols = jnp.arange(t)[None, :]
        plgpu.store(ref.at[dest[:, None], offset + a + cols], x, mask=ok[:, None] & (cols < w))


def _prefix_steps(body, carry, live, first_row, start, bk, window):
    """Run ``body`` over the key steps before the chunk (positions < ``start``) that the item's first query row, at
    ``first_row``, can see: all of them, or under a sliding window those from its lower edge."""
    first = jnp.maximum(first_row - window + 1, 0) // bk if window else 0
    return lax.fori_loop(first, jnp.where(live, jnp.maximum(pl.cdiv(start, bk), first), first), body, carry)


def _key_steps(body, carry, live, q0, q_end, bk, window):
    """Run ``body`` over an item's key steps: unmasked left of the diagonal (every key exists and is visible),
    masked on it; under a sliding window the window's lower edge cuts steps too, so all are masked."""
    diag_lo = q0 // bk
    if window:
        first = jnp.maximum(q0 - window + 1, 0) // bk
        return lax.fori_loop(
            first, jnp.where(live, pl.cdiv(q_end, bk), first), functools.partial(body, masked=True), carry
        )
    carry = lax.fori_loop(0, jnp.where(live, diag_lo, 0), functools.partial(body, masked=False), carry)
    return lax.fori_loop(
        diag_lo, jnp.where(live, pl.cdiv(q_end, bk), diag_lo), functools.partial(body, masked=True), carry
    )


def _kernel(items_ref, lengths_ref, starts_ref, *refs, classes, class_of, group, **static):
    pid = pl.program_id(0)
    b, h = items_ref[pid, 0], items_ref[pid, 1]
    item = (b, h, items_ref[pid, 2], lengths_ref[b], starts_ref[b])
    branches = [functools.partial(_attend_block, cls, refs=refs, group=group, **static) for cls in classes]
    if len(branches) == 1:
        branches[0](item)
    else:
        cls_index = lookup(h // group, tuple(range(len(class_of))), class_of)
        lax.switch(cls_index, [lambda it, f=f: f(it) for f in branches], item)


@functools.partial(jax.jit, static_argnames=("layout", "config", "interpret"))
def prefill_attention(
    q,
    k,
    v,
    layout: HeadLayout,
    lengths=None,
    k_pages=None,
    v_pages=None,
    block_table=None,
    starts=None,
    *,
    config: PrefillConfig = PREFILL,
    interpret: bool = False,
):
    """Causal attention of chunks of T prompt tokens; equal to ``reference.causal_attention`` (``starts`` None) and
    ``reference.chunk_attention``.

    q [B, T, q_cols], k [B, T, k_cols], v [B, T, v_cols]; lengths [B] (default T): rows at positions >= length
    are unspecified. With k_pages/v_pages [num_pages, page_size, cols] and block_table [B, pages_per_seq], also
    writes K/V rows at positions < length into the pages and returns (out, k_pages, v_pages); else returns out.
    ``starts`` [B] (pages only; default 0): chunk b holds positions ``starts[b]`` on, and its queries also attend
    to the ``starts[b]`` keys before it, read from the pages (chunked prefill).
    """
    b, t, _ = q.shape
    config = config.for_dtype(q.dtype)
    balanced, block_q, block_k, max_block_q = config.balanced, config.block_q, config.block_k, config.max_block_q
    max_segments, num_warps, num_stages = config.max_segments, config.num_warps, config.num_stages
    classes, class_of = width_classes(layout)
    items = jnp.asarray(work_items(layout, b, t, block_q, balanced, max_block_q, max_segments))
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    write = k_pages is not None
    prefix = starts is not None
    if prefix and not write:
        raise ValueError("chunks that start past position 0 read their earlier keys from the pages: pass them")
    starts = starts.astype(jnp.int32) if prefix else jnp.zeros((b,), jnp.int32)
    page_size = k_pages.shape[1] if write else 1
    kernel = functools.partial(
        _kernel,
        classes=classes,
        class_of=class_of,
        group=layout.group_size,
        seq_len=t,
        page_size=page_size,
        window=layout.sliding_window,
        scale=1.0 / math.sqrt(layout.head_dim),
        block_q=block_q,
        block_k=block_k,
        balanced=balanced,
        max_rows=max_block_q,
        max_segments=max_segments,
        num_stages=num_stages,
        write_pages=write,
        prefix=prefix,
    )
    out_shape = [jax.ShapeDtypeStruct((b, t, layout.out_cols), q.dtype)]
    args = [
        items,
        lengths,
        starts,
        jnp.zeros((b, 1), jnp.int32) if block_table is None else block_table.astype(jnp.int32),
        q,
        k,
        v,
    ]
    aliases = {}
    if write:
        flat = [p.reshape(-1, p.shape[-1]) for p in (k_pages, v_pages)]
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat]
        args += flat
        aliases = {7: 1, 8: 2}
    res = pl.pallas_call(
        kernel,
        grid=(items.shape[0],),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="kvjax_prefill_attention",
    )(*args)
    if write:
        return res[0], res[1].reshape(k_pages.shape), res[2].reshape(v_pages.shape)
    return res[0]
