"""Paged K/V pools as the ops see them: a layer's pool is [num_pages, page_size, cols], a block table maps a
sequence's token positions to pages, and page 0 is the null page (unused table entries point there; nothing is
written to it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NULL_PAGE = 0


def write_pages(
    pages: jax.Array, block_table: jax.Array, positions: jax.Array, values: jax.Array, valid: jax.Array
) -> jax.Array:
    """Scatter ``values`` [B, T, cols] at ``positions`` [B, T] through ``block_table``; invalid rows and rows bound
    for the null page (padding rows) are dropped. The rest land in pages their sequences own alone, so the scatter
    is declared unique: XLA then stores plainly instead of resolving collisions (a third of the compressed step's
    time beside the floor: bench/results/engine.md "Engine: decode step beside the floor")."""
    num_pages, page_size = pages.shape[:2]
    page = jnp.take_along_axis(block_table, positions // page_size, axis=1, mode="clip")
    page = jnp.where(valid & (page != NULL_PAGE), page, num_pages)
    return pages.at[page, positions % page_size].set(values.astype(pages.dtype), mode="drop", unique_indices=True)
