"""The engine's one attention entry point: write the new K/V into the pages, then run the op's kernel or, without
one (the "reference" backend), the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops import head_paging, quant_head_paging, quant_paging
from kvjax.ops.decode.head_kernel import head_paged_decode
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.quant_head_kernel import quant_head_decode
from kvjax.ops.decode.reference import paged_decode_attention, quantized_decode_attention
from kvjax.ops.grouped import attend_groups, full_width, visible
from kvjax.ops.paging import write_pages
from kvjax.ops.palu import PaluDecodeOp
from kvjax.ops.prefill.op import PrefillOp
from kvjax.ops.prefill.reference import causal_attention, chunk_attention

BACKENDS = ("reference", "pallas", "interpret")


def default_backend() -> str:
    """The Pallas kernels on a GPU, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_backend(backend: str) -> str:
    """``backend`` if it is one of ``BACKENDS``, else a ValueError naming them."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def prefill(
    q,
    k,
    v,
    layout: HeadLayout,
    k_pages,
    v_pages,
    block_table,
    lengths,
    starts=None,
    *,
    op: PrefillOp | None = None,
    rebuild=None,
    rotation=None,
    lse: bool = False,
):
    """Attention of prompt chunks [B, T, cols] (chunk b at positions ``starts[b]`` on, default 0) over themselves and
    the earlier chunks in the pages, their K/V written into the pages; returns (out, k_pages, v_pages). ``rebuild``
    (Palu layers, ``models.latent.LatentK``) rebuilds full K from the cached latent; with an op, the prefill kernel
    runs at full width over the rebuilt K. ``rotation`` (ZACK layers, with q and k per head): packs them first.
    ``lse``: a fourth result, each row's log2 softmax denominator [B, T, num_heads] where the prefill kernel runs on
    the cached keys (``prefill_attention(lse=True)``, which the full-history eviction sums reuse), else None."""
    if rotation is not None:
        q, k = rotation.packed(q, k)
    if op is not None and rebuild is None:
        return op.run(q, k, v, layout, lengths, k_pages, v_pages, block_table, starts, lse=lse)
    if lse:
        return (*prefill(q, k, v, layout, k_pages, v_pages, block_table, lengths, starts, op=op, rebuild=rebuild), None)
    b, t = q.shape[:2]
    offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = offsets if starts is None else starts[:, None] + offsets
    valid = offsets < lengths[:, None]
    k_pages = write_pages(k_pages, block_table, positions, k, valid)
    v_pages = write_pages(v_pages, block_table, positions, v, valid)
    if op is not None:
        out = _rebuilt_prefill(q, k, v, positions, layout, k_pages, v_pages, block_table, lengths, starts, op, rebuild)
        return out, k_pages, v_pages
    if starts is None:
        return causal_attention(q, k, v, layout, rebuild), k_pages, v_pages
    return chunk_attention(q, layout, k_pages, v_pages, block_table, starts, rebuild), k_pages, v_pages


def _rebuilt_prefill(q, k, v, positions, layout, k_pages, v_pages, block_table, lengths, starts, op, rebuild):
    """Palu's prefill as its authors run it: the chunk's (latent ``k`` at ``positions``) and its prefix's K rebuilt
    to full heads, then the prefill kernel at full K width, over scratch pages (the cache keeps the latent, already
    written)."""
    full, prefix = full_width(layout), None
    if starts is not None:
        b, span = block_table.shape[0], block_table.shape[1] * k_pages.shape[1]
        latent = k_pages[block_table].reshape(b, span, layout.k_cols)
        k_seq = rebuild(latent, jnp.broadcast_to(jnp.arange(span, dtype=jnp.int32), (b, span)))
        prefix = (k_seq, v_pages[block_table].reshape(b, span, layout.v_cols))
    k_full = rebuild(k, positions)
    return _over_scratch(op, q, k_full, v, full, lengths, starts, k_pages.shape[1], k_pages.dtype, prefix)


def _over_scratch(op, q, k, v, layout, lengths, starts, page_size: int, dtype, prefix=None):
    """The prefill kernel over scratch pages, for caches it cannot read in place (Palu's latent K, quantized pages):
    ``prefix`` (k_seq, v_seq) [B, n * page_size, cols], the rows' prefixes in full, become pages 1.. in row order
    (page 0 stays the null page); with no prefix (``starts`` None) the kernel gets empty pages for the chunk alone."""
    b, t = q.shape[:2]
    if prefix is None:
        n = -(-t // page_size)
        k_scratch = jnp.zeros((b * n + 1, page_size, layout.k_cols), dtype)
        v_scratch = jnp.zeros((b * n + 1, page_size, layout.v_cols), dtype)
    else:
        n = prefix[0].shape[1] // page_size
        k_scratch = _after_null_page(prefix[0].reshape(b * n, page_size, layout.k_cols))
        v_scratch = _after_null_page(prefix[1].reshape(b * n, page_size, layout.v_cols))
    table = 1 + jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    out, _, _ = op.run(q, k, v, layout, lengths, k_scratch, v_scratch, table, starts)
    return out


def _after_null_page(pages):
    return jnp.concatenate([jnp.zeros_like(pages[:1]), pages])


def decode(
    q,
    k,
    v,
    layout: HeadLayout,
    k_pages,
    v_pages,
    block_table,
    lengths,
    *,
    op: DecodeOp | PaluDecodeOp | None = None,
    schedule=None,
    rebuild=None,
    rotation=None,
    active=None,
):
    """One new token per sequence: its K/V [B, cols] written at position ``lengths - 1``, then its query [B, q_cols]
    against the whole paged cache; returns (out, k_pages, v_pages). ``schedule``: this layer's (``op.schedule``).
    ``rotation`` (ZACK layers, with q and k per head): the kernel takes the wide q (one GEMM), the reference the
    packed one. ``rebuild`` (Palu, banded ZACK: ``models.latent.LatentK``): Palu's kernel rebuilds each key from it,
    a banded ``DecodeOp`` projects the queries once a band with it. ``active`` [B] (optional): rows that are not
    are padding; Palu's kernel then reads them as empty, so they take no share of its splits (their output is
    unspecified)."""
    if rotation is not None:
        q, k = rotation.wide(q, k) if op is not None else rotation.packed(q, k)
    positions, valid = (lengths - 1)[:, None], jnp.ones((q.shape[0], 1), bool)
    k_pages = write_pages(k_pages, block_table, positions, k[:, None], valid)
    v_pages = write_pages(v_pages, block_table, positions, v[:, None], valid)
    if op is None:
        return paged_decode_attention(q, k_pages, v_pages, block_table, lengths, layout, rebuild), k_pages, v_pages
    if isinstance(op, PaluDecodeOp):
        live = lengths if active is None else jnp.where(active, lengths, 0)
        return op.run(q, k_pages, v_pages, block_table, live, rebuild, layout), k_pages, v_pages
    return op.run(q, k_pages, v_pages, block_table, lengths, schedule, layout, rebuild), k_pages, v_pages


def prefill_quantized(
    q,
    k,
    v,
    layout: HeadLayout,
    pages,
    tail,
    fmt,
    block_table,
    tail_rows,
    lengths,
    starts=None,
    *,
    op=None,
    rotation=None,
):
    """``prefill`` over a quantized layer (``quant_paging``): the chunk attends to its prefix as the cache holds it
    (full pages dequantized, the tail exact) and to its own K/V exact, then its K/V continue the tail and every page
    they complete is quantized into the pool. With an op, the prefill kernel runs over scratch pages of the rows'
    dequantized prefix (bounded by the call's rows; a kernel that reads quantized pages would need none). Returns
    (out, pages, tail)."""
    if rotation is not None:
        q, k = rotation.packed(q, k)
    prefix = None
    if starts is not None:
        prefix = quant_paging.gather(pages, tail, fmt, block_table, tail_rows, starts, q.dtype)
    if op is not None:
        out = _over_scratch(op, q, k, v, layout, lengths, starts, fmt.page_size, q.dtype, prefix)
    elif prefix is None:
        out = causal_attention(q, k, v, layout)
    else:
        k_seq, v_seq = prefix
        out = _over_prefix(q, k, v, k_seq, v_seq, starts, lengths, layout)
    pages, tail = quant_paging.write_prefill(pages, tail, fmt, block_table, tail_rows, starts, k, v, lengths)
    return out, pages, tail


def _over_prefix(q, k, v, k_seq, v_seq, starts, lengths, layout: HeadLayout):
    """Chunks q/k/v [B, T, cols] from positions ``starts`` attending causally over their prefix k_seq/v_seq
    [B, S, cols] (positions < starts) and themselves."""
    b, t = q.shape[:2]
    span = k_seq.shape[1]
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_pos = starts[:, None] + offsets
    at = jnp.where(offsets < lengths[:, None], q_pos, span)  # padding rows write nowhere
    rows = jnp.arange(b)[:, None]
    k_seq = k_seq.at[rows, at].set(k.astype(k_seq.dtype), mode="drop")
    v_seq = v_seq.at[rows, at].set(v.astype(v_seq.dtype), mode="drop")
    k_pos = jnp.arange(span, dtype=jnp.int32)[None, None, :]
    mask = visible(q_pos[:, :, None], k_pos, layout.sliding_window)
    return attend_groups(q, k_seq, v_seq, mask, layout)


def decode_quantized(
    q,
    k,
    v,
    layout: HeadLayout,
    pages,
    tail,
    fmt,
    block_table,
    lengths,
    active,
    *,
    op=None,
    schedule=None,
    rotation=None,
):
    """``decode`` over a quantized layer: the new token goes to its slot's tail (row i is slot i; inactive rows write
    nothing), its page quantized into the pool once full, then the query attends to the full pages and the tail in
    one pass (``op``: a fused kernel, ``quant_kernel``'s or for GEAR pages ``gear_kernel``'s; without one the jnp
    reference). Returns (out, pages, tail)."""
    if rotation is not None:
        q, k = rotation.wide(q, k) if op is not None and op.wide_queries else rotation.packed(q, k)
    pages, tail = quant_paging.write_decode(pages, tail, fmt, block_table, lengths, k, v, active)
    if op is None:
        return quantized_decode_attention(q, pages, tail, fmt, block_table, lengths, layout), pages, tail
    return op.run(q, pages, tail, block_table, lengths, schedule, layout), pages, tail


def _window_first(layout: HeadLayout, before, after):
    """Each head's first slot its window sees after this step's token (``head_paging.window_first``), or None for a
    layer without ``before``."""
    if before is None:
        return None
    if layout.sliding_window is None:
        raise ValueError("before (where a window starts) is for sliding-window layers only")
    return head_paging.window_first(before, after, layout.sliding_window)


def decode_quant_heads(
    q,
    k,
    v,
    layout: HeadLayout,
    pool,
    tail,
    tables,
    stored,
    page_bytes: int,
    group: int,
    bits: int,
    tokens: int,
    *,
    backend="reference",
    rotation=None,
    active=None,
    work=None,
    before=None,
    pairs=(),
    launches="k-class",
):
    """``decode_heads`` over quantized per-head pages (``ops.quant_head_paging``: eviction with ``kv_bits``): the new
    token to each head's next slot, its group quantized into its page when that slot completes it (jnp), then the
    query against each head's stored slots: ``quant_head_paging.decode_attention`` over ``tokens`` slots at most
    (static) on the "reference" backend, ``ops.decode.quant_head_kernel`` on "pallas" and "interpret" (``work``: the
    step's ``live_work`` lists by head count, ``quant_head_kernel.launch_heads``; ``pairs``: the width pairs naming
    the kernel's classes, default the layer's own; ``launches``: its launch form). Returns (out [B, out_cols], pool,
    tail, stored after, q packed [B, q_cols])."""
    check_backend(backend)
    if rotation is not None:
        q, k = rotation.packed_rows(q, k)
    live = jnp.ones((q.shape[0],), bool) if active is None else active
    pool, tail = quant_head_paging.write_decode(pool, tail, tables, stored, k, v, live, layout, page_bytes, group, bits)
    after = stored + live[:, None].astype(stored.dtype)
    first = _window_first(layout, before, after)
    if backend == "reference":
        out = quant_head_paging.decode_attention(
            q, pool, tail, tables, after, layout, page_bytes, group, bits, tokens, first
        )
    else:
        out = quant_head_decode(
            q, pool, tail, tables, after, layout, page_bytes, group, bits, first=first, work=work,
            pairs=tuple(pairs) or None, launches=launches, interpret=backend == "interpret",
        )  # fmt: skip
    return out, pool, tail, after, q


def decode_heads(
    q,
    k,
    v,
    layout: HeadLayout,
    pool,
    tables,
    stored,
    page_elems: int,
    *,
    backend="reference",
    rotation=None,
    active=None,
    schedule="slots",
    work=None,
    before=None,
    weights: bool = False,
    slots: int | None = None,
    sums=None,
    square: bool = False,
):
    """One new token per sequence over per-head pages (``ops.head_paging``, eviction's cache): its K/V [B, cols]
    written at each KV head's next slot, ``stored`` [B, Hkv] (a head's count before it), through this layer's
    ``tables`` [B, Hkv, pages] (the pages for that slot already given), then its query against each head's own
    tokens, the new one included. Returns (out [B, out_cols], pool, stored after, q packed [B, q_cols]: what
    continual eviction scores with). ``backend``: "reference" (jnp),
    "pallas" or "interpret" (``ops.decode.head_kernel``). ``rotation`` (ZACK layers): q and k packed first.
    ``active`` [B] (optional): rows that are not write nothing and keep their counts (their output is unspecified).
    ``schedule``, ``work``: the kernel's (``head_paged_decode``; the engine builds ``work`` once a step). ``before``
    [B, Hkv, >= W + 1] (``head_paging.window_before``'s rows of this layer): where a sliding window starts in each
    head's slots, for a layer whose window can pass a stored token (None: it cannot). The engine's decode step calls
    it once a layer, the pool (every layer's pages) threaded through. ``weights``: a fifth result, float32 [B, Hkv, G,
    slots], each query row's softmax weight on each slot of its head (``head_paging.decode_weights``; on the kernels
    out of the decode kernel's own scores): the step's share of the full-history eviction sums; ``slots``: the
    most tokens a head stores (default: what its table addresses), the weights' last axis. ``sums`` (float32 [B, Hkv,
    slots], instead of ``weights``): the fifth result is ``sums`` with each active row's weights added, summed over
    its group and squared first where ``square`` (on the kernels ``sums_kernel.add_weights``, the weights never
    written whole): the engine's full-history sums a step."""
    check_backend(backend)
    if rotation is not None:
        q, k = rotation.packed_rows(q, k)
    b = q.shape[0]
    live = jnp.ones((b,), bool) if active is None else active
    pool = head_paging.write(pool, tables, stored[..., None], k[:, None], v[:, None], live[:, None], layout, page_elems)
    after = stored + live[:, None].astype(stored.dtype)
    first = _window_first(layout, before, after)
    if sums is not None:
        if weights:
            raise ValueError("give weights=True or sums, not both")
        slots = sums.shape[-1]
    if backend == "reference":
        most = int(head_paging.layer_tokens_per_page(layout, page_elems).max()) * tables.shape[-1]
        most = most if slots is None else min(most, slots)
        wanted = weights or sums is not None
        got = head_paging.decode_attention(q, pool, tables, after, layout, page_elems, most, first, weights=wanted)
        if sums is not None:
            w = got[1].astype(jnp.float32)
            added = jnp.where(live[:, None, None], (w * w if square else w).sum(axis=2), 0.0)
            # padded and added whole: a scatter-add into the sums crashed XLA's CPU compiler under shard_map
            added = jnp.pad(added, ((0, 0), (0, 0), (0, sums.shape[-1] - added.shape[-1])))
            got = (got[0], sums + added)
    else:
        got = head_paged_decode(
            q,
            pool,
            tables,
            after,
            layout,
            page_elems,
            first=first,
            schedule=schedule,
            work=work,
            weights=weights,
            slots=None if sums is not None else slots,
            sums=sums,
            square=square,
            active=active,
            interpret=backend == "interpret",
        )
    return (got[0], pool, after, q, got[1]) if weights or sums is not None else (got, pool, after, q)
