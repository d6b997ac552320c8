"""The kernels kvjax is timed against, on the same shapes and inputs: cuDNN's attention through
``jax.nn.dot_product_attention`` (decode and causal prefill, on a contiguous uncompressed cache), JAX's Pallas
``paged_attention`` (deprecated in JAX, on the uncompressed paged cache) and Palu's decode (K cached as a low-rank
latent, rebuilt and RoPE'd every step). Each returns ``(fn, shared, per_call)`` for ``harness.time_calls``; the
comparisons are in bench/results/kernels.md "Decode kernel: time beside the floor" and "Prefill vs cuDNN"."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import HKV, HQ, D, queries, randn


def jax_paged_call(case, key, pages_per_block, splits):
    """JAX's Pallas paged_attention on the uncompressed cache (head-major pools, as it wants them)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    n = case.k.shape[0]
    k = case.k.reshape(n, case.page_size, HKV, D).transpose(2, 0, 1, 3)
    v = case.v.reshape(n, case.page_size, HKV, D).transpose(2, 0, 1, 3)

    def fn(k, v, lengths, q, table):
        return paged_attention(q, k, v, table, lengths, pages_per_compute_block=pages_per_block, k_splits=splits)

    qs = queries(key, (case.batch, HQ, D))
    per_call = [(q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(qs)]
    return fn, (k, v, jnp.asarray(case.lengths)), per_call


def cudnn_decode_call(case, key):
    """cuDNN decode over a contiguous uncompressed cache as long as the case's longest sequence."""
    ks = jax.random.split(key, 3)
    s = int(case.lengths.max())
    k = randn(ks[1], (case.batch, s, HKV, D))
    v = randn(ks[2], (case.batch, s, HKV, D))

    def fn(k, v, lengths, q):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")

    return fn, (k, v, jnp.asarray(case.lengths)), queries(ks[0], (case.batch, 1, HQ, D))


def cudnn_prefill_call(key, batch, t):
    """cuDNN causal attention of ``batch`` uncompressed prompts of ``t`` tokens."""
    ks = jax.random.split(key, 3)
    k = randn(ks[1], (batch, t, HKV, D))
    v = randn(ks[2], (batch, t, HKV, D))

    def fn(k, v, q):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return fn, (k, v), queries(ks[0], (batch, t, HQ, D), 4)


def palu_decode_call(case, layout, key):
    """(fn, shared, per_call, latent bytes, K rank, V rank) of Palu's decode: K latent rebuilt and RoPE'd each step."""
    ks = jax.random.split(key, 5)
    s = int(case.lengths.max())
    r = 16 * round(layout.k_cols / HKV / 16)
    rv = 16 * round(layout.v_cols / HKV / 16)
    k_lat = randn(ks[0], (case.batch, s, HKV, r))
    v_lat = randn(ks[1], (case.batch, s, HKV, rv))
    up = randn(ks[2], (HKV, r, D)) / math.sqrt(r)
    inv = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    ang = np.arange(s)[:, None] * inv[None]
    cos = jnp.asarray(np.concatenate([np.cos(ang)] * 2, -1), jnp.float32)
    sin = jnp.asarray(np.concatenate([np.sin(ang)] * 2, -1), jnp.float32)

    def fn(k_lat, v_lat, cos, sin, q, up):
        k = jnp.einsum("bshr,hrd->bshd", k_lat, up, preferred_element_type=jnp.float32)
        rot = jnp.concatenate([-k[..., D // 2 :], k[..., : D // 2]], -1)
        k = (k * cos[None, :, None] + rot * sin[None, :, None]).astype(jnp.bfloat16)
        sc = jnp.einsum("bhgd,bshd->bhgs", q, k, preferred_element_type=jnp.float32) / math.sqrt(D)
        p = jax.nn.softmax(sc, axis=-1).astype(jnp.bfloat16)
        return jnp.einsum("bhgs,bshr->bhgr", p, v_lat)

    nbytes = case.batch * s * HKV * (r + rv) * 2
    # each call gets its own up-projection too: a rebuild from shared inputs alone would be computed once per batch
    per_call = [(q, up * (1 + u / 64)) for u, (q,) in enumerate(queries(ks[3], (case.batch, HKV, HQ // HKV, D)))]
    return fn, (k_lat, v_lat, cos, sin), per_call, nbytes, r, rv
