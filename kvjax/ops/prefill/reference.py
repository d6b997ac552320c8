"""The prefill op's jnp reference: causal attention of fresh prompts among themselves (the full forward, calibration
and the engine's "reference" backend run it; ``kernel.prefill_attention`` must equal it)."""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops.grouped import attend_groups, full_width, visible


def causal_attention(q, k, v, layout: HeadLayout, rebuild=None):
    """Causal attention of T fresh tokens among themselves (full forward and prefill), packed layout.

    ``rebuild`` (Palu layers only) expands the cached pre-RoPE K latent to full post-RoPE heads first.
    """
    pos = jnp.arange(q.shape[1])
    if rebuild is not None:
        k, layout = rebuild(k, jnp.broadcast_to(pos, k.shape[:2])), full_width(layout)
    mask = visible(pos[:, None], pos[None, :], layout.sliding_window)
    return attend_groups(q, k, v, jnp.broadcast_to(mask, (q.shape[0], *mask.shape)), layout)
