"""Folding a rank plan into the weights, with jitted functions: the compressed model is built once, offline.

V's basis goes into W_v (and b_v) and W_o, so V is produced short and read back short at no run-time cost. ZACK's
Q/K rotation cannot pass through the position-dependent RoPE, so it is stored per group and applied right after RoPE
(``Attention.rotate_qk``). Palu's K factorisation puts ``W_k down`` in the K projection and ``up`` in ``k_up``,
which rebuilds K before RoPE at every attention call.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.model import Model
from kvjax.models.transformer import Transformer


def _heads_times(w, down, widths):
    """W [E, Hkv*d] -> [E, sum k]: head g's columns times down[g][:, :k_g], packed."""
    hkv, d, _ = down.shape
    heads = w.reshape(*w.shape[:-1], hkv, d)
    return jnp.concatenate([heads[..., g, :] @ down[g, :, :k] for g, k in enumerate(widths)], axis=-1)


@functools.partial(jax.jit, static_argnames=("widths", "group_size"))
def fold_v(wv, bv, wo, down, up, *, widths, group_size):
    """W_v [E, Hkv*d] -> [E, sum k_v], b_v likewise, W_o [H*d, E] -> [G*sum k_v, E] (packed query-head order)."""
    hkv, d, _ = down.shape
    wo_heads = wo.reshape(hkv * group_size, d, -1)
    new_wo = jnp.concatenate([up[j // group_size, :widths[j // group_size]] @ wo_heads[j]
                              for j in range(hkv * group_size)], axis=0)
    return _heads_times(wv, down, widths), None if bv is None else _heads_times(bv, down, widths), new_wo


@functools.partial(jax.jit, static_argnames=("widths",))
def fold_k_lowrank(wk, bk, down, up, *, widths):
    """Palu: W_k(g) -> W_k(g) down[:, :k] (packed), b_k likewise, and per-group k_up = up[:k] [k, d]."""
    return (_heads_times(wk, down, widths), None if bk is None else _heads_times(bk, down, widths),
            [up[g, :k] for g, k in enumerate(widths)])


def fold(model: Model, plan, bases: dict) -> Model:
    """A new model whose weights carry ``plan``'s truncated bases (``bases``: {"k": Basis, "v": Basis})."""
    dtype = model.dtype
    old = dict(nnx.to_flat_state(nnx.state(model.module, nnx.Param)))
    module = nnx.eval_shape(lambda: Transformer(model.config, plan=plan, dtype=dtype, rngs=nnx.Rngs(0)))
    new = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    f32 = lambda path: None if path not in old else old[path].get_value().astype(jnp.float32)  # noqa: E731
    as_f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    values = {}
    for i, layout in enumerate(module.layouts):
        a = ("layers", i, "attn")
        wv, bv, wo = fold_v(f32((*a, "v", "kernel")), f32((*a, "v", "bias")), f32((*a, "o", "kernel")),
                            as_f32(bases["v"].down[i]), as_f32(bases["v"].up[i]),
                            widths=layout.v_widths, group_size=layout.group_size)
        values.update({(*a, "v", "kernel"): wv, (*a, "o", "kernel"): wo, (*a, "v", "bias"): bv})
        if plan.method == "zack":
            for g, k in enumerate(layout.k_widths):
                values[(*a, "qk_rotation", g)] = bases["k"].down[i, g, :, :k]
        else:
            down, bias, ups = fold_k_lowrank(f32((*a, "k", "kernel")), f32((*a, "k", "bias")),
                                             as_f32(bases["k"].down[i]), as_f32(bases["k"].up[i]),
                                             widths=layout.k_widths)
            values.update({(*a, "k", "kernel"): down, (*a, "k", "bias"): bias})
            values.update({(*a, "k_up", g): up for g, up in enumerate(ups)})
    for path, var in new.items():
        value = values.get(path)
        if value is None:
            value = old[path].get_value()
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise AssertionError(f"folded {path} has shape {value.shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(value, dtype))
    return Model(module, model.tokenizer, plan)
