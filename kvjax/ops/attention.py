"""The engine's one attention entry point: write the new K/V into the pages, then run the op's kernel or, without
one (the "reference" backend, or a Palu layer), the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.paging import write_pages
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
):
    """Attention of prompt chunks [B, T, cols] (chunk b at positions ``starts[b]`` on, default 0) over themselves and
    the earlier chunks in the pages, their K/V written into the pages; returns (out, k_pages, v_pages). ``rebuild``
    (Palu layers) rebuilds full K from the cached latent: reference only. ``rotation`` (ZACK layers, with q and k
    per head): packs them first."""
    if rotation is not None:
        q, k = rotation.packed(q, k)
    if op is not None and rebuild is None:
        return op.run(q, k, v, layout, lengths, k_pages, v_pages, block_table, starts)
    b, t = q.shape[:2]
    offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = offsets if starts is None else starts[:, None] + offsets
    valid = offsets < lengths[:, None]
    k_pages = write_pages(k_pages, block_table, positions, k, valid)
    v_pages = write_pages(v_pages, block_table, positions, v, valid)
    if starts is None:
        return causal_attention(q, k, v, layout, rebuild), k_pages, v_pages
    return chunk_attention(q, layout, k_pages, v_pages, block_table, starts, rebuild), k_pages, v_pages


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
    op: DecodeOp | None = None,
    schedule=None,
    rebuild=None,
    rotation=None,
):
    """One new token per sequence: its K/V [B, cols] written at position ``lengths - 1``, then its query [B, q_cols]
    against the whole paged cache; returns (out, k_pages, v_pages). ``schedule``: this layer's (``op.plan``).
    ``rotation`` (ZACK layers, with q and k per head): the kernel takes the wide q (one GEMM), the reference the
    packed one."""
    kernel = op is not None and rebuild is None
    if rotation is not None:
        q, k = rotation.wide(q, k) if kernel else rotation.packed(q, k)
    positions, valid = (lengths - 1)[:, None], jnp.ones((q.shape[0], 1), bool)
    k_pages = write_pages(k_pages, block_table, positions, k[:, None], valid)
    v_pages = write_pages(v_pages, block_table, positions, v[:, None], valid)
    if op is None or not kernel:
        return paged_decode_attention(q, k_pages, v_pages, block_table, lengths, layout, rebuild), k_pages, v_pages
    return op.run(q, k_pages, v_pages, block_table, lengths, schedule, layout), k_pages, v_pages
