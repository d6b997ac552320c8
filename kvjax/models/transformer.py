"""The decoder-only transformer shared by Llama, Mistral, Falcon and Gemma 3 (Flax nnx).

The model knows nothing about caches or kernels: each layer hands its post-RoPE q/k and v to an
``attend(layer, q, k, v)`` callback and projects whatever comes back. A full causal forward passes a dense
attention; the engine passes one that writes the paged cache and reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.layout import HeadLayout
from kvjax.models.config import ModelConfig
from kvjax.models.latent import LatentK
from kvjax.models.rope import apply_rope, inverse_frequencies
from kvjax.models.rotation import QKRotation, identity_rotation

# attend(layer, q, k, v, rebuild=None, rotation=None) -> attention output, packed (see kvjax.layout). q and k come
# packed, except from ZACK layers, which pass them per head (H*d and Hkv*d columns) with the ``rotation``
# (``rotation.QKRotation``) that packs them, so attention picks the form its op reads. ``rebuild`` is passed only
# by layers whose cached K attention turns back into full K (``latent.LatentK``: rebuild(latent, positions) -> full
# K): Palu's pre-RoPE latent, and banded ZACK's keys in their band's frame (q then comes per head, unprojected).
AttendFn = Callable[..., jax.Array]


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


class Joined(Linear):
    """Several ``Linear`` side by side as one (``names`` [i]'s output columns end at ``ends[i]``): one GEMM where
    there were several, fewer and wider launches in a decode step (bench/results/engine.md "Engine: joined
    projections")."""

    def __init__(self, parts: dict[str, Linear]):
        kernels = [part.kernel[...] for part in parts.values()]
        self.kernel = nnx.Param(jnp.concatenate(kernels, axis=-1))
        biases = [None if p.bias is None else p.bias[...] for p in parts.values()]
        self.bias = (
            None
            if all(b is None for b in biases)
            else nnx.Param(
                jnp.concatenate([jnp.zeros(k.shape[-1:], k.dtype) if b is None else b for b, k in zip(biases, kernels)])
            )
        )
        self.names = tuple(parts)
        self.ends = tuple(int(e) for e in np.cumsum([k.shape[-1] for k in kernels]))

    def parts(self, x) -> tuple[jax.Array, ...]:
        """Each part's output, in ``names`` order."""
        return tuple(self.split(self(x)).values())

    def split(self, value: jax.Array) -> dict[str, jax.Array]:
        """A kernel, bias or output of this module cut back into its parts', by name."""
        return dict(zip(self.names, jnp.split(value, self.ends[:-1], axis=-1), strict=True))


class Norm(nnx.Module):
    """RMSNorm (Llama/Mistral), Gemma's RMSNorm or LayerNorm (Falcon), computed in float32 as transformers does.

    ``kind`` "rms" returns ``scale * normalised(x)``; "gemma" returns ``(1 + scale) * normalised(x)`` (``scale``
    holds Gemma's weight, zero-centred) with the product in float32; "layer" adds ``bias``.
    """

    def __init__(self, dim, *, kind, eps, dtype):
        self.kind, self.eps = kind, eps
        self.scale = nnx.Param((jnp.zeros if kind == "gemma" else jnp.ones)((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype)) if kind == "layer" else None

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        if self.kind in ("rms", "gemma"):
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
            if self.kind == "gemma":
                return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
            return self.scale[...] * y.astype(x.dtype)
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention whose cached K/V may be narrower than the heads (``layout`` widths).

    ``method`` None: plain heads. "zack": q and k go to attention with the rotation into each group's leading
    ``k_widths[g]`` directions after RoPE (``qk_rotation`` [d, k_cols], ``rotation.QKRotation``), V comes out of
    ``v`` already rotated and truncated, and ``o`` reads it back, so attention runs on the short vectors. "palu"
    (the baseline): ``k`` outputs a pre-RoPE latent of ``k_widths[g]`` columns per head that attention rebuilds
    (``latent.LatentK``: ``k_up``, then RoPE) at every call. Gemma normalises every q and k head (``q_norm``,
    ``k_norm``) before RoPE; a normalised k cannot have its basis folded into ``k``, so Palu there projects the
    normed head onto it (``k_down`` [d, k_widths[g]] per head) before caching. ``band`` (ZACK only): each key is
    rotated by RoPE at its offset in its band of ``band`` positions and cached on the basis directions; attention
    reads it back turned by the band's start angle (``QKRotation.banded``). ``join`` holds ``q``, ``k`` and ``v``
    as one ``Joined`` projection (``qkv``), as a ``kvjax.Model`` does. ``pair`` (ZACK only): queries are projected on
    directions of their own (``q_rotation`` [d, k_cols]; a score-aware pair, ``RankPlan.qk_basis``).
    """

    def __init__(self, cfg: ModelConfig, layout: HeadLayout, method: str | None, *, dtype, rngs, band=None, pair=False):
        h, kv, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        bias = cfg.attention_bias
        self.method, self.band = method, band
        folded_k = method == "palu" and not cfg.gemma_norms  # Palu's basis folded into the K projection
        self.q: Linear | None = Linear(e, h * d, bias=bias, dtype=dtype, rngs=rngs)
        self.k: Linear | None = Linear(e, layout.k_cols if folded_k else kv * d, bias=bias, dtype=dtype, rngs=rngs)
        self.v: Linear | None = Linear(e, layout.v_cols, bias=bias, dtype=dtype, rngs=rngs)
        self.o = Linear(layout.out_cols, e, bias=bias, dtype=dtype, rngs=rngs)
        self.qkv: Joined | None = nnx.data(None)  # q, k and v as one, once ``join`` has run

        self.qk_rotation = nnx.Param(identity_rotation(layout, dtype)) if method == "zack" else None
        self.q_rotation = nnx.Param(identity_rotation(layout, dtype)) if method == "zack" and pair else None
        self.k_up = (
            nnx.List([nnx.Param(jnp.eye(w, d, dtype=dtype)) for w in layout.k_widths]) if method == "palu" else None
        )
        self.k_down = (
            nnx.List([nnx.Param(jnp.eye(d, w, dtype=dtype)) for w in layout.k_widths])
            if method == "palu" and not folded_k
            else None
        )
        qk_norm = dict(kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype)
        self.q_norm = Norm(d, **qk_norm) if cfg.gemma_norms else None
        self.k_norm = Norm(d, **qk_norm) if cfg.gemma_norms else None

    def join(self) -> None:
        """Hold q, k and v as one projection (``qkv``); calls after the first do nothing."""
        if self.qkv is None:
            assert self.q is not None and self.k is not None and self.v is not None
            self.qkv = Joined({"q": self.q, "k": self.k, "v": self.v})
            self.q = self.k = self.v = None

    def project(self, x) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k and v projections of ``x`` (k: Palu's latent where ``k`` folds its basis)."""
        if self.qkv is not None:
            q, k, v = self.qkv.parts(x)
            return q, k, v
        assert self.q is not None and self.k is not None and self.v is not None
        return self.q(x), self.k(x), self.v(x)

    def __call__(self, x, positions, inv_freq, layout: HeadLayout, attend: AttendFn, layer: int):
        b, t, _ = x.shape

        def heads(y, n, norm):
            y = y.reshape(b, t, n, layout.head_dim)
            return y if norm is None else norm(y)

        q, k, v = self.project(x)
        q = apply_rope(heads(q, layout.num_heads, self.q_norm), positions, inv_freq)
        if self.method == "palu":
            assert self.k_up is not None
            rebuild = LatentK(tuple(up[...] for up in self.k_up), inv_freq, layout)
            latent = k
            if self.k_down is not None:  # the normed pre-RoPE heads onto their bases
                normed = heads(latent, layout.num_kv_heads, self.k_norm)
                latent = jnp.concatenate([normed[:, :, g] @ down[...] for g, down in enumerate(self.k_down)], -1)
            return self.o(attend(layer, q.reshape(b, t, -1), latent, v, rebuild=rebuild))
        k_at = positions if self.band is None else positions % self.band  # banded: each key in its band's frame
        k = apply_rope(heads(k, layout.num_kv_heads, self.k_norm), k_at, inv_freq)
        q, k = q.reshape(b, t, -1), k.reshape(b, t, -1)
        if self.method == "zack":
            assert self.qk_rotation is not None
            query = None if self.q_rotation is None else self.q_rotation[...]
            rotation = QKRotation(self.qk_rotation[...], layout, query)
            if self.band is not None:  # cached: the band-frame key's columns; read back by the band's start angle
                return self.o(attend(layer, q, rotation.keys(k), v, rebuild=rotation.banded(inv_freq, self.band)))
            return self.o(attend(layer, q, k, v, rotation=rotation))
        return self.o(attend(layer, q, k, v))


class MLP(nnx.Module):
    """Gated feed-forward (SiLU: Llama/Mistral; GELU-tanh: Gemma) or plain GELU (Falcon)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        e, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.activation = cfg.activation
        self.gate = Linear(e, f, bias=bias, dtype=dtype, rngs=rngs) if cfg.activation != "gelu" else None
        self.up: Linear | None = Linear(e, f, bias=bias, dtype=dtype, rngs=rngs)
        self.down = Linear(f, e, bias=bias, dtype=dtype, rngs=rngs)
        self.gate_up: Joined | None = nnx.data(None)  # gate and up as one, once ``join`` has run

    def join(self) -> None:
        """Hold a gated MLP's gate and up projections as one (``gate_up``); calls after the first do nothing."""
        if self.gate is not None and self.up is not None:
            self.gate_up = Joined({"gate": self.gate, "up": self.up})
            self.gate = self.up = None

    def __call__(self, x):
        if self.gate_up is not None:
            gate, up = self.gate_up.parts(x)
        else:
            assert self.up is not None
            if self.gate is None:
                return self.down(jax.nn.gelu(self.up(x), approximate=False))
            gate, up = self.gate(x), self.up(x)
        act = jax.nn.gelu(gate, approximate=True) if self.activation == "gelu_tanh" else jax.nn.silu(gate)
        return self.down(act * up)


class Block(nnx.Module):
    """One decoder layer: pre-norm (Llama), parallel (Falcon), or Gemma's with norms after attention and MLP too."""

    def __init__(self, cfg: ModelConfig, layout: HeadLayout, method: str | None, *, dtype, rngs, band=None, pair=False):
        self.parallel = cfg.parallel_block
        norm = dict(kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype)
        self.attn_norm = Norm(cfg.hidden_size, **norm)
        two_norms = not cfg.parallel_block or cfg.parallel_norms == 2
        self.mlp_norm = Norm(cfg.hidden_size, **norm) if two_norms else None
        self.post_attn_norm = Norm(cfg.hidden_size, **norm) if cfg.gemma_norms else None
        self.post_mlp_norm = Norm(cfg.hidden_size, **norm) if cfg.gemma_norms else None
        self.attn = Attention(cfg, layout, method, dtype=dtype, rngs=rngs, band=band, pair=pair)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, inv_freq, layout, attend, layer, reduce=None):
        """``reduce`` (tensor parallelism): sums a device's partial attention and MLP outputs over the devices
        before they join the residual (one call each; Falcon's parallel block, one for both)."""
        reduce = reduce or (lambda y: y)
        h = self.attn_norm(x)
        a = self.attn(h, positions, inv_freq, layout, attend, layer)
        if self.parallel:  # Falcon: attention and MLP read the same residual
            return x + reduce(self.mlp(h if self.mlp_norm is None else self.mlp_norm(x)) + a)
        a = reduce(a)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = reduce(self.mlp(self.mlp_norm(x)))
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


def layer_layout(cfg: ModelConfig, plan, layer: int) -> HeadLayout:
    """Layer ``layer``'s cached head widths (``head_dim`` everywhere, or the plan's ranks) and sliding window."""
    if plan is None:
        return HeadLayout.uniform(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.window(layer))
    k_widths, v_widths = plan.layer_widths(layer)
    return HeadLayout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, k_widths, v_widths, cfg.window(layer))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, plan=None, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        """Random weights (normal, std 0.02); loaders build it under ``nnx.eval_shape`` and fill it instead.

        ``plan`` (a ``kvjax.compression.RankPlan``) gives every layer's head widths and the compression method.
        """
        self.config, self.method = cfg, None if plan is None else plan.method
        self.band = None if plan is None else plan.band
        pair = plan is not None and plan.qk_basis == "pair"
        self.layouts = tuple(layer_layout(cfg, plan, i) for i in range(cfg.num_layers))
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List(
            [
                Block(cfg, self.layouts[i], self.method, dtype=dtype, rngs=rngs, band=self.band, pair=pair)
                for i in range(cfg.num_layers)
            ]
        )
        self.final_norm = Norm(cfg.hidden_size, kind=cfg.norm, eps=cfg.norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )

    @property
    def rebuilt_k(self) -> bool:
        """Whether attention rebuilds full K from what the cache holds (``attend``'s ``rebuild``): Palu's latent,
        or a banded ZACK key turned back by its band's angle. The engine prefills such layers over rebuilt K; it
        decodes Palu's, and bands under 16, with Palu's kernel (``runtime.engine.Engine._build_ops``)."""
        return self.method == "palu" or self.band is not None

    def join(self) -> None:
        """Every layer's q/k/v and gate/up projections as one GEMM each (``Joined``), in place: the in-memory form
        of a model (``kvjax.Model`` joins what it is given). Each layer's separate weights are released as its
        joined ones are made, so memory grows by one layer's projections at most; checkpoints and the compression
        pipeline keep the separate form (``separate_params``)."""
        for block in self.layers:
            block.attn.join()
            block.mlp.join()

    def inv_freq(self, layer: int) -> np.ndarray:
        """float64 RoPE inverse frequencies [head_dim / 2] of layer ``layer`` (Gemma 3's local and global differ)."""
        return inverse_frequencies(self.config.head_dim, *self.config.layer_rope(layer))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The first layer's input [..., E] for token ids [...]: embeddings, times ``config.embed_scale`` if set."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        scale = self.config.embed_scale
        return x if scale is None else x * jnp.asarray(scale, x.dtype)  # in the weights' dtype, as transformers

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn, reduce=None) -> jax.Array:
        """Final-norm hidden states [B, T, E] for ``tokens`` at ``positions`` (both int32 [B, T]); ``reduce``: a
        tensor-parallel shard's sum over the devices (``Block``)."""
        return self.hidden_from(self.embed_tokens(tokens), positions, attend, reduce)

    def hidden_from(self, x: jax.Array, positions: jax.Array, attend: AttendFn, reduce=None) -> jax.Array:
        """``hidden`` from the first layer's input ``x`` [B, T, E] (``embed_tokens``' output, or a vocabulary-split
        shard's summed lookups)."""
        for i, block in enumerate(self.layers):
            x = block(x, positions, self.inv_freq(i), self.layouts[i], attend, i, reduce)
        return self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits for hidden states [..., E]."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head.kernel[...]
        return (hidden @ w).astype(jnp.float32)


def separate_params(module: Transformer) -> dict[tuple, jax.Array]:
    """``module``'s parameters by path as a freshly built ``Transformer`` names them, joined projections cut back
    into their parts (``("layers", 0, "attn", "q", "kernel")``, ...): what loaders fill, folding reads and
    checkpoints store."""
    out: dict[tuple, jax.Array] = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        owner: Any = module
        for key in path[:-1]:
            owner = owner[key] if isinstance(key, int) else getattr(owner, str(key))
        if isinstance(owner, Joined):
            out.update({(*path[:-2], name, path[-1]): x for name, x in owner.split(var.get_value()).items()})
        else:
            out[path] = var.get_value()
    return out
