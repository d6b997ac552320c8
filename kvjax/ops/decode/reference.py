"""The decode op's jnp reference: one new query per sequence against its paged cache (the engine's "reference"
backend runs it; ``kernel.paged_decode`` must equal it)."""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops import quant_paging
from kvjax.ops.grouped import attend_groups, full_width, visible


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
        k, layout = rebuild(k, jnp.broadcast_to(k_pos, k.shape[:2])), full_width(layout)
    mask = visible((lengths - 1)[:, None], k_pos, layout.sliding_window) & (k_pos < lengths[:, None])
    return attend_groups(q[:, None], k, v, mask[:, None], layout)[:, 0]


def quantized_decode_attention(q, pages, tail, fmt, block_table, lengths, layout: HeadLayout):
    """One new query per sequence against its quantized cache (``quant_paging``), the new token already written:
    row i's first ``lengths[i] // page_size`` pages dequantized from ``pages`` [num_pages, page_bytes] through its
    block table, then the ``lengths[i] % page_size`` tokens of tail row i (row i is slot i) exact.

    q [B, q_cols]; tail [B, page_size, k_cols + v_cols]; ``fmt``: the layer's ``quant.PageFormat``. The fused
    kernel (``quant_kernel``) must equal it."""
    rows = jnp.arange(q.shape[0])
    k, v = quant_paging.gather(pages, tail, fmt, block_table, rows, lengths, q.dtype)
    k_pos = jnp.arange(k.shape[1])[None, :]
    mask = visible((lengths - 1)[:, None], k_pos, layout.sliding_window) & (k_pos < lengths[:, None])
    return attend_groups(q[:, None], k, v, mask[:, None], layout)[:, 0]
