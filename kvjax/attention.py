"""The one attention entry point the engine calls, over packed heads of per-head widths.

``prefill`` and ``decode`` write the new K/V into the pages and dispatch between the jnp reference
(``kvjax.attention_reference``) and the Pallas kernels (``kvjax.pallas``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention_reference import causal_attention, paged_decode_attention
from kvjax.cache import write_pages
from kvjax.layout import HeadLayout


# --- the seam between the engine and the kernels -------------------------------------------------------------------

BACKENDS = ("reference", "pallas", "interpret")


def default_backend() -> str:
    """The Pallas kernels on a GPU, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def prefill(q, k, v, layout: HeadLayout, k_pages, v_pages, block_table, lengths, *, backend="reference",
            rebuild=None):
    """Attention of fresh prompts [B, T, cols] among themselves, and their K/V written into the pages.

    Returns (out, k_pages, v_pages). "pallas"/"interpret" run ``kvjax.pallas.prefill`` (on the GPU, or interpreted
    on the CPU for tests); Palu layers (``rebuild``) always take the reference path.
    """
    if backend == "reference" or rebuild is not None:
        b, t = q.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = positions < lengths[:, None]
        k_pages = write_pages(k_pages, block_table, positions, k, valid)
        v_pages = write_pages(v_pages, block_table, positions, v, valid)
        return causal_attention(q, k, v, layout, rebuild), k_pages, v_pages
    from kvjax.pallas.prefill import prefill_attention

    return prefill_attention(q, k, v, layout, lengths, k_pages, v_pages, block_table,
                             interpret=backend == "interpret")


def decode(q, k, v, layout: HeadLayout, k_pages, v_pages, block_table, lengths, *, backend="reference",
           schedule=None, rebuild=None):
    """One new token per sequence: its K/V [B, cols] written into the pages at position ``lengths - 1``, then its
    query [B, q_cols] against the whole paged cache. Returns (out, k_pages, v_pages), like ``prefill``.

    ``schedule``: this layer's ``kvjax.schedule.DecodeSchedule`` (needed by the kernels; built on the host).
    """
    positions, valid = (lengths - 1)[:, None], jnp.ones((q.shape[0], 1), bool)
    k_pages = write_pages(k_pages, block_table, positions, k[:, None], valid)
    v_pages = write_pages(v_pages, block_table, positions, v[:, None], valid)
    if backend == "reference" or rebuild is not None:
        return paged_decode_attention(q, k_pages, v_pages, block_table, lengths, layout, rebuild), k_pages, v_pages
    from kvjax.pallas.decode import paged_decode

    out = paged_decode(q, k_pages, v_pages, block_table, lengths, schedule, layout, interpret=backend == "interpret")
    return out, k_pages, v_pages
