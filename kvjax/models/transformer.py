"""The decoder-only transformer shared by Llama, Mistral and Falcon (Flax nnx).

The model knows nothing about caches or kernels: each layer hands its packed, post-RoPE q/k and v to an
``attend(layer, q, k, v)`` callback and projects whatever comes back. A full causal forward passes a dense
attention; the engine passes one that writes the paged cache and reads it.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.layout import HeadLayout
from kvjax.models.config import ModelConfig
from kvjax.models.rope import apply_rope, inverse_frequencies

AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _init(rngs, shape, dtype, scale=0.02):
    return jax.random.normal(rngs.params(), shape, dtype) * scale


class Linear(nnx.Module):
    """``y = x @ kernel + bias``; kernel stored [in, out]."""

    def __init__(self, n_in, n_out, *, bias, dtype, rngs):
        self.kernel = nnx.Param(_init(rngs, (n_in, n_out), dtype))
        self.bias = nnx.Param(jnp.zeros((n_out,), dtype)) if bias else None

    def __call__(self, x):
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class Norm(nnx.Module):
    """RMSNorm (Llama/Mistral) or LayerNorm (Falcon), computed in float32 as transformers does."""

    def __init__(self, dim, *, kind, eps, dtype):
        self.kind, self.eps = kind, eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if kind == "layer" else None

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        if self.kind == "rms":
            y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)).astype(x.dtype)
            return self.scale[...] * y
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        h, kv, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q = Linear(e, h * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.k = Linear(e, kv * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.v = Linear(e, kv * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o = Linear(h * d, e, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, inv_freq, layout: HeadLayout, attend: AttendFn, layer: int):
        b, t, _ = x.shape
        q = apply_rope(self.q(x).reshape(b, t, layout.num_heads, layout.head_dim), positions, inv_freq)
        k = apply_rope(self.k(x).reshape(b, t, layout.num_kv_heads, layout.head_dim), positions, inv_freq)
        return self.o(attend(layer, q.reshape(b, t, -1), k.reshape(b, t, -1), self.v(x)))


class MLP(nnx.Module):
    """SiLU-gated (Llama/Mistral) or GELU (Falcon) feed-forward."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        e, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate = Linear(e, f, bias=bias, dtype=dtype, rngs=rngs) if cfg.arch != "falcon" else None
        self.up = Linear(e, f, bias=bias, dtype=dtype, rngs=rngs)
        self.down = Linear(f, e, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        if self.gate is None:
            return self.down(jax.nn.gelu(self.up(x), approximate=False))
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.parallel = cfg.parallel_block
        norm = dict(kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype)
        self.attn_norm = Norm(cfg.hidden_size, **norm)
        two_norms = not cfg.parallel_block or cfg.parallel_norms == 2
        self.mlp_norm = Norm(cfg.hidden_size, **norm) if two_norms else None
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, inv_freq, layout, attend, layer):
        h = self.attn_norm(x)
        a = self.attn(h, positions, inv_freq, layout, attend, layer)
        if self.parallel:  # Falcon: attention and MLP read the same residual
            return x + (self.mlp(h if self.mlp_norm is None else self.mlp_norm(x)) + a)
        x = x + a
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        """Random weights (normal, std 0.02); loaders build it under ``nnx.eval_shape`` and fill it instead."""
        self.config = cfg
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = Norm(cfg.hidden_size, kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        self.layouts = tuple(
            HeadLayout.uniform(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
            for _ in range(cfg.num_layers))

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn) -> jax.Array:
        """Final-norm hidden states [B, T, E] for ``tokens`` at ``positions`` (both int32 [B, T])."""
        cfg = self.config
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope)
        x = jnp.take(self.embed[...], tokens, axis=0)
        for i, block in enumerate(self.layers):
            x = block(x, positions, inv_freq, self.layouts[i], attend, i)
        return self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits for hidden states [..., E]."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return (hidden @ w).astype(jnp.float32)
