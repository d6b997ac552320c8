"""Quantized per-head pages (issue 37, item 5: eviction combined with issue 35's quantized pages), as the ops see
them, in jnp: the reference a kernel over them is checked against.

A KV head's slots group by ``group`` (the engine's page size). A full group is one ``quant.PageFormat`` page of that
head alone (``head_format``: keys ranged per column over the group's slots, values per slot), and a pool page of
``page_bytes`` holds ``groups_per_page`` of one head's groups side by side, so a head stores ``tokens_per_page``
slots a page: slot s of head h is row s % group of group (s % per) // group of page ``table[h, s // per]``. A head's
newest, partial group stays exact in its columns of the layer's tail [slots, group, k_cols + v_cols] (the cache's
dtype), as ``quant_paging``'s tail does for a whole sequence, until its last slot arrives and the group is quantized
into its page. The pool is the per-head pool's (``runtime.head_pages``: every page one size, any head's), uint8.

Groups of ``group`` slots, not of a page's tokens, so every head's keys share one range length whatever its width:
the design ``eviction.reference.compacted_round_trip`` scores (each head's survivors compacted in order, then
quantized a page of slots at a time; bench/results/eviction.md "On 4-bit pages and a low-rate plan").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops import head_paging
from kvjax.ops.paging import NULL_PAGE
from kvjax.ops.quant import PageFormat


def head_format(k_width: int, v_width: int, group: int, bits: int) -> PageFormat:
    """One full group of one head's slots as quantized bytes."""
    return PageFormat((int(k_width),), (int(v_width),), int(group), int(bits))


def groups_per_page(page_bytes: int, k_width: int, v_width: int, group: int, bits: int) -> int:
    """How many of a head's groups a pool page of ``page_bytes`` holds."""
    n = page_bytes // head_format(k_width, v_width, group, bits).page_bytes
    if n < 1:
        raise ValueError(f"a page of {page_bytes} bytes holds no group of widths {k_width} + {v_width}")
    return n


def tokens_per_page(page_bytes: int, k_width: int, v_width: int, group: int, bits: int) -> int:
    """How many of a head's slots a pool page holds: whole groups only."""
    return group * groups_per_page(page_bytes, k_width, v_width, group, bits)


def layer_tokens_per_page(layout: HeadLayout, page_bytes: int, group: int, bits: int) -> np.ndarray:
    """int64 [Hkv]: ``tokens_per_page`` of each KV head of a layer (``runtime.head_pages.HeadPages``' per_page)."""
    return np.array([tokens_per_page(page_bytes, k, v, group, bits) for k, v in zip(layout.k_widths, layout.v_widths)])


def pool_page_bytes(layouts, group: int, bits: int) -> int:
    """The pool's page: one group of the widest head of any layer, so every head fits one group and a narrower head
    fits as many as its bytes allow (the bf16 pool's rule, ``head_paging``: its page holds the widest head's page of
    tokens)."""
    return max(head_format(k, v, group, bits).page_bytes for lay in layouts for k, v in zip(lay.k_widths, lay.v_widths))


def create_tail(layout: HeadLayout, slots: int, group: int, dtype) -> jax.Array:
    """A layer's empty tail: each slot's newest partial group of every head, [slots, group, k_cols + v_cols]."""
    return jnp.zeros((slots, group, layout.k_cols + layout.v_cols), dtype)


def _columns(layout: HeadLayout) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """(each tail column's head [k_cols + v_cols], each head's (K columns, V columns) of the tail)."""
    ko, vo = HeadLayout.offsets(layout.k_widths), HeadLayout.offsets(layout.v_widths)
    heads = np.concatenate(
        [
            np.repeat(np.arange(layout.num_kv_heads), layout.k_widths),
            np.repeat(np.arange(layout.num_kv_heads), layout.v_widths),
        ]
    )
    cols = [
        (np.arange(ko[h], ko[h] + kw), layout.k_cols + np.arange(vo[h], vo[h] + vw))
        for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths))
    ]
    return heads, cols


@functools.cache
def _head_sources(k_widths: tuple, v_widths: tuple, group: int, bits: int) -> np.ndarray:
    """int64 [Hkv, most]: byte i of head h's group (``head_format``, ``most`` the widest head's bytes) is byte
    ``[h, i]`` of the layer's page of the same slots (``PageFormat.for_layout``), -1 where it is alignment padding
    (a zero byte) or past the head's bytes. Keys range per column and values per slot and head whatever the heads
    beside them, so a head's group is its bytes of the layer's page: one encode of every head, then a gather."""
    layer = PageFormat(k_widths, v_widths, group, bits)
    n, at = layer.per_byte, layer.offsets
    ko, vo = HeadLayout.offsets(k_widths), HeadLayout.offsets(v_widths)
    fmts = [head_format(kw, vw, group, bits) for kw, vw in zip(k_widths, v_widths)]
    out = np.full((len(fmts), max(f.page_bytes for f in fmts)), -1, np.int64)
    t = np.arange(group)[:, None]
    for h, (kw, vw, f) in enumerate(zip(k_widths, v_widths, fmts)):
        own = f.offsets
        for part, w, off, cols in (("k_codes", kw, ko[h], layer.k_cols), ("v_codes", vw, vo[h], layer.v_cols)):
            j = np.arange(w // n)[None, :]
            out[h, own[part] + t * (w // n) + j] = at[part] + t * (cols // n) + off // n + j
        r, c, byte = np.arange(2)[:, None, None], np.arange(kw)[None, :, None], np.arange(2)[None, None, :]
        out[h, own["k_meta"] + (r * kw + c) * 2 + byte] = at["k_meta"] + (r * layer.k_cols + ko[h] + c) * 2 + byte
        slot = np.arange(group)[None, :, None]
        out[h, own["v_meta"] + (r * group + slot) * 2 + byte] = (
            at["v_meta"] + ((r * layer.heads + h) * group + slot) * 2 + byte
        )
    return out


def _write_groups(pool, k, v, page, nth, layout: HeadLayout, group: int, bits: int):
    """Full groups of every head of a layer, encoded at once and scattered at once: keys [..., group, k_cols] and
    values [..., group, v_cols] (each head's slots in its own columns, rows the group's slots), each head's page and
    group index in the page ``page``, ``nth`` [..., Hkv]; a page past the pool or the null page drops its head's
    group. One ``PageFormat`` encode of the layer and a gather of each head's bytes (``_head_sources``): an encode a
    width pair made the int4 step's writes several fusions a pair a layer (bench/results/eviction.md "Eviction on
    quantized pages: the merge kernel and a launch a class (H100)")."""
    num_pages = pool.shape[0]
    src = _head_sources(tuple(layout.k_widths), tuple(layout.v_widths), group, bits)
    sizes = np.array([head_format(kw, vw, group, bits).page_bytes for kw, vw in zip(layout.k_widths, layout.v_widths)])
    encoded = PageFormat.for_layout(layout, group, bits).encode(k, v)  # [..., layer bytes]
    values = jnp.take(encoded, np.maximum(src, 0), axis=-1)  # [..., Hkv, most]
    values = jnp.where(src >= 0, values, 0).astype(jnp.uint8)
    page = jnp.where((page > NULL_PAGE) & (page < num_pages), page, num_pages)
    byte = np.arange(src.shape[1])
    index = nth[..., None] * sizes[:, None] + byte  # [..., Hkv, most]
    page = jnp.where(byte < sizes[:, None], page[..., None], num_pages)  # bytes past a head's group: dropped
    return pool.at[page.reshape(-1), index.reshape(-1)].set(values.reshape(-1), mode="drop")


def write_decode(pool, tail, table, stored, k, v, active, layout: HeadLayout, page_bytes: int, group: int, bits: int):
    """One new token a row (row i: slot i of the tail and of ``table`` [B, Hkv, pages]): K [B, k_cols] and V [B,
    v_cols] (packed heads) at each head's next slot ``stored`` [B, Hkv] (its count before it) go to the head's columns
    of the tail; a head whose group that slot completes has the group quantized into its page. Rows not ``active``
    [B] write nothing. Returns (pool, tail).

    Every head's group is encoded every step and only the completing ones are written (static shapes, one scatter
    a layer): the reference's simplicity, about ``group`` tokens of encoding a head a step."""
    b = k.shape[0]
    heads, _ = _columns(layout)
    new = jnp.concatenate([k, v], -1).astype(tail.dtype)  # [B, k_cols + v_cols]
    row = jnp.where(active, jnp.arange(b), tail.shape[0])[:, None]
    at = stored[:, heads] % group  # each column's head's slot in its group
    tail = tail.at[row, at, jnp.arange(new.shape[1])[None, :]].set(new, mode="drop")
    completes = active[:, None] & ((stored + 1) % group == 0)  # [B, Hkv]
    per = layer_tokens_per_page(layout, page_bytes, group, bits)  # [Hkv]
    page = jnp.take_along_axis(table, (stored // per)[..., None], axis=-1, mode="clip")[..., 0]
    page = jnp.where(completes, page, NULL_PAGE)
    rows = tail[:b]
    k_cols = layout.k_cols
    return _write_groups(
        pool, rows[..., :k_cols], rows[..., k_cols:], page, (stored % per) // group, layout, group, bits
    ), tail


def admit(
    pool, tails, tables, tail_rows, k_pages, v_pages, seq_table, keep, layouts, page_bytes: int, group: int, bits: int
):
    """``head_paging.admit`` onto quantized per-head pages: each head's survivors (``keep`` [B, L, Hkv, S], in
    position order) of the prompts in the per-sequence pages ``k_pages``/``v_pages`` (per layer [P, page_size,
    cols]; ``seq_table`` [B, pages]) go to its slots 0 .. kept - 1 through ``tables`` [B, L, Hkv, head pages]: the
    full groups quantized into their pages, the last partial group exact into the head's columns of ``tails`` (per
    layer) at row ``tail_rows`` [B] (past the tail: dropped). Returns (pool, tails, kept [B, L, Hkv])."""
    b, s = keep.shape[0], keep.shape[-1]
    kept = keep.sum(-1, dtype=jnp.int32)
    span = -(-s // group) * group
    out = []
    for layer, lay in enumerate(layouts):
        heads, cols = _columns(lay)
        order = jnp.argsort(~keep[:, layer], axis=-1, stable=True)  # [B, Hkv, S]: survivors first, in order
        ks, vs = (pages[layer][seq_table].reshape(b, -1, pages[layer].shape[-1])[:, :s] for pages in (k_pages, v_pages))
        every = jnp.concatenate([ks, vs], -1)  # [B, S, k_cols + v_cols]
        rows = jnp.take_along_axis(every, jnp.swapaxes(order[:, heads], 1, 2), axis=1)  # column c: its head's order
        rows = jnp.pad(rows, ((0, 0), (0, span - s), (0, 0)))  # [B, span, cols]: slot order, a head per column
        per = layer_tokens_per_page(lay, page_bytes, group, bits)  # [Hkv]
        grouped = rows.reshape(b, span // group, group, -1)  # [B, groups, group, cols]
        first = np.arange(span // group)[:, None] * group  # each group's first slot [groups, 1]
        page = jnp.take_along_axis(tables[:, layer], np.swapaxes(first // per, 0, 1)[None], axis=-1, mode="clip")
        full = first[None] + group <= kept[:, layer][:, None, :]  # [B, groups, Hkv]
        page = jnp.where(full, jnp.swapaxes(page, 1, 2), NULL_PAGE)
        nth = jnp.broadcast_to((first % per) // group, page.shape)
        k_cols = lay.k_cols
        pool = _write_groups(pool, grouped[..., :k_cols], grouped[..., k_cols:], page, nth, lay, group, bits)
        start = kept[:, layer] // group * group  # [B, Hkv]: each head's partial group's first slot
        index = start[:, heads][:, None, :] + jnp.arange(group)[None, :, None]  # [B, group, cols]
        partial = jnp.take_along_axis(rows, jnp.minimum(index, span - 1), axis=1)
        out.append(tails[layer].at[tail_rows].set(partial.astype(tails[layer].dtype), mode="drop"))
    return pool, tuple(out), kept


def read(pool, tail, table, stored, h: int, layout: HeadLayout, page_bytes: int, group: int, bits: int, tokens: int):
    """Head ``h``'s first ``tokens`` slots as attention reads them, through ``table`` [B, Hkv, pages] and row i of
    ``tail`` for row i: (K [B, tokens, k_width], V [B, tokens, v_width]) float32, full groups dequantized, the slots
    of the head's partial group (``stored`` [B, Hkv]) exact; slots past ``stored`` read 0. A page's bytes past what
    its head wrote may be another head's, of other widths, whose scale bytes can read as NaN: they never reach a
    result."""
    kw, vw = layout.k_widths[h], layout.v_widths[h]
    fmt = head_format(kw, vw, group, bits)
    per = tokens_per_page(page_bytes, kw, vw, group, bits)
    b, n = table.shape[0], -(-tokens // group)
    first = jnp.arange(n) * group
    page = table[:, h, jnp.minimum(first // per, table.shape[-1] - 1)]  # [B, n]
    index = ((first % per) // group)[:, None] * fmt.page_bytes + jnp.arange(fmt.page_bytes)  # [n, bytes]
    k, v = fmt.decode(pool[page[..., None], index[None]])  # [B, n, group, kw / vw]
    k, v = k.reshape(b, n * group, kw)[:, :tokens], v.reshape(b, n * group, vw)[:, :tokens]
    _, cols = _columns(layout)
    rows = tail[:b].astype(jnp.float32)
    slot = jnp.arange(tokens)
    exact = (slot[None, :] >= (stored[:, h] // group * group)[:, None])[..., None]
    held = (slot[None, :] < stored[:, h, None])[..., None]
    tk, tv = rows[:, slot % group][..., cols[h][0]], rows[:, slot % group][..., cols[h][1]]
    return tuple(jnp.where(held, jnp.where(exact, x, y), 0.0) for x, y in ((tk, k), (tv, v)))


def decode_attention(
    q, pool, tail, table, stored, layout: HeadLayout, page_bytes: int, group: int, bits: int, tokens: int, first=None
):
    """``head_paging.decode_attention`` over quantized per-head pages: one query a row, q [B, q_cols] packed,
    against each head's ``stored`` [B, Hkv] slots (its own token included, already written) as ``read`` gives them;
    ``first`` [B, Hkv] (a sliding-window layer): each head's first slot its window sees. Returns [B, out_cols]."""
    scale = 1.0 / math.sqrt(layout.head_dim)
    size = layout.group_size
    outs = []
    for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
        k, v = read(pool, tail, table, stored, h, layout, page_bytes, group, bits, tokens)
        qo = HeadLayout.offsets(layout.k_widths, size)[h]
        qh = q[:, qo : qo + size * kw].reshape(q.shape[0], size, kw).astype(jnp.float32)
        logits = jnp.einsum("bgd,bsd->bgs", qh, k) * scale
        slot = jnp.arange(tokens)[None, None, :]
        seen = slot < stored[:, h, None, None]
        if first is not None:
            seen &= slot >= first[:, h, None, None]
        probs = jnp.nan_to_num(jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1))  # nothing stored: 0
        v = jnp.where(seen[:, 0, :, None], v, 0.0)  # a window's passed slots: their pages may be given back
        outs.append(jnp.einsum("bgs,bsd->bgd", probs, v).astype(q.dtype).reshape(-1, size * vw))
    return jnp.concatenate(outs, axis=-1)


def compact_groups(
    pool, tables, keep, stored, layouts, page_bytes: int, group: int, bits: int, layers: tuple[int, ...] | None = None
):
    """Continual eviction's compaction on quantized per-head pages: each head keeps, of its full groups (its first
    ``stored`` [B, L, Hkv] slots // ``group``), those ``keep`` [B, L, Hkv, S] marks (marks past them are ignored),
    moved whole, in their order, to its first groups through ``tables`` [B, L, Hkv, pages]. A group moves as its
    bytes: a quantized group cannot lose a slot without being quantized again (its keys' ranges span the group), and
    requantizing a mix of groups' survivors would add error at every cut (bench/notes/2026-12-06-quant-head-compile.md),
    so the cut is by groups, as KV-Compress cuts by blocks. The head's partial group stays in the tail, after them.
    ``layers`` (static): only these layers' heads move (the rest must keep every group). Table entries past the pages
    a head's full groups fill are ignored (they may name pages since given to another head; ``head_paging.compact``).
    Returns (pool, stored after [B, L, Hkv] int32: kept groups x ``group`` + the partial group's slots). Shapes are
    static; under ``jax.jit`` with the pool donated the scatter is in place."""
    pages = tables.shape[-1]
    full = stored // group
    keep = keep & (jnp.arange(keep.shape[-1]) < full[..., None])
    after = (keep.sum(-1) * group + stored % group).astype(jnp.int32)
    flat_pages = pool.shape[0]
    for (kw, vw), ls, hs in head_paging.heads_by_pair(layouts, layers):
        per = groups_per_page(page_bytes, kw, vw, group, bits)
        size = head_format(kw, vw, group, bits).page_bytes
        room = pages * per
        order = head_paging.survivors_first(keep[:, ls, hs], room)[..., None]  # [B, G, room, 1]
        table = tables[:, ls, hs]  # [B, G, pages]
        filled = -(-full[:, ls, hs] // per)  # pages a head's full groups fill; entries past them may be stale
        table = jnp.where(jnp.arange(pages) < filled[..., None], table, NULL_PAGE)
        blocks = pool[table]  # [B, G, pages, page_bytes]
        b, g = blocks.shape[:2]
        groups = blocks[..., : per * size].reshape(b, g, room, size)
        moved = jnp.take_along_axis(groups, order, axis=2).reshape(b, g, pages, per * size)
        blocks = jnp.concatenate([moved, blocks[..., per * size :]], axis=-1)
        target = jnp.where(table == NULL_PAGE, flat_pages, table)  # the null page is never written
        pool = pool.at[target].set(blocks, mode="drop")
    return pool, after
