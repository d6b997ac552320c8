"""Quantized paged K/V as the ops see them: full pages in a layer's uint8 pool (``quant.PageFormat``, or
``gear.GearPageFormat``: any format with its ``encode`` and ``decode``), the newest tokens of each sequence in a tail
page of the cache's dtype until their page is full (KIVI's residual window, its length the page), and the jnp
reference of both.

A layer's state is ``pages`` [num_pages, page_bytes] uint8 and ``tail`` [slots, page_size, k_cols + v_cols]: row s
of the tail holds the K then V columns of the last, partial page of the sequence in slot s. A sequence of ``n``
cached tokens keeps its first ``n // page_size`` pages quantized and the remaining ``n % page_size`` tokens in its
tail; a page is quantized once, whole, when its last token arrives, so every write to the pool is one scatter of
whole pages. The tail is addressed by slot, not by page, so it costs ``slots`` pages of the cache's dtype a layer
whatever the pool's size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.ops.kv_schemes import AnyPageFormat
from kvjax.ops.paging import NULL_PAGE


def create_tail(fmt: AnyPageFormat, slots: int, dtype) -> jax.Array:
    """An empty tail for ``slots`` sequences (zeros: never read before written)."""
    return jnp.zeros((slots, fmt.page_size, fmt.k_cols + fmt.v_cols), dtype)


def _encode(fmt: AnyPageFormat, kv):
    """Pages of K then V columns [M, P, k_cols + v_cols] as ``fmt``'s bytes [M, page_bytes]."""
    return fmt.encode(*_split(kv, fmt))


def _scatter_pages(pages, targets, encoded):
    """Write encoded pages [M, page_bytes] to pool pages ``targets`` [M] (the null page or a negative target:
    dropped); ``targets`` are distinct, each page owned by one sequence."""
    num_pages = pages.shape[0]
    targets = jnp.where((targets > NULL_PAGE) & (targets < num_pages), targets, num_pages)
    return pages.at[targets].set(encoded, mode="drop", unique_indices=True)


def fill_budget(rows: int, page_size: int) -> int:
    """Rows a decode step quantizes on its cheap path: twice the rows that fill a page a step on average when the
    rows' lengths are spread (``rows / page_size``), at least one."""
    return max(1, 2 * -(-rows // page_size))


def write_decode(pages, tail, fmt: AnyPageFormat, block_table, lengths, k, v, active):
    """One new token per slot row: K [B, k_cols] and V [B, v_cols] at position ``lengths - 1`` of active rows go to
    their tail; a row whose page that token fills has the page quantized into the pool. Row i is slot i (the decode
    step's rows). Returns (pages, tail).

    A page fills in one step of ``page_size``, so a step quantizes only its filling rows, compacted to
    ``fill_budget`` rows (a fraction of the batch); a step where more fill at once (equal lengths) quantizes every
    row. Either way one scatter of whole pages writes the pool."""
    b, p = k.shape[0], fmt.page_size
    if b != tail.shape[0]:
        raise ValueError(f"a decode step has a row per slot: {b} rows for a tail of {tail.shape[0]} slots")
    pos = lengths - 1
    rows = jnp.where(active, jnp.arange(b), b)
    tail = tail.at[rows, pos % p].set(jnp.concatenate([k, v], -1).astype(tail.dtype), mode="drop")
    target = jnp.take_along_axis(block_table, (pos // p)[:, None], axis=1, mode="clip")[:, 0]
    filling = active & (lengths % p == 0)
    target = jnp.where(filling, target, -1)
    budget = fill_budget(b, p)
    every = functools.partial(_encode, fmt)
    if budget >= b:
        return _scatter_pages(pages, target, every(tail)), tail

    def few(tail):
        picked = jnp.nonzero(filling, size=budget, fill_value=b)[0]
        encoded = _encode(fmt, tail[jnp.minimum(picked, b - 1)])
        return jnp.zeros((b, fmt.page_bytes), jnp.uint8).at[picked].set(encoded, mode="drop")

    # the branches see the tail alone (a page a slot), never the pool: the pool is written once, below, in place
    encoded = jax.lax.cond(jnp.sum(filling) <= budget, few, every, tail)
    return _scatter_pages(pages, target, encoded), tail


def write_prefill(pages, tail, fmt: AnyPageFormat, block_table, tail_rows, starts, k, v, lengths):
    """Prompt chunks K [B, T, k_cols], V [B, T, v_cols] (chunk b: ``lengths[b]`` tokens from position
    ``starts[b]``, default 0) continue their sequences' tails (row ``tail_rows[b]``; past the tail: a padding row,
    nothing written): each page the chunk completes is quantized into the pool, the rest becomes the new tail.
    Returns (pages, tail)."""
    b, t = k.shape[:2]
    p = fmt.page_size
    starts = jnp.zeros((b,), jnp.int32) if starts is None else starts
    r = starts % p  # tokens of the tail page already in the tail
    span = -(-(p + t) // p) * p
    i = jnp.arange(span)[None, :]
    old = tail[jnp.clip(tail_rows, 0, tail.shape[0] - 1)]  # [B, P, cols]
    new = jnp.concatenate([k, v], -1).astype(tail.dtype)
    from_chunk = jnp.take_along_axis(new, jnp.clip(i - r[:, None], 0, t - 1)[..., None], axis=1)
    from_tail = jnp.take_along_axis(old, jnp.clip(i, 0, p - 1)[..., None], axis=1)
    buf = jnp.where((i < r[:, None])[..., None], from_tail, from_chunk)  # positions starts - r ... in order
    nb = span // p
    buf = buf.reshape(b, nb, p, -1)
    j = jnp.arange(nb)[None, :]
    full = (j + 1) * p <= (r + lengths)[:, None]
    logical = (starts // p)[:, None] + j
    target = jnp.take_along_axis(block_table, logical, axis=1, mode="clip")
    target = jnp.where(full & (tail_rows < tail.shape[0])[:, None], target, -1)
    pages = _scatter_pages(pages, target.reshape(-1), _encode(fmt, buf.reshape(b * nb, p, -1)))
    last = jnp.take_along_axis(buf, ((r + lengths) // p)[:, None, None, None], axis=1)[:, 0]
    tail = tail.at[tail_rows].set(last, mode="drop")
    return pages, tail


def gather(pages, tail, fmt: AnyPageFormat, block_table, tail_rows, lengths, dtype):
    """Each row's cached K [B, S, k_cols] and V [B, S, v_cols] (S: the block table's positions) as attention reads
    them: the first ``lengths // page_size`` pages dequantized, then the tail's ``lengths % page_size`` tokens
    exact; positions past ``lengths`` are unspecified."""
    b, n = block_table.shape
    p = fmt.page_size
    k, v = fmt.decode(pages[block_table], dtype)  # [B, n, P, cols]
    k, v = k.reshape(b, n * p, -1), v.reshape(b, n * p, -1)
    rows = tail[jnp.clip(tail_rows, 0, tail.shape[0] - 1)].astype(dtype)  # [B, P, cols]
    pos = jnp.arange(n * p)[None, :]
    in_tail = (pos >= (lengths // p * p)[:, None])[..., None]
    from_tail = jnp.take_along_axis(rows, (pos % p)[..., None], axis=1)
    tk, tv = from_tail[..., : fmt.k_cols], from_tail[..., fmt.k_cols :]
    return jnp.where(in_tail, tk, k), jnp.where(in_tail, tv, v)


def _split(kv, fmt: AnyPageFormat):
    return kv[..., : fmt.k_cols], kv[..., fmt.k_cols :]
