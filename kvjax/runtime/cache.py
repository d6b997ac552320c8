"""Paged KV cache: one page pool per layer, one block table per sequence, and a host-side page allocator.

A layer's K page holds ``page_size`` tokens of every KV head side by side (``layout.k_cols`` columns, each head at
its own width), V likewise, so the cache spends exactly the bytes the layout asks for. Page 0 is reserved as the
null page: padding writes land there and unused block-table entries point there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.paging import NULL_PAGE


class CacheFullError(RuntimeError):
    """The page pool has no free pages left for a request."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k: tuple[jax.Array, ...]  # per layer [num_pages, page_size, k_cols]
    v: tuple[jax.Array, ...]  # per layer [num_pages, page_size, v_cols]

    @classmethod
    def create(cls, layouts: tuple[HeadLayout, ...], num_pages: int, page_size: int, dtype) -> PagedKVCache:
        return cls(
            k=tuple(jnp.zeros((num_pages, page_size, lay.k_cols), dtype) for lay in layouts),
            v=tuple(jnp.zeros((num_pages, page_size, lay.v_cols), dtype) for lay in layouts),
        )

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


def bytes_per_token(layouts: tuple[HeadLayout, ...], dtype) -> int:
    """Cache bytes one token occupies across all layers."""
    return sum(lay.k_cols + lay.v_cols for lay in layouts) * jnp.dtype(dtype).itemsize


class PageAllocator:
    """Hands out and takes back page numbers; never hands out the null page."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("a cache needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free_set(self) -> set[int]:
        """The free page numbers (for invariant checks)."""
        return set(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"KV cache is full: {n} pages requested, {len(self._free)} of "
                f"{self.num_pages - 1} free; use fewer or shorter sequences, or a larger cache"
            )
        if n <= 0:
            return []
        pages, self._free = self._free[-n:][::-1], self._free[:-n]
        return pages

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        if any(p == NULL_PAGE or not 0 < p < self.num_pages for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"cannot free pages {pages}: not pages of this pool")
        taken = set(self._free) & set(pages)
        if taken:
            raise ValueError(f"pages {sorted(taken)} are already free")
        self._free.extend(reversed(pages))


def block_table(page_lists: list[list[int]], width: int) -> np.ndarray:
    """int32 [len(page_lists), width] block table, padded with the null page."""
    table = np.full((len(page_lists), width), NULL_PAGE, np.int32)
    for row, pages in enumerate(page_lists):
        if len(pages) > width:
            raise ValueError(f"sequence needs {len(pages)} pages, block table holds {width}")
        table[row, : len(pages)] = pages
    return table
