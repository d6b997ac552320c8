"""Causal flash attention for a batch of prompts whose KV heads have their own K and V widths; writes K/V pages.

One program per work item (prompt, query head, block of query rows), items listed in a static int32 table built
at trace time. Balancing follows the papers: a head class of width ``k + v`` gets query blocks
``block_q * 256 / (K + V columns loaded)`` rows tall (capped), so every item does about the same work per key whatever
its width; items are then ordered longest first (causal blocks late in the prompt see more keys), so the hardware
scheduler packs the short ones into the tail. ``balanced=False`` is the ablation: ``block_q`` rows for every head,
natural (prompt, head, block) order. Heads sharing (K width, V width) share one code path chosen by ``lax.switch``.

When pages are given, the program that owns the first query head of a KV group also stores the diagonal K/V blocks
it has already loaded into the paged cache (``input_output_aliases``: in place when the caller donates the pages).

Lowering: Pallas's Triton backend, for the same reasons as ``decode.py`` (masked loads at 16-column offsets inside
packed rows, per-token page addresses for the cache write, CPU interpret mode for CI); Triton picks Hopper's wgmma
for the [block_q, width] x [width, block_k] dots itself.

A head whose width is not a power of two is read as exact power-of-two pieces (``max_segments``, via
``common.segments``: 80 = 64 + 16), one dot per piece, rather than through one padded tile: no multiply is spent
on padding, and the narrower loads let 128-key steps fit in shared memory (one padded 128-wide tile per class did
not: 272 KB asked for). ``keys_per_step`` halves the keys of classes too wide for that (full 128+128 heads).

Measured on the H100 (bench/RESULTS.md): 256-row blocks with 8 warps gave wrong results (relative error 5e-2 to
9e-2; right with 4 warps and in interpret mode), so blocks are capped at 128 rows by default; float32 tiles are
halved to fit shared memory. Steps left of the diagonal load without row masks (every key exists) and the
cache write happens only in the diagonal steps, where the item's own keys are. 128-key steps made the rate-0.5
layer 15% faster (0.356 -> 0.301 ms at 4K), but it still runs at about 0.9x of cuDNN on the uncompressed heads
(this kernel reaches 40% of the matmul rate where cuDNN reaches 67%): the next steps are one program per KV group
(its G query heads share each K/V tile) and Mosaic GPU's wgmma pipeline.
"""
from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.attention_reference import causal_attention
from kvjax.layout import HeadLayout
from kvjax.pallas.common import LOG2E, MASK, dot_precision, load_columns, lookup, offset16, width_classes
from kvjax.runs import loaded_columns, pow2_floor, segments


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


def work_items(layout: HeadLayout, batch: int, seq_len: int, block_q: int, balanced: bool,
               max_rows: int, max_segments: int) -> np.ndarray:
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
    items = np.asarray(items, np.int32)
    if balanced:
        items = items[np.argsort(-np.asarray(costs), kind="stable")]
    else:
        items = items[np.lexsort((items[:, 2], items[:, 1], items[:, 0]))]
    return items


def _attend_block(cls, item, refs, *, group, seq_len, page_size, window, scale, block_q, block_k, balanced,
                  max_rows, max_segments, num_stages, write_pages):
    """One item of a class (static widths): flash attention of its query rows, output store, cache write."""
    if write_pages:
        table_ref, q_ref, k_ref, v_ref, _, _, out_ref, kp_ref, vp_ref = refs
    else:
        table_ref, q_ref, k_ref, v_ref, out_ref = refs
    b, h, q0, length = item
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
    cols_of = lambda t: jnp.arange(t)[None, :]
    qs = [plgpu.load(q_ref.at[b, rows[:, None], qo + a + cols_of(t)], mask=row_ok & (cols_of(t) < w), other=0.0)
          for a, t, w in k_pieces]
    qs = [(q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype) for q in qs]  # scores come out in log2 units
    q_end = jnp.minimum(q0 + bq, length)  # keys past the last live query row are never needed
    writer = (gi == 0) & write_pages

    def body(j, carry, masked):
        accs, m, l = carry
        keys = j * bk + jnp.arange(bk)
        keys_ok = (keys < seq_len) if masked else None  # left of the diagonal every key exists: no row mask
        ks = [load_columns(k_ref, (b, keys[:, None]), ko + a, cols_of(t), w, keys_ok) for a, t, w in k_pieces]
        vs = [load_columns(v_ref, (b, keys[:, None]), vo + a, cols_of(t), w, keys_ok) for a, t, w in v_pieces]
        s = functools.reduce(operator.add, [plgpu.dot(q, k, trans_b=True, precision=precision)
                                            for q, k in zip(qs, ks)])
        if masked:
            ok = keys[None, :] <= rows[:, None]
            if window:
                ok &= rows[:, None] - keys[None, :] < window
            s = jnp.where(ok, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        pv = p.astype(k_ref.dtype)
        accs = tuple(acc * alpha[:, None] + plgpu.dot(pv, v, precision=precision) for acc, v in zip(accs, vs))
        if write_pages and masked:  # the item's own keys (>= q0) all lie in masked steps
            tok_ok = (keys >= q0) & (keys < length) & writer
            page = plgpu.load(table_ref.at[b, jnp.minimum(keys // page_size, table_ref.shape[1] - 1)], mask=tok_ok,
                              other=0)
            dest = jnp.where(tok_ok, page * page_size + keys % page_size, kp_ref.shape[0])[:, None]
            for ref, off, pieces, xs in ((kp_ref, ko, k_pieces, ks), (vp_ref, vo, v_pieces, vs)):
                for (a, t, w), x in zip(pieces, xs):
                    plgpu.store(ref.at[dest, off + a + cols_of(t)], x, mask=tok_ok[:, None] & (cols_of(t) < w))
        return accs, m_new, l * alpha + p.sum(axis=1)

    carry = (tuple(jnp.zeros((bq, t), jnp.float32) for _, t, _ in v_pieces), jnp.full((bq,), MASK, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    live = q0 < length
    diag_lo = q0 // bk
    if window:  # the window's lower edge cuts blocks too: mask them all
        first = jnp.maximum(q0 - window + 1, 0) // bk
        carry = lax.fori_loop(first, jnp.where(live, pl.cdiv(q_end, bk), first),
                              functools.partial(body, masked=True), carry)
    else:
        carry = lax.fori_loop(0, jnp.where(live, diag_lo, 0), functools.partial(body, masked=False), carry)
        carry = lax.fori_loop(diag_lo, jnp.where(live, pl.cdiv(q_end, bk), diag_lo),
                              functools.partial(body, masked=True), carry)
    accs, _, l = carry
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    for acc, (a, t, w) in zip(accs, v_pieces):
        o_mask = row_ok & (cols_of(t) < w)
        plgpu.store(out_ref.at[b, jnp.where(o_mask, rows[:, None], seq_len), oo + a + cols_of(t)],
                    (acc * inv_l[:, None]).astype(out_ref.dtype), mask=o_mask)


def _kernel(items_ref, lengths_ref, *refs, classes, class_of, group, **static):
    pid = pl.program_id(0)
    b, h = items_ref[pid, 0], items_ref[pid, 1]
    item = (b, h, items_ref[pid, 2], lengths_ref[b])
    branches = [functools.partial(_attend_block, cls, refs=refs, group=group, **static) for cls in classes]
    if len(branches) == 1:
        branches[0](item)
    else:
        cls_index = lookup(h // group, tuple(range(len(class_of))), class_of)
        lax.switch(cls_index, [lambda it, f=f: f(it) for f in branches], item)


@functools.partial(jax.jit, static_argnames=("layout", "balanced", "block_q", "block_k", "max_block_q", "max_segments",
                                             "num_warps", "num_stages", "interpret"))
def prefill_attention(q, k, v, layout: HeadLayout, lengths=None, k_pages=None, v_pages=None, block_table=None, *,
                      balanced: bool = True, block_q: int = 128, block_k: int = 128, max_block_q: int = 128,
                      max_segments: int = 3, num_warps: int = 8, num_stages: int = 3, interpret: bool = False):
    """Causal attention of T prompt tokens among themselves; same contract as ``causal_attention``.

    q [B, T, q_cols], k [B, T, k_cols], v [B, T, v_cols]; lengths [B] (default T): rows at positions >= length
    are unspecified. With k_pages/v_pages [num_pages, page_size, cols] and block_table [B, pages_per_seq], also
    writes K/V rows at positions < length into the pages and returns (out, k_pages, v_pages); else returns out.
    """
    b, t, _ = q.shape
    if jnp.dtype(q.dtype).itemsize == 4:  # float32 tiles: 128 rows x 3 stages asked for 384 KB of shared memory
        block_q, max_block_q, block_k = min(block_q, 64), min(max_block_q, 64), min(block_k, 32)
        num_stages = min(num_stages, 2)
    classes, class_of = width_classes(layout)
    items = jnp.asarray(work_items(layout, b, t, block_q, balanced, max_block_q, max_segments))
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    write = k_pages is not None
    page_size = k_pages.shape[1] if write else 1
    kernel = functools.partial(
        _kernel, classes=classes, class_of=class_of, group=layout.group_size, seq_len=t, page_size=page_size,
        window=layout.sliding_window, scale=1.0 / math.sqrt(layout.head_dim), block_q=block_q, block_k=block_k,
        balanced=balanced, max_rows=max_block_q, max_segments=max_segments, num_stages=num_stages, write_pages=write)
    out_shape = [jax.ShapeDtypeStruct((b, t, layout.out_cols), q.dtype)]
    args = [items, lengths, jnp.zeros((b, 1), jnp.int32) if block_table is None else block_table.astype(jnp.int32),
            q, k, v]
    aliases = {}
    if write:
        flat = [p.reshape(-1, p.shape[-1]) for p in (k_pages, v_pages)]
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat]
        args += flat
        aliases = {6: 1, 7: 2}
    res = pl.pallas_call(
        kernel, grid=(items.shape[0],), out_shape=out_shape, input_output_aliases=aliases, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="kvjax_prefill_attention",
    )(*args)
    if write:
        return res[0], res[1].reshape(k_pages.shape), res[2].reshape(v_pages.shape)
    return res[0]


def prefill_attention_reference(q, k, v, layout: HeadLayout):
    """The pure-jnp reference the kernel must match."""
    return causal_attention(q, k, v, layout)
