"""The one attention entry point the engine calls, over packed heads of per-head widths.

``prefill`` and ``decode`` dispatch between the pure-jnp reference (below) and the Pallas kernels
(``kvjax.pallas``). Every KV head ``g`` attends with its own K width and V width; queries of its group read one
copy of its K/V.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.cache import write_pages
from kvjax.layout import HeadLayout


def _attend_groups(q, k, v, mask, layout: HeadLayout):
    """q [B, T, q_cols], k [B, S, k_cols], v [B, S, v_cols], mask [B, T, S] -> [B, T, out_cols]."""
    b, t, _ = q.shape
    g_size, scale = layout.group_size, 1.0 / math.sqrt(layout.head_dim)
    starts = zip(HeadLayout.offsets(layout.k_widths, g_size), HeadLayout.offsets(layout.k_widths),
                 HeadLayout.offsets(layout.v_widths))
    outs = []
    for (kw, vw), (qo, ko, vo) in zip(zip(layout.k_widths, layout.v_widths), starts):
        qg = q[..., qo:qo + g_size * kw].reshape(b, t, g_size, kw)
        scores = jnp.einsum("btgd,bsd->bgts", qg, k[..., ko:ko + kw]).astype(jnp.float32) * scale
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bgts,bsd->btgd", probs, v[..., vo:vo + vw])
        outs.append(out.astype(q.dtype).reshape(b, t, g_size * vw))
    return jnp.concatenate(outs, axis=-1)


def _visible(q_pos, k_pos, window):
    """Key at ``k_pos`` is visible from a query at ``q_pos``: causal, and inside the sliding window if any."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def _full_width(layout: HeadLayout) -> HeadLayout:
    """The layout attention computes in once a Palu latent K has been rebuilt to full heads."""
    return dataclasses.replace(layout, k_widths=(layout.head_dim,) * layout.num_kv_heads)


def causal_attention(q, k, v, layout: HeadLayout, rebuild=None):
    """Causal attention of T fresh tokens among themselves (full forward and prefill), packed layout.

    ``rebuild`` (Palu layers only) expands the cached pre-RoPE K latent to full post-RoPE heads first.
    """
    pos = jnp.arange(q.shape[1])
    if rebuild is not None:
        k, layout = rebuild(k, jnp.broadcast_to(pos, k.shape[:2])), _full_width(layout)
    mask = _visible(pos[:, None], pos[None, :], layout.sliding_window)
    return _attend_groups(q, k, v, jnp.broadcast_to(mask, (q.shape[0], *mask.shape)), layout)


def paged_decode_attention(q, k_pages, v_pages, block_table, lengths, layout: HeadLayout, rebuild=None):
    """One new query per sequence against its cached tokens.

    q [B, q_cols]; k_pages [num_pages, page_size, k_cols], v_pages likewise; block_table [B, pages_per_seq];
    lengths [B] tokens in the cache per sequence, the new token (at position length-1) included.
    """
    b = q.shape[0]
    k = k_pages[block_table].reshape(b, -1, k_pages.shape[-1])
    v = v_pages[block_table].reshape(b, -1, v_pages.shape[-1])
    k_pos = jnp.arange(k.shape[1])[None, :]
    if rebuild is not None:  # Palu: every step rebuilds every cached K from its latent
        k, layout = rebuild(k, jnp.broadcast_to(k_pos, k.shape[:2])), _full_width(layout)
    mask = _visible((lengths - 1)[:, None], k_pos, layout.sliding_window) & (k_pos < lengths[:, None])
    return _attend_groups(q[:, None], k, v, mask[:, None], layout)[:, 0]


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
