"""Banded ZACK's decode queries for every band at once: one GEMM a layer outside the kernel, which then reads the
query of each step's band as plain ZACK's kernel reads its one query (DESIGN.md section 7, "Banded bases").

``band_queries`` gives sequence s's packed query for keys of band b, ``q_b = U^T RoPE(-b W) q_post``, as row
``b * B + s``: the product of ``band_table`` (cos and sin of each band's start angle) by one [d, B * q_cols] matrix
of q and the basis. The projection's work thus leaves the kernel (bench/results/kernels.md "Banded decode kernel"),
for G / W more bytes read than the keys' (6% at W = 64, G = 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout


def band_table(bands: int, band: int, inv_freq):
    """float32 [bands, d]: cos then sin of each band's start angle (b * band * theta_p), in float32 as RoPE's
    reference computes its angles (``models.rope.apply_rope``)."""
    starts = (jnp.arange(bands, dtype=jnp.int32) * band).astype(jnp.float32)
    angle = starts[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=1)


def band_queries(q, basis, inv_freq, band: int, layout: HeadLayout, bands: int, scale: float = 1.0):
    """[bands * B, q_cols] in q's dtype: row ``b * B + s`` is sequence s's packed query for keys of band b, times
    ``scale``.

    q [B, H * d] whole post-RoPE heads; basis [d, k_cols] the layer's packed directions
    (``models.rotation.QKRotation.matrix``); inv_freq [d/2] RoPE's frequencies. The product runs in q's dtype
    (float32 at full precision) with float32 sums."""
    b, d = q.shape[0], layout.head_dim
    half = d // 2
    heads, cols = layout.packed_columns()
    qh = q.reshape(b, layout.num_heads, d).astype(jnp.float32)[:, heads]  # [B, q_cols, d]
    q1, q2 = qh[..., :half], qh[..., half:]
    u = basis.astype(jnp.float32)[:, cols].T  # [q_cols, d]
    u1, u2 = u[:, :half], u[:, half:]
    m = jnp.concatenate([u1 * q1 + u2 * q2, u1 * q2 - u2 * q1], axis=-1) * scale  # [B, q_cols, d]
    table = band_table(bands, band, inv_freq).astype(q.dtype)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # M whole before the product: fused into the GEMM's prologue (a gather and float32 math a tile), the product
    # ran at 16 TFLOP/s, 130 us a layer at W = 64 on the H200 (bench/results/kernels.md "Banded decode kernel")
    m = jax.lax.optimization_barrier(m.astype(q.dtype))
    out = jnp.einsum("nd,bcd->nbc", table, m, preferred_element_type=jnp.float32, precision=precision)
    return out.astype(q.dtype).reshape(bands * b, layout.q_cols)
