"""The jnp reference of attention over packed heads of per-head widths: the contract every kernel matches.

Every KV head ``g`` attends with its own K width and V width; the queries of its group read one copy of its K/V.
The full forward (``kvjax.Model.logits``), calibration and the engine's "reference" backend run these; the Pallas
kernels (``kvjax.pallas``) are tested against them.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

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
