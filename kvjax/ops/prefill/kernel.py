"""The prefill op's run step (Pallas, Triton lowering): causal flash attention for a batch of prompts whose KV heads
have their own K and V widths, writing their K/V into the pages. ``prefill_attention`` equals
``reference.causal_attention`` and ``reference.chunk_attention``.

One program per work item (prompt, query head, block of query rows) of ``work.work_items``. Heads of one tile class
share a code path (``lax.switch``) and read their widths and offsets from the layer's head table at run time, so one
kernel serves every layer (bench/results/startup.md "Engine: compile times"). The cache write is in place when the
caller donates the pages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.grouped import visible
from kvjax.ops.pallas_util import LOG2E, MASK, NOWHERE, dot_precision, load_rows, page_rows, store_rows, whole_block
from kvjax.ops.prefill import work
from kvjax.ops.prefill.config import PREFILL, PrefillConfig


def _attend_block(
    cls,
    item,
    head,
    cols,
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
    num_stages,
    write_pages,
    prefix,
    interpret,
    heads=None,
):
    """One item of a class (static tiles; ``head``: its KV head's widths and offsets, ``cols``: its layer's row
    widths, both traced): flash attention of its query rows (``prefix``: after the keys before its chunk, read from
    the pages), output store, cache write; with ``heads`` (the layer's query heads), each row's log2 softmax
    denominator stored too, at (row, query head)."""
    lse_ref = None
    if heads is not None:
        *refs, lse_ref = refs
    if write_pages:
        table_ref, q_ref, k_ref, v_ref, kp_in, vp_in, out_ref, kp_ref, vp_ref = refs
    else:
        table_ref, q_ref, k_ref, v_ref, out_ref = refs
    b, h, q0, length, start = item
    qo, ko, vo, oo, kw, vw = head
    qc, kc, vc, oc = cols
    bq = work.block_rows(cls, block_q, seq_len, balanced, max_rows)
    bk = work.keys_per_step(block_k, bq, cls.cols, jnp.dtype(k_ref.dtype).itemsize, num_stages)
    precision = dot_precision(k_ref.dtype)
    gi = h % group
    k_cols, v_cols = jnp.arange(cls.k_tile)[None, :], jnp.arange(cls.v_tile)[None, :]
    k_ok = (k_cols < kw) if cls.k_masked else None
    v_ok = (v_cols < vw) if cls.v_masked else None

    rows = q0 + jnp.arange(bq)
    row_ok = rows < seq_len
    q = load_rows(q_ref, b * seq_len + rows, qc, qo + gi * kw, k_cols, k_ok, row_ok)
    q = (q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype)  # scores come out in log2 units
    q_end = jnp.minimum(q0 + bq, length)  # keys past the last live query row are never needed
    writer = (gi == 0) & write_pages

    def scores(k):
        return plgpu.dot(q, k, trans_b=True, precision=precision)

    def prefix_body(j, carry):  # keys before the chunk, read from the pages at absolute positions
        keys = j * bk + jnp.arange(bk)
        ok = keys < start
        src = page_rows(table_ref, b, keys, page_size, ok)
        k = load_rows(kp_in, src, kc, ko, k_cols, k_ok, ok)
        v = load_rows(vp_in, src, vc, vo, v_cols, v_ok, ok)
        seen = ok[None, :] & visible(start + rows[:, None], keys[None, :], window)
        return _softmax_step(carry, jnp.where(seen, scores(k), MASK), v, precision)

    def body(j, carry, masked):
        keys = j * bk + jnp.arange(bk)
        keys_ok = (keys < seq_len) if masked else None  # left of the diagonal every key exists: no row mask
        k = load_rows(k_ref, b * seq_len + keys, kc, ko, k_cols, k_ok, keys_ok)
        v = load_rows(v_ref, b * seq_len + keys, vc, vo, v_cols, v_ok, keys_ok)
        s = scores(k)
        if masked:
            s = jnp.where(visible(rows[:, None], keys[None, :], window), s, MASK)
        if write_pages and masked:  # the item's own keys (>= q0) all lie in masked steps
            tok_ok = (keys >= q0) & (keys < length) & writer
            dest = page_rows(table_ref, b, start + keys, page_size, tok_ok)
            store_rows(kp_ref, dest, kc, ko, k_cols, k, k_ok, tok_ok, interpret=interpret)
            store_rows(vp_ref, dest, vc, vo, v_cols, v, v_ok, tok_ok, interpret=interpret)
        return _softmax_step(carry, s, v, precision)

    carry = (
        jnp.zeros((bq, cls.v_tile), jnp.float32),
        jnp.full((bq,), MASK, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    if prefix:
        carry = _prefix_steps(prefix_body, carry, q0 < length, start + q0, start, bk, window)
    acc, m, l = _key_steps(body, carry, q0 < length, q0, q_end, bk, window)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    out = (acc * inv_l[:, None]).astype(out_ref.dtype)
    store_rows(out_ref, b * seq_len + rows, oc, oo + gi * vw, v_cols, out, v_ok, row_ok, interpret=interpret)
    if lse_ref is not None:  # the denominator in log2 units, as ``ops.attention_mass`` uses it
        index = (b * seq_len + rows) * heads + h
        index = jnp.where(row_ok, index, NOWHERE) if interpret else index
        plgpu.store(lse_ref.at[index], m + jnp.log2(jnp.where(l > 0, l, 1.0)), mask=row_ok)


def _softmax_step(carry, s, v, precision):
    """One online-softmax step: scores ``s`` [rows, keys] (log2 units) against the value tile ``v``."""
    acc, m, l = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l * alpha + p.sum(axis=1)


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


def _kernel(items_ref, lengths_ref, starts_ref, heads_ref, cols_ref, *refs, classes, group, **static):
    pid = pl.program_id(0)
    b, h = items_ref[pid, 0], items_ref[pid, 1]
    item = (b, h, items_ref[pid, 2], lengths_ref[b], starts_ref[b])
    kv = h // group
    head = columns.read_head(heads_ref, kv)
    cols = columns.read_widths(cols_ref)
    branches = [functools.partial(_attend_block, cls, refs=refs, group=group, **static) for cls in classes]
    if len(branches) == 1:
        branches[0](item, head, cols)
    else:
        lax.switch(heads_ref[kv, work.CLASS], [lambda *a, f=f: f(*a) for f in branches], item, head, cols)


@functools.partial(jax.jit, static_argnames=("layout", "config", "interpret", "shared", "lse"))
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
    shared: tuple[HeadLayout, ...] | None = None,
    lse: bool = False,
):
    """Causal attention of chunks of T prompt tokens; equal to ``reference.causal_attention`` (``starts`` None) and
    ``reference.chunk_attention``.

    q [B, T, q_cols], k [B, T, k_cols], v [B, T, v_cols]; lengths [B] (default T): rows at positions >= length
    are unspecified. With k_pages/v_pages [num_pages, page_size, cols] and block_table [B, pages_per_seq], also
    writes K/V rows at positions < length into the pages and returns (out, k_pages, v_pages); else returns out.
    ``starts`` [B] (pages only; default 0): chunk b holds positions ``starts[b]`` on, and its queries also attend
    to the ``starts[b]`` keys before it, read from the pages (chunked prefill). ``shared``: the layouts of every
    layer that runs this kernel (default: ``layout`` alone); the kernel's code and grid depend on them, not on
    ``layout``, so XLA compiles one kernel for all of them. ``lse``: also (last) float32 [B, T, num_heads], each
    row's log2 softmax denominator (scores in log2 units, q·k / sqrt(head_dim) times log2 e; rows past ``lengths``
    unspecified): the first pass of ``ops.attention_mass``, which then need not run it.
    """
    b, t, _ = q.shape
    config = config.for_dtype(q.dtype)
    shared = shared or (layout,)
    if layout not in shared:
        raise ValueError("layout must be one of the shared layouts")
    widths = config.tile_widths
    classes = work.tile_classes(shared, widths)
    sizes = (b, t, config.block_q, config.balanced, config.max_block_q)
    count = max(work.num_items(lay, classes, widths, *sizes) for lay in set(shared))
    items = work.work_items(layout, classes, work.class_of(layout, classes, widths), *sizes, count=count)
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    write = k_pages is not None
    prefix = starts is not None
    if prefix and not write:
        raise ValueError("chunks that start past position 0 read their earlier keys from the pages: pass them")
    starts = starts.astype(jnp.int32) if prefix else jnp.zeros((b,), jnp.int32)
    kernel = functools.partial(
        _kernel,
        classes=classes,
        group=layout.group_size,
        seq_len=t,
        page_size=k_pages.shape[1] if write else 1,
        window=layout.sliding_window,
        scale=1.0 / math.sqrt(layout.head_dim),
        block_q=config.block_q,
        block_k=config.block_k,
        balanced=config.balanced,
        max_rows=config.max_block_q,
        num_stages=config.num_stages,
        write_pages=write,
        prefix=prefix,
        interpret=interpret,
        heads=layout.num_heads if lse else None,
    )
    out_shape = [jax.ShapeDtypeStruct((b * t * layout.out_cols,), q.dtype)]
    args = [
        jnp.asarray(items),
        lengths,
        starts,
        jnp.asarray(work.head_table(layout, classes, widths)),
        jnp.asarray(columns.row_widths(layout)),
        jnp.zeros((b, 1), jnp.int32) if block_table is None else block_table.astype(jnp.int32),
        q.reshape(-1),
        k.reshape(-1),
        v.reshape(-1),
    ]
    aliases = {}
    if write:
        flat = [p.reshape(-1) for p in (k_pages, v_pages)]
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat]
        args += flat
        aliases = {9: 1, 10: 2}
    if lse:
        out_shape.append(jax.ShapeDtypeStruct((b * t * layout.num_heads,), jnp.float32))
    res = pl.pallas_call(
        kernel,
        grid=(items.shape[0],),
        in_specs=[whole_block(x) for x in args],
        out_specs=[whole_block(x) for x in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="kvjax_prefill_attention",
    )(*args)
    out = res[0].reshape(b, t, layout.out_cols)
    extra = (res[-1].reshape(b, t, layout.num_heads),) if lse else ()
    if write:
        return out, res[1].reshape(k_pages.shape), res[2].reshape(v_pages.shape), *extra
    return (out, *extra) if lse else out
