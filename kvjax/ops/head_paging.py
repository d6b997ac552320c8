"""Per-head pages as the ops see them (issue 37, item 2): one pool of fixed-size pages, [num_pages, page_elems], any
page serving any (layer, KV head); head h of a layer stores ``tokens_per_page`` of its tokens a page, its K rows
first ([tokens, k_width]) and then its V rows ([tokens, v_width]), so a kernel loads each as one 2-D block.

A head's block table maps its slots (its stored tokens in order, ``runtime.head_pages``) to pages: slot ``i`` is row
``i % per`` of page ``table[i // per]``. The host side that hands out pages, and the compaction moves after
eviction, are ``kvjax.runtime.head_pages``; this module writes, reads, attends and moves on the device, in jnp:
the reference a per-head kernel is checked against. Page 0 is the null page: nothing valid is written there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.paging import NULL_PAGE


def tokens_per_page(page_elems: int, k_width: int, v_width: int) -> int:
    """How many of a head's tokens (K and V rows of these widths) one page holds."""
    per = page_elems // (k_width + v_width)
    if per < 1:
        raise ValueError(f"a page of {page_elems} elements holds no token of widths {k_width} + {v_width}")
    return per


def layer_tokens_per_page(layout: HeadLayout, page_elems: int) -> np.ndarray:
    """int64 [Hkv]: ``tokens_per_page`` of each KV head of a layer."""
    return np.array([tokens_per_page(page_elems, k, v) for k, v in zip(layout.k_widths, layout.v_widths)])


def _rows(table, slots, per: int, width: int, first: int):
    """Where row ``slots`` (a head's slots, any shape) of ``table`` [..., pages] (same leading shape) lie, the head's
    rows starting ``first`` elements into a page: (page [...], element in the page [..., width]). Indexing the pool
    by (page, element) keeps every index small: a pool past 2**31 elements (a 17 GB bf16 pool) overflows a flat
    int32 index."""
    page = jnp.take_along_axis(table, (slots // per).reshape(table.shape[0], -1), axis=1, mode="clip")
    page = page.reshape(slots.shape)
    start = first + (slots % per) * width
    return page, start[..., None] + jnp.arange(width)


def write(pool, table, slots, k, v, valid, layout: HeadLayout, page_elems: int):
    """Store new tokens of one layer: ``k`` [B, T, k_cols] and ``v`` [B, T, v_cols] (packed heads) at each head's
    ``slots`` [B, Hkv, T] through ``table`` [B, Hkv, pages]; rows not ``valid`` ([B, T], or [B, Hkv, T] per head),
    or bound for the null page, are dropped. Returns the pool."""
    k_offsets, v_offsets = HeadLayout.offsets(layout.k_widths), HeadLayout.offsets(layout.v_widths)
    pages, indices, values = [], [], []  # every head's K and V rows, flattened: one scatter a layer
    for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
        per = tokens_per_page(page_elems, kw, vw)
        for part, width, first, offset in ((k, kw, 0, k_offsets[h]), (v, vw, per * kw, v_offsets[h])):
            page, index = _rows(table[:, h], slots[:, h], per, width, first)
            keep = (valid[:, h] if valid.ndim == 3 else valid) & (page != NULL_PAGE)
            page = jnp.where(keep, page, pool.shape[0])[..., None]  # past the pool: dropped
            pages.append(jnp.broadcast_to(page, index.shape).reshape(-1))
            indices.append(index.reshape(-1))
            values.append(part[..., offset : offset + width].astype(pool.dtype).reshape(-1))
    page, index, value = (jnp.concatenate(x) for x in (pages, indices, values))
    pool = pool.at[page, index].set(value, mode="drop", unique_indices=True)
    return pool


def read(pool, table, h: int, layout: HeadLayout, page_elems: int, tokens: int):
    """Head ``h``'s first ``tokens`` slots through ``table`` [B, Hkv, pages]: (K [B, tokens, k_width], V [B, tokens,
    v_width]); slots past what a head stores read whatever their pages hold (mask them)."""
    kw, vw = layout.k_widths[h], layout.v_widths[h]
    per = tokens_per_page(page_elems, kw, vw)
    slots = jnp.broadcast_to(jnp.arange(tokens), (table.shape[0], tokens))
    k_page, k_index = _rows(table[:, h], slots, per, kw, 0)
    v_page, v_index = _rows(table[:, h], slots, per, vw, per * kw)
    return pool[k_page[..., None], k_index], pool[v_page[..., None], v_index]


def window_before(keep, prompts, windows: tuple[int | None, ...], most: int):
    """int32 [B, L, Hkv, most + 1]: for each sliding-window layer's head, entry j counts the slots it kept among the
    prompt's positions before ``n - W + j`` (``keep`` [B, L, Hkv, S] the selection, ``prompts`` [B] the lengths n,
    ``windows`` each layer's W or None, ``most`` the largest W); zeros for whole-context layers. Eviction keeps a
    sliding layer's tokens inside its window's last W positions only, so entry W is every kept slot, and
    ``window_first`` reads where the window has moved from it."""
    b, layers, heads, s = keep.shape
    sums = jnp.concatenate([jnp.zeros((b, layers, heads, 1), jnp.int32), jnp.cumsum(keep, -1, dtype=jnp.int32)], -1)
    rows = []
    for layer, w in enumerate(windows):
        if w is None:
            rows.append(jnp.zeros((b, heads, most + 1), jnp.int32))
            continue
        at = jnp.clip(jnp.asarray(prompts, jnp.int32)[:, None] - w + jnp.minimum(jnp.arange(most + 1), w), 0, s)
        rows.append(jnp.take_along_axis(sums[:, layer], jnp.broadcast_to(at[:, None, :], (b, heads, most + 1)), -1))
    return jnp.stack(rows, axis=1)


def window_first(before, stored, window: int):
    """int32 [B, Hkv]: each head's first slot a sliding window of ``window`` positions sees, the newest token stored
    (``stored`` [B, Hkv] counts it) and ``before`` [B, Hkv, >= window + 1] its layer's ``window_before`` rows. Slots
    hold the kept prompt tokens in order, then every decoded one: after d = stored - kept decoded tokens the window
    has passed ``before[min(d, W)]`` kept ones and ``max(d - W, 0)`` decoded ones."""
    decoded = stored - before[..., window]
    passed = jnp.take_along_axis(before, jnp.clip(decoded, 0, window)[..., None], -1)[..., 0]
    return passed + jnp.maximum(decoded - window, 0)


def decode_attention(
    q, pool, table, stored, layout: HeadLayout, page_elems: int, tokens: int, first=None, weights: bool = False
):
    """One query token per sequence, q [B, q_cols] (packed), over each KV head's ``stored`` [B, Hkv] slots (its own
    token included, already written) read through ``table`` [B, Hkv, pages]; ``tokens``: the most slots any head
    stores (static); ``first`` [B, Hkv] (a sliding-window layer): each head's first slot its window sees. Returns
    [B, out_cols]; with ``weights``, also ``decode_weights``' from the same softmax."""
    scale = 1.0 / math.sqrt(layout.head_dim)
    size = layout.group_size
    outs, probs = [], []
    for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
        k, v = read(pool, table, h, layout, page_elems, tokens)
        qo = HeadLayout.offsets(layout.k_widths, size)[h]
        qh = q[:, qo : qo + size * kw].reshape(q.shape[0], size, kw)
        logits = jnp.einsum("bgd,bsd->bgs", qh, k).astype(jnp.float32) * scale
        slot = jnp.arange(tokens)[None, None, :]
        seen = slot < stored[:, h, None, None]
        if first is not None:
            seen &= slot >= first[:, h, None, None]
        probs.append(jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1))
        outs.append(jnp.einsum("bgs,bsd->bgd", probs[-1].astype(v.dtype), v).astype(q.dtype).reshape(-1, size * vw))
    out = jnp.concatenate(outs, axis=-1)
    return (out, jnp.nan_to_num(jnp.stack(probs, axis=1))) if weights else out  # nothing stored: 0, not NaN


def decode_weights(q, pool, table, stored, layout: HeadLayout, page_elems: int, tokens: int, first=None):
    """float32 [B, Hkv, G, tokens]: the softmax weight each query row of ``decode_attention`` (same arguments) gives
    each of its head's slots, 0 on slots it does not see: what the decode step adds to the full-history eviction
    sums (H2O's plain, KV-Compress's squared, summed over the group). The reference of ``head_paged_decode``'s
    ``weights``."""
    return decode_attention(q, pool, table, stored, layout, page_elems, tokens, first, weights=True)[1]


def _spans(starts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + widths[i] - 1`` of every i, concatenated (no Python loop)."""
    firsts = np.repeat(starts - np.concatenate([[0], np.cumsum(widths)[:-1]]), widths)
    return firsts + np.arange(int(widths.sum()))


def move(pool, source, destination, layouts, page_elems: int):
    """Apply compaction moves (``HeadPages.evict``'s (layer, head, page, row) int rows) to every layer's K and V
    rows in one gather and one scatter, every source read before any write. Under ``jax.jit`` with the pool
    donated, XLA writes in place: the pool is never copied."""
    if len(source) == 0:
        return pool
    k_w = np.array([lay.k_widths for lay in layouts])
    v_w = np.array([lay.v_widths for lay in layouts])
    per = np.stack([layer_tokens_per_page(lay, page_elems) for lay in layouts])

    def elements(rows):  # (page, element in the page) of every element the rows hold
        layer, h, page, row = np.asarray(rows).T
        kw, vw, p = k_w[layer, h], v_w[layer, h], per[layer, h]
        pages = np.concatenate([np.repeat(page, kw), np.repeat(page, vw)])
        return jnp.asarray(pages), jnp.asarray(np.concatenate([_spans(row * kw, kw), _spans(p * kw + row * vw, vw)]))

    (src_page, src), (dst_page, dst) = elements(source), elements(destination)
    return pool.at[dst_page, dst].set(pool[src_page, src], unique_indices=True)


def _reordered(blocks, order, first: int, width: int, per: int):
    """Rows ``width`` wide starting ``first`` elements into each page of ``blocks`` [B, G, pages, page_elems], as one
    run of ``pages x per`` slots a head, taken in ``order`` [B, G, slots, 1] and laid back out as pages."""
    b, g, pages = blocks.shape[:3]
    part = blocks[..., first : first + per * width].reshape(b, g, pages * per, width)
    return jnp.take_along_axis(part, order, axis=2).reshape(b, g, pages, per * width)


def survivor_orders(keep, stored, layouts, page_elems: int, pages: int, layers: tuple[int, ...] | None = None):
    """What a compaction moves (``compact`` and ``ops.head_compact.compact`` share it): (kept [B, L, Hkv] int32, the
    ``keep`` [B, L, Hkv, S] marks among each head's first ``stored`` slots; and for each (K, V) width pair of the
    heads of ``layers`` (None: all), in order of first appearance, ((kw, vw), layers [G], heads [G], tokens a page,
    order [B, G, pages x per]): each head's slots, its survivors first in slot order, then the rest)."""
    keep = keep & (jnp.arange(keep.shape[-1]) < stored[..., None])
    kept = keep.sum(-1, dtype=jnp.int32)
    groups = []
    for (kw, vw), ls, hs in heads_by_pair(layouts, layers):
        per = tokens_per_page(page_elems, kw, vw)
        groups.append(((kw, vw), ls, hs, per, survivors_first(keep[:, ls, hs], pages * per)))
    return kept, groups


def heads_by_pair(
    layouts, layers: tuple[int, ...] | None = None
) -> list[tuple[tuple[int, int], np.ndarray, np.ndarray]]:
    """The heads of ``layers`` (None: all) of a model's ``layouts`` by (K width, V width), in order of first
    appearance: ((kw, vw), their layers [G], their heads [G]), what a compaction moves in one gather each."""
    members: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for layer, lay in enumerate(layouts):
        if layers is None or layer in layers:
            for h, pair in enumerate(zip(lay.k_widths, lay.v_widths)):
                members.setdefault(pair, []).append((layer, h))
    out = []
    for pair, heads in members.items():
        ls, hs = zip(*heads)
        out.append((pair, np.array(ls), np.array(hs)))
    return out


def survivors_first(mark, room: int):
    """[..., room]: each head's positions, those ``mark`` [..., S] keeps first, in order, then the rest (marks padded
    with False or cut to ``room``)."""
    mark = jnp.pad(mark, ((0, 0),) * (mark.ndim - 1) + ((0, max(room - mark.shape[-1], 0)),))[..., :room]
    return jnp.argsort(~mark, axis=-1, stable=True)


def compact(pool, tables, keep, stored, layouts, page_elems: int, layers: tuple[int, ...] | None = None):
    """Eviction's compaction on the device: each head keeps, of its first ``stored`` [B, L, Hkv] slots, those
    ``keep`` [B, L, Hkv, S] marks (slots past ``stored`` or ``S`` are dropped), moved in their order to its first
    slots, through ``tables`` [B, L, Hkv, pages]; ``layers`` (static): only these layers' heads are read and moved
    (the rest must keep every slot: ``continual.compress``'s sliding-window layers). Entries past the pages a head's
    ``stored`` slots fill are ignored: a device table may still name pages an eviction gave back, since taken by
    another head, and the write of every page read would then put one page twice in a scatter (for the same reason
    a sliding-window head, whose first entries may name pages its window gave back, must not be among ``layers``).
    Returns (pool, kept [B, L, Hkv] int32): what the host hands
    ``HeadPages.shrink``, which gives back the pages past them. Equal to ``HeadPages.evict``'s moves applied by
    ``move``, without their host work (bench/results/eviction.md "Per-head pages: host cost": 24-429 ms an 8K sequence).

    Shapes are static (one compile per batch and table width): heads of one (K, V) width pair, of every layer, are
    read whole ([heads, pages, page_elems]), ordered by a stable sort on the keep mask and written back to the same
    pages. Under ``jax.jit`` with the pool donated XLA scatters in place, so the pool is never copied; the traffic
    is the heads' pages read and written once, evicted or not."""
    pages = tables.shape[-1]
    kept, groups = survivor_orders(keep, stored, layouts, page_elems, pages, layers)
    flat_pages = pool.shape[0]
    for (kw, vw), ls, hs, per, order in groups:
        table = tables[:, ls, hs]  # [B, G, pages]
        filled = -(-stored[:, ls, hs] // per)  # pages a head's slots fill; entries past them may be stale
        table = jnp.where(jnp.arange(pages) < filled[..., None], table, NULL_PAGE)
        blocks = pool[table]  # [B, G, pages, page_elems]
        order = order[..., None]
        k_rows, v_rows = _reordered(blocks, order, 0, kw, per), _reordered(blocks, order, per * kw, vw, per)
        blocks = jnp.concatenate([k_rows, v_rows, blocks[..., per * (kw + vw) :]], axis=-1)
        target = jnp.where(table == NULL_PAGE, flat_pages, table)  # the null page is never written
        pool = pool.at[target].set(blocks, mode="drop")
    return pool, kept


def admit(pool, tables, k_pages, v_pages, seq_table, keep, layouts, page_elems: int):
    """Copy prompts from the engine's per-sequence pages into per-head pages, each head keeping what ``keep`` marks:
    eviction after prefill and its compaction in one pass, so nothing is moved again (bench/notes/
    2026-12-02-eviction-device.md, "The engine on per-head pages").

    ``k_pages``/``v_pages``: per layer [P, page_size, k_cols / v_cols] (``runtime.cache.PagedKVCache``; every layer
    in the whole-context pool); ``seq_table`` [B, pages]: the prompts' pages there; ``keep`` [B, L, Hkv, S] (S at
    most the pages' tokens): the tokens each head keeps, in position order; ``tables`` [B, L, Hkv, head pages]: each
    head's per-head pages, enough for what it keeps (slots whose page is the null page are dropped). Returns the pool
    and the kept counts [B, L, Hkv] (each head stores its survivors in slots 0 .. kept - 1)."""
    b, s = keep.shape[0], keep.shape[-1]
    kept = keep.sum(-1, dtype=jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(s), (b, keep.shape[2], s))
    for layer, lay in enumerate(layouts):
        order = jnp.argsort(~keep[:, layer], axis=-1, stable=True)  # [B, Hkv, S]: survivors first, in order
        ks, vs = (pages[layer][seq_table].reshape(b, -1, pages[layer].shape[-1])[:, :s] for pages in (k_pages, v_pages))
        k_cols, v_cols = [], []
        heads = zip(lay.k_widths, lay.v_widths, HeadLayout.offsets(lay.k_widths), HeadLayout.offsets(lay.v_widths))
        for h, (kw, vw, ko, vo) in enumerate(heads):
            rows = order[:, h, :, None]
            k_cols.append(jnp.take_along_axis(ks[..., ko : ko + kw], rows, axis=1))
            v_cols.append(jnp.take_along_axis(vs[..., vo : vo + vw], rows, axis=1))
        k_rows, v_rows = jnp.concatenate(k_cols, -1), jnp.concatenate(v_cols, -1)
        valid = slots < kept[:, layer, :, None]  # a head's slots past its survivors are not written
        pool = write(pool, tables[:, layer], slots, k_rows, v_rows, valid, lay, page_elems)
    return pool, kept
