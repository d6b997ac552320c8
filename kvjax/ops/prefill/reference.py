"""The prefill op's jnp references: causal attention of fresh prompts among themselves (the full forward and
calibration run it) and of prompt chunks over the pages (the engine's "reference" backend runs it);
``kernel.prefill_attention`` must equal both."""

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


def chunk_attention(q, layout: HeadLayout, k_pages, v_pages, block_table, starts, rebuild=None):
    """Causal attention of prompt chunks whose K/V (earlier chunks' and their own) are already in the pages: row i
    of chunk b sits at position ``starts[b] + i`` and sees the positions up to it (chunked prefill), packed layout."""
    b, t, _ = q.shape
    page_size = k_pages.shape[1]
    span = block_table.shape[1] * page_size

    def gather(pages):
        return pages[block_table].reshape(b, span, pages.shape[-1])

    k, v = gather(k_pages), gather(v_pages)
    k_pos = jnp.broadcast_to(jnp.arange(span, dtype=jnp.int32), (b, span))
    if rebuild is not None:
        k, layout = rebuild(k, k_pos), full_width(layout)
    q_pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    mask = visible(q_pos[:, :, None], k_pos[:, None, :], layout.sliding_window)
    return attend_groups(q, k, v, mask, layout)


def quantized_causal_attention(q, k, v, layout: HeadLayout, fmt, prompt: int = 0, chunk_tokens: int | None = None):
    """Causal attention of T tokens as a quantized cache serves each of them (``quant_paging``): a query reads a key
    round-tripped through ``fmt`` (a ``quant.PageFormat`` or any ``kv_schemes`` scheme) iff the key's page was full
    in the cache the query attended over, else exactly. A decoded token at m attends after its own write, so it
    reads pages before ``(m + 1) // page_size`` quantized; a token of the first ``prompt`` ones, prefilled in chunks
    of ``chunk_tokens`` (default: one chunk), reads its chunk exactly and the pages its chunk's start had filled
    quantized. Teacher-forced scoring of a quantized cache, and the engine's reference in tests."""
    t = q.shape[1]
    kq, vq = fmt.round_trip(q, k, v, layout)
    pos = jnp.arange(t)
    causal = visible(pos[:, None], pos[None, :], layout.sliding_window)
    cached = pos + 1  # tokens in the cache each query attends over
    if prompt:
        starts = pos // chunk_tokens * chunk_tokens if chunk_tokens else jnp.zeros_like(pos)
        cached = jnp.where(pos < prompt, starts, cached)
    quant = pos[None, :] // fmt.page_size < (cached // fmt.page_size)[:, None]
    mask = jnp.concatenate([causal & quant, causal & ~quant], axis=1)  # keys: the quantized copies, then exact
    both_k, both_v = jnp.concatenate([kq, k], axis=1), jnp.concatenate([vq, v], axis=1)
    return attend_groups(q, both_k, both_v, jnp.broadcast_to(mask, (q.shape[0], *mask.shape)), layout)
