"""Paged KV cache: one page pool per layer and one block table per sequence and page pool (which pages a sequence
owns is ``kvjax.runtime.pages``).

A layer's K page holds ``page_size`` tokens of every KV head side by side (``layout.k_cols`` columns, each head at
its own width), V likewise, so the cache spends exactly the bytes the layout asks for. Page 0 is reserved as the
null page: padding writes land there and unused block-table entries point there.

Layers are pooled by their attention window (``pool_windows``): pool 0 holds every position of a sequence (layers
that see the whole context); a sliding-window layer's pool needs only the pages its window still covers, so those
pages go back as the window passes (Gemma 3's local layers: a 32K context keeps 512 positions of them). A sequence
has one block table per pool, indexed by the same logical page number; a page given back reads as the null page.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.kv_schemes import AnyPageFormat
from kvjax.ops.paging import NULL_PAGE
from kvjax.ops.quant_paging import create_tail


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k: tuple[jax.Array, ...]  # per layer [num_pages, page_size, k_cols]
    v: tuple[jax.Array, ...]  # per layer [num_pages, page_size, v_cols]

    @classmethod
    def create(
        cls, layouts: tuple[HeadLayout, ...], num_pages, page_size: int, dtype, windows: tuple = (None,)
    ) -> PagedKVCache:
        """Zeroed pools; ``num_pages``: one count for every layer, or one per pool of ``windows``
        (``pool_windows``), each layer's pool chosen by ``pool_of``."""
        counts = (num_pages,) * len(windows) if isinstance(num_pages, int) else tuple(num_pages)
        pages = [counts[pool_of(lay, windows)] for lay in layouts]
        return cls(
            k=tuple(jnp.zeros((n, page_size, lay.k_cols), dtype) for n, lay in zip(pages, layouts)),
            v=tuple(jnp.zeros((n, page_size, lay.v_cols), dtype) for n, lay in zip(pages, layouts)),
        )

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Device bytes of every pool."""
        return sum(a.nbytes for a in (*self.k, *self.v))

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKVCache:
    """A cache of quantized pages (``kvjax.ops.quant_paging``): per layer one uint8 pool [num_pages, page_bytes]
    (codes, scales and zero points of whole pages: ``quant.PageFormat``) and one tail [slots, page_size,
    k_cols + v_cols] in the cache's dtype holding each slot's last, partial page."""

    pages: tuple[jax.Array, ...]
    tails: tuple[jax.Array, ...]

    @classmethod
    def create(
        cls, formats: tuple[AnyPageFormat, ...], layouts, num_pages, slots: int, dtype, windows: tuple = (None,)
    ) -> QuantizedKVCache:
        """Zeroed pools (``num_pages`` as in ``PagedKVCache.create``) and tails for ``slots`` sequences."""
        counts = (num_pages,) * len(windows) if isinstance(num_pages, int) else tuple(num_pages)
        pages = [counts[pool_of(lay, windows)] for lay in layouts]
        return cls(
            pages=tuple(jnp.zeros((n, f.page_bytes), jnp.uint8) for n, f in zip(pages, formats)),
            tails=tuple(create_tail(f, slots, dtype) for f in formats),
        )

    @property
    def nbytes(self) -> int:
        """Device bytes of every pool and tail."""
        return sum(a.nbytes for a in (*self.pages, *self.tails))

    @property
    def num_pages(self) -> int:
        return self.pages[0].shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadKVCache:
    """Eviction's cache on the device (issue 37): one pool of fixed-size pages that every layer and KV
    head shares (``ops.head_paging``), each slot's per-head block tables and stored counts. The host's
    ``runtime.head_pages.HeadPages`` decides which pages a head owns; the tables here follow it by the entries its
    ``grow_many`` fills (``with_entries``: kilobytes a step where whole tables would be megabytes,
    bench/results/eviction.md "Per-head pages: host cost"). ``queries``: per layer, each slot's last W packed queries,
    the query of position p in row p % W, which continual eviction scores with (``kvjax.eviction.continual``).
    ``before``: for sliding-window layers, where each head's window starts in its slots
    (``ops.head_paging.window_before``; [slots, layers, Hkv, 1] of zeros for a model without them). ``sums`` (the
    full-history methods decode adds to, ``eviction.metrics.DECODED``): per layer float32 [slots, Hkv, tokens], what
    every query so far gave each stored slot (the prompt's sums written at its end, each decode step's weights
    added), by which continual eviction ranks a head's slots. One array a layer, as ``queries``, which a decode step's
    kernel adds to in place (``ops.decode.sums_kernel``): a layer's slice of one array was copied whole by XLA every
    layer (6.2 of 15.6 ms a step on the H100: bench/results/eviction.md, "Eviction on the H100 (2026-12-06, third
    session)"). ``tails`` (eviction with ``kv_bits``, ``ops.quant_head_paging``: the pool is uint8 and holds each
    head's full groups of slots quantized): per layer [slots, group, k_cols + v_cols], each slot's newest partial
    group of every head, exact."""

    pool: jax.Array  # [num_pages, page_elems]
    tables: jax.Array  # int32 [slots, layers, Hkv, pages a head]
    stored: jax.Array  # int32 [slots, layers, Hkv]: tokens each head stores
    queries: tuple[jax.Array, ...] = ()  # per layer [slots, W, q_cols]
    before: jax.Array | None = None  # int32 [slots, layers, Hkv, largest window + 1]
    sums: tuple[jax.Array, ...] | None = None  # per layer float32 [slots, Hkv, tokens a head may store]
    tails: tuple[jax.Array, ...] = ()  # quantized pages (uint8 pool): per layer [slots, group, k_cols + v_cols]

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_elems: int,
        slots: int,
        layers: int,
        heads: int,
        max_pages: int,
        dtype,
        q_cols=(),
        window: int = 0,
        sums: int = 0,
        tails=None,
    ):
        """Zeroed pool, tables of null pages, nothing stored; ``q_cols``: (W, q_cols) a layer, the shape of its
        query ring (none without); ``window``: the layers' largest sliding window (0: none); ``sums``: the tokens a
        head may store, for a policy that keeps a sum a slot (0: none); ``tails`` (quantized pages,
        ``ops.quant_head_paging``: the pool is then uint8): (group, each layer's k_cols + v_cols), each slot's newest
        partial group of every head in ``dtype``."""
        return cls(
            pool=jnp.zeros((num_pages, page_elems), dtype if tails is None else jnp.uint8),
            tables=jnp.full((slots, layers, heads, max_pages), NULL_PAGE, jnp.int32),
            stored=jnp.zeros((slots, layers, heads), jnp.int32),
            queries=tuple(jnp.zeros((slots, w, cols), dtype) for w, cols in q_cols),
            before=jnp.zeros((slots, layers, heads, window + 1), jnp.int32),
            sums=tuple(jnp.zeros((slots, heads, sums), jnp.float32) for _ in range(layers)) if sums else None,
            tails=() if tails is None else tuple(jnp.zeros((slots, tails[0], cols), dtype) for cols in tails[1]),
        )

    def with_entries(self, slots, entries) -> HeadKVCache:
        """The tables with ``HeadPages.grow_many``'s filled entries (rows of owner index, layer, head, table index,
        page) written, owner index i standing for slot ``slots[i]``. Entries past the pages a head's stored count
        needs may be stale after an eviction (the kernels read only those pages); growth overwrites them."""
        entries = jnp.asarray(entries, jnp.int32).reshape(-1, 5)
        slots = jnp.asarray(slots, jnp.int32)
        slot = jnp.take(slots, entries[:, 0], mode="fill", fill_value=self.tables.shape[0])  # past ``slots``: padding
        tables = self.tables.at[slot, entries[:, 1], entries[:, 2], entries[:, 3]].set(entries[:, 4], mode="drop")
        return dataclasses.replace(self, tables=tables)

    def slot_sums(self, slot) -> jax.Array:
        """Slot ``slot``'s sums, float32 [layers, Hkv, tokens] (``sums`` must exist)."""
        assert self.sums is not None
        return jnp.stack([s[slot] for s in self.sums])

    def with_slot_sums(self, slots, got) -> HeadKVCache:
        """Sums ``got`` [n, layers, Hkv, tokens] written to slots ``slots`` [n] (a slot past the last: dropped)."""
        assert self.sums is not None
        sums = tuple(s.at[slots].set(got[:, i], mode="drop") for i, s in enumerate(self.sums))
        return dataclasses.replace(self, sums=sums)

    def freed(self, slot: int) -> HeadKVCache:
        """Slot ``slot`` emptied: its tables back to null pages, nothing stored (its pages went back on the host)."""
        return dataclasses.replace(self, tables=self.tables.at[slot].set(NULL_PAGE), stored=self.stored.at[slot].set(0))

    @property
    def nbytes(self) -> int:
        extra = (0 if self.before is None else self.before.nbytes) + sum(a.nbytes for a in self.sums or ())
        extra += sum(t.nbytes for t in self.tails)
        return self.pool.nbytes + self.tables.nbytes + self.stored.nbytes + sum(q.nbytes for q in self.queries) + extra


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EvictingCache:
    """An evicting engine's cache (``EngineConfig.eviction``): prompts are prefilled into per-sequence ``staging``
    pages as in a plain cache; at a prompt's end each KV head's survivors move to its per-head pages in ``heads``,
    which decode reads and appends to (bench/notes/2026-12-02-eviction-device.md). ``mass`` (full-history methods:
    H2O, KV-Compress's full form, Keyformer): float32 [layers, staging pages, page_size, Hkv], what every query of a
    prompt so far gave each of its keys, beside the staging pages and addressed as they are
    (``eviction.prompt.accumulate``)."""

    staging: PagedKVCache
    heads: HeadKVCache
    mass: jax.Array | None = None

    @property
    def nbytes(self) -> int:
        return self.staging.nbytes + self.heads.nbytes + (0 if self.mass is None else self.mass.nbytes)


def pool_windows(layouts: tuple[HeadLayout, ...], max_seq_len: int | None = None) -> tuple[int | None, ...]:
    """The page pools a cache of these layers keeps: None (whole context) first, then each sliding window shorter
    than ``max_seq_len`` (a longer one never lets a page go, so its layers share pool 0)."""
    short = {lay.sliding_window for lay in layouts if lay.sliding_window}
    if max_seq_len is not None:
        short = {w for w in short if w < max_seq_len}
    return (None, *sorted(short))


def pool_of(layout: HeadLayout, windows: tuple[int | None, ...]) -> int:
    """The pool of ``windows`` that holds a layer's pages: its window's, else pool 0."""
    return windows.index(layout.sliding_window) if layout.sliding_window in windows else 0


def window_span(window: int | None, page_size: int, chunk_tokens: int, pages_per_seq: int) -> int:
    """The most pages of a ``window`` pool one sequence holds at once: a chunk of ``chunk_tokens`` positions writes
    all its pages while the window behind its first query still covers up to ``window - 1`` positions before it."""
    if window is None:
        return pages_per_seq
    return min(pages_per_seq, -(-(window - 1 + chunk_tokens) // page_size) + 1)


def first_kept_page(window: int | None, position: int, page_size: int) -> int:
    """The first page a query at ``position`` (or any later one) can see under ``window``: pages before it are done
    (the decode plan's and the kernels' first page too)."""
    return 0 if window is None else max(position + 1 - window, 0) // page_size


def bytes_per_token(layouts: tuple[HeadLayout, ...], dtype) -> int:
    """Cache bytes one token occupies across all layers."""
    return sum(lay.k_cols + lay.v_cols for lay in layouts) * jnp.dtype(dtype).itemsize


def token_bytes(layouts: tuple[HeadLayout, ...], dtype, formats: tuple[AnyPageFormat, ...] | None = None) -> dict:
    """Cache bytes one token occupies across all layers, by part (issue 35's honest accounting): K and V in the
    cache's dtype, or with quantized ``formats`` the key and value codes, the keys' per-page scales and zeros spread
    over the page's tokens, the values' per-token scales and zeros, and the alignment padding of each page. The
    tail (a page per slot and layer in the cache's dtype) is a fixed cost, not a per-token one."""
    if formats is None:
        size = jnp.dtype(dtype).itemsize
        return {"k": sum(lay.k_cols for lay in layouts) * size, "v": sum(lay.v_cols for lay in layouts) * size}
    out: dict[str, float] = {}
    for f in formats:
        for part, n in f.bytes_by_part().items():
            out[part] = out.get(part, 0.0) + n / f.page_size
    return out


def block_table(page_lists: list[list[int]], width: int) -> np.ndarray:
    """int32 [len(page_lists), width] block table, padded with the null page."""
    table = np.full((len(page_lists), width), NULL_PAGE, np.int32)
    for row, pages in enumerate(page_lists):
        if len(pages) > width:
            raise ValueError(f"sequence needs {len(pages)} pages, block table holds {width}")
        table[row, : len(pages)] = pages
    return table
