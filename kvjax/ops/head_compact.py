"""Eviction's compaction of per-head pages as one Pallas copy (Triton lowering): each surviving K and V row read once
and written once, in place, where ``head_paging.compact`` (its jnp reference) gathers every page of the heads,
sorts and scatters them all back (bench/results/eviction.md "Eviction: device cost": 4-13% of the copy floor).

A program per KV head (of every sequence and layer of one (K, V) width pair) walks the head's survivors in slot
order, ``chunk`` at a time: survivor i moves from its slot ``order[i]`` to slot i. Since ``order[i] >= i``, a later
chunk never reads a slot an earlier one wrote; inside a chunk one lane may read the slot another lane writes, so
every lane loads, the program waits at a barrier, then every lane stores. Heads own their pages, so programs never
touch each other's rows, and a survivor already in its place is neither read nor written. The pool is the call's
output aliased to its input: under ``jax.jit`` with the pool donated nothing is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops import head_paging
from kvjax.ops.paging import NULL_PAGE
from kvjax.ops.pallas_util import NOWHERE, whole_block
from kvjax.ops.tiles import tile

CHUNK = 64  # survivors a step of a program


def compact(
    pool,
    tables,
    keep,
    stored,
    layouts: tuple[HeadLayout, ...],
    page_elems: int,
    layers: tuple[int, ...] | None = None,
    *,
    interpret: bool = False,
    chunk: int = CHUNK,
    num_warps: int = 4,
):
    """``head_paging.compact``'s contract, moving only survivors: each head keeps, of its first ``stored`` [B, L,
    Hkv] slots, those ``keep`` [B, L, Hkv, S] marks, moved in their order to its first slots through ``tables`` [B,
    L, Hkv, pages]; ``layers``: only these layers' heads are read and moved. Returns (pool, kept [B, L, Hkv] int32).
    Slots past a head's kept count are left as they were (the reference leaves the evicted rows there); table
    entries past the pages a head's stored slots fill are never read or written."""
    pages = tables.shape[-1]
    kept, groups = head_paging.survivor_orders(keep, stored, layouts, page_elems, pages, layers)
    for (kw, vw), ls, hs, per, order in groups:
        pool = _move(
            kept[:, ls, hs].reshape(-1),
            tables[:, ls, hs].reshape(-1).astype(jnp.int32),
            order.astype(jnp.int32).reshape(-1),
            pool,
            kw=kw,
            vw=vw,
            per=per,
            pages=pages,
            chunk=chunk,
            num_warps=num_warps,
            interpret=interpret,
        )
    return pool, kept


@functools.partial(jax.jit, static_argnames=("kw", "vw", "per", "pages", "chunk", "num_warps", "interpret"))
def _move(kept, table, order, pool, *, kw, vw, per, pages, chunk, num_warps, interpret):
    """One width pair's heads: ``kept`` [heads], ``table`` [heads * pages], ``order`` [heads * pages * per] (each
    head's slots, survivors first), the pool [num_pages, page_elems] updated in place."""
    kernel = functools.partial(_kernel, kw=kw, vw=vw, per=per, pages=pages, chunk=chunk, interpret=interpret)
    args = (kept, table, order, pool)
    return pl.pallas_call(
        kernel,
        grid=(kept.shape[0],),
        in_specs=[whole_block(x) for x in args],
        out_specs=whole_block(pool),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kvjax_head_compact",
    )(*args)


def _kernel(kept_ref, table_ref, order_ref, pool_ref, out_ref, *, kw, vw, per, pages, chunk, interpret):
    """Program h: head h's survivors moved to its first slots, ``chunk`` a step (loads, barrier, stores)."""
    del pool_ref  # aliased: out_ref is the same buffer
    h = pl.program_id(0)
    n = kept_ref[h]
    parts = ((0, kw, jnp.arange(tile(kw))), (per * kw, vw, jnp.arange(tile(vw))))

    def where(slots, ok):  # (page, first element of each slot's row) of head h's slots; page 0 where not ok
        page = plgpu.load(table_ref.at[h * pages + slots // per], mask=ok, other=NULL_PAGE)
        return page[:, None], (slots % per)[:, None]

    def step(c, carry):
        dst = c * chunk + jnp.arange(chunk)
        live = dst < n
        src = plgpu.load(order_ref.at[h * pages * per + dst], mask=live, other=0)
        moves = live & (src != dst)  # a survivor already in its slot stays
        (src_page, src_row), (dst_page, dst_row) = where(src, moves), where(dst, moves)
        rows = []
        for first, width, cols in parts:
            ok = moves[:, None] & (cols[None, :] < width)
            index = first + src_row * width + cols[None, :]
            rows.append(plgpu.load(out_ref.at[jnp.broadcast_to(src_page, index.shape), index], mask=ok, other=0))
        if not interpret:  # (interpreted, the whole chunk's loads are values before any store runs)
            plgpu.debug_barrier()  # every lane has read before any lane writes: a lane may write what another reads
        for (first, width, cols), values in zip(parts, rows):
            ok = moves[:, None] & (cols[None, :] < width)
            index = first + dst_row * width + cols[None, :]
            page = jnp.broadcast_to(dst_page, index.shape)
            if interpret:  # interpret mode scatters every lane: masked ones must point past the pool
                page = jnp.where(ok, page, NOWHERE)
            plgpu.store(out_ref.at[page, index], values, mask=ok)
        return carry  # the next chunk reads slots past every slot this one wrote: no barrier needed

    lax.fori_loop(0, pl.cdiv(n, chunk), step, 0)
