"""Attention over packed heads of per-head widths, in jnp: the math every reference (and so every kernel) shares.

Every KV head ``g`` attends with its own K width and V width; the queries of its group read one copy of its K/V.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout


def head_logits(q, k, layout: HeadLayout, g: int):
    """Scaled float32 logits [B, group, T, S] of KV head ``g``'s query group: packed q [B, T, q_cols] against packed
    k [B, S, k_cols] (what attention takes its softmax of, and eviction scores: ``kvjax.eviction.metrics``)."""
    b, t, _ = q.shape
    kw, size = layout.k_widths[g], layout.group_size
    qo, ko = HeadLayout.offsets(layout.k_widths, size)[g], HeadLayout.offsets(layout.k_widths)[g]
    qg = q[..., qo : qo + size * kw].reshape(b, t, size, kw)
    logits = jnp.einsum("btgd,bsd->bgts", qg, k[..., ko : ko + kw]).astype(jnp.float32)
    return logits * (1.0 / math.sqrt(layout.head_dim))


def attend_groups(q, k, v, mask, layout: HeadLayout):
    """q [B, T, q_cols], k [B, S, k_cols], v [B, S, v_cols], mask [B, T, S] (or [B, Hkv, T, S]: one per KV head, as
    eviction leaves them) -> [B, T, out_cols]."""
    b, t, _ = q.shape
    outs = []
    for g, (vw, vo) in enumerate(zip(layout.v_widths, HeadLayout.offsets(layout.v_widths))):
        scores = head_logits(q, k, layout, g)
        scores = jnp.where((mask[:, g] if mask.ndim == 4 else mask)[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bgts,bsd->btgd", probs, v[..., vo : vo + vw])
        outs.append(out.astype(q.dtype).reshape(b, t, layout.group_size * vw))
    return jnp.concatenate(outs, axis=-1)


def visible(q_pos, k_pos, window):
    """Key at ``k_pos`` is visible from a query at ``q_pos``: causal, and inside the sliding window if any."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def full_width(layout: HeadLayout) -> HeadLayout:
    """The layout attention computes in once a Palu latent K has been rebuilt to full heads."""
    return dataclasses.replace(layout, k_widths=(layout.head_dim,) * layout.num_kv_heads)
