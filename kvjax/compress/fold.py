"""Folding a rank plan into the weights, with jitted functions: the compressed model is built once, offline.

V's rotation goes into W_v (and b_v) and W_o, so V is produced short and read back short at no run-time cost.
ZACK's Q/K rotation cannot pass through the position-dependent RoPE, so it is stored per group and applied right
after RoPE (``Attention.rotate_qk``). Palu's K factorisation puts ``W_k R`` in the K projection and ``R^T`` in
``k_up``, which rebuilds K before RoPE at every attention call.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.model import Model
from kvjax.models.transformer import Transformer


@functools.partial(jax.jit, static_argnames=("widths", "group_size"))
def fold_v(wv, bv, wo, rot, *, widths, group_size):
    """W_v [E, Hkv*d] -> [E, sum k_v]; b_v likewise; W_o [H*d, E] -> [G*sum k_v, E] (packed query-head order)."""
    hkv, d, _ = rot.shape
    wv_heads = wv.reshape(wv.shape[0], hkv, d)
    new_wv = jnp.concatenate([wv_heads[:, g] @ rot[g, :, :w] for g, w in enumerate(widths)], axis=-1)
    new_bv = None if bv is None else jnp.concatenate(
        [bv.reshape(hkv, d)[g] @ rot[g, :, :w] for g, w in enumerate(widths)])
    wo_heads = wo.reshape(hkv * group_size, d, -1)
    new_wo = jnp.concatenate([rot[j // group_size, :, :widths[j // group_size]].T @ wo_heads[j]
                              for j in range(hkv * group_size)], axis=0)
    return new_wv, new_bv, new_wo


@functools.partial(jax.jit, static_argnames=("widths",))
def fold_k_lowrank(wk, bk, rot, *, widths):
    """Palu: W_k(g) [E, d] -> W_k(g) R_k [E, k] (packed), b_k likewise, and per-group k_up = R_k^T [k, d]."""
    hkv, d, _ = rot.shape
    wk_heads = wk.reshape(wk.shape[0], hkv, d)
    down = jnp.concatenate([wk_heads[:, g] @ rot[g, :, :w] for g, w in enumerate(widths)], axis=-1)
    bias = None if bk is None else jnp.concatenate([bk.reshape(hkv, d)[g] @ rot[g, :, :w]
                                                    for g, w in enumerate(widths)])
    return down, bias, [rot[g, :, :w].T for g, w in enumerate(widths)]


def fold(model: Model, plan, rotations: dict[str, np.ndarray]) -> Model:
    """A new model whose weights carry ``plan``'s truncated rotations (``rotations``: kind -> R [L, Hkv, d, d])."""
    dtype = model.dtype
    old = dict(nnx.to_flat_state(nnx.state(model.module, nnx.Param)))
    module = nnx.eval_shape(lambda: Transformer(model.config, plan=plan, dtype=dtype, rngs=nnx.Rngs(0)))
    new = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    f32 = lambda path: None if path not in old else old[path].get_value().astype(jnp.float32)  # noqa: E731
    values = {}
    for i, layout in enumerate(module.layouts):
        a = ("layers", i, "attn")
        rot_v = jnp.asarray(rotations["v"][i], jnp.float32)
        wv, bv, wo = fold_v(f32((*a, "v", "kernel")), f32((*a, "v", "bias")), f32((*a, "o", "kernel")), rot_v,
                            widths=layout.v_widths, group_size=layout.group_size)
        values.update({(*a, "v", "kernel"): wv, (*a, "o", "kernel"): wo})
        if bv is not None:
            values[(*a, "v", "bias")] = bv
        if plan.method == "zack":
            for g, w in enumerate(layout.k_widths):
                values[(*a, "qk_rotation", g)] = jnp.asarray(rotations["qk"][i, g, :, :w])
        else:
            down, bias, ups = fold_k_lowrank(f32((*a, "k", "kernel")), f32((*a, "k", "bias")),
                                             jnp.asarray(rotations["k_pre"][i], jnp.float32), widths=layout.k_widths)
            values[(*a, "k", "kernel")] = down
            if bias is not None:
                values[(*a, "k", "bias")] = bias
            values.update({(*a, "k_up", g): up for g, up in enumerate(ups)})
    for path, var in new.items():
        value = values.get(path)
        if value is None:
            value = old[path].get_value()
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise AssertionError(f"folded {path} has shape {value.shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(value, dtype))
    return Model(module, model.tokenizer, plan)
