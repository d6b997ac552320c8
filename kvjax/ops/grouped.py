"""Attention over packed heads of per-head widths, in jnp: the math every reference (and so every kernel) shares.

Every KV head ``g`` attends with its own K width and V width; the queries of its group read one copy of its K/V.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout


def attend_groups(q, k, v, mask, layout: HeadLayout):
    """q [B, T, q_cols], k [B, S, k_cols], v [B, S, v_cols], mask [B, T, S] -> [B, T, out_cols]."""
    b, t, _ = q.shape
    g_size, scale = layout.group_size, 1.0 / math.sqrt(layout.head_dim)
    starts = zip(
        HeadLayout.offsets(layout.k_widths, g_size),
        HeadLayout.offsets(layout.k_widths),
        HeadLayout.offsets(layout.v_widths),
    )
    outs = []
    for (kw, vw), (qo, ko, vo) in zip(zip(layout.k_widths, layout.v_widths), starts):
        qg = q[..., qo : qo + g_size * kw].reshape(b, t, g_size, kw)
        scores = jnp.einsum("btgd,bsd->bgts", qg, k[..., ko : ko + kw]).astype(jnp.float32) * scale
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bgts,bsd->btgd", probs, v[..., vo : vo + vw])
        outs.append(out.astype(q.dtype).reshape(b, t, g_size * vw))
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
