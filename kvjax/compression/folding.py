"""Folding a rank plan into the weights, with jitted functions: the compressed model is built once, offline.

V's basis goes into W_v (and b_v) and W_o, so V is produced short and read back short at no run-time cost. ZACK's
Q/K rotation cannot pass through the position-dependent RoPE, so it is stored as one [d, k_cols] matrix (each
group's directions side by side, ``qk_rotation``) and applied right after RoPE (``rotation.QKRotation``); a
score-aware pair also stores the queries' own directions (``q_rotation``, from the basis's ``up``). Palu's K
factorisation puts ``W_k down`` in the K projection and ``up`` in ``k_up``, which rebuilds K before RoPE at every
attention call; where k is normed before RoPE (Gemma 3), ``down`` stays a projection of its own (``k_down``).

A plan with a ``head_order`` first permutes each layer's KV heads (with their query heads and W_o's rows, which
leaves the output unchanged), then folds the bases of the heads at their new positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.compression.once import jit_once
from kvjax.models.model import Model
from kvjax.models.rotation import packed_rotation
from kvjax.models.transformer import Transformer, separate_params


def _kept(widths, d: int) -> jnp.ndarray:
    """Indices of the first ``widths[g]`` of each head's ``d`` columns, packed head after head."""
    return jnp.asarray(np.concatenate([g * d + np.arange(w) for g, w in enumerate(widths)]))


@jit_once
def _heads_times(w, down):
    """W [..., Hkv*d] -> [..., Hkv*d]: head g's columns times down[g] (every column; the caller keeps the first
    ones of each head, so one compiled function serves every layer's widths)."""
    hkv, d, _ = down.shape
    heads = w.reshape(*w.shape[:-1], hkv, d)
    return jnp.einsum("...hd,hdk->...hk", heads, down, precision="highest").reshape(w.shape)


@jit_once(static_argnames=("group_size",))
def _up_times_wo(wo, up, *, group_size):
    """W_o [H*d, E] -> [H*d, E]: query head j's rows are up[j // G] @ W_o(j) (every row)."""
    hkv, d, _ = up.shape
    heads = wo.reshape(hkv, group_size, d, -1)
    return jnp.einsum("hkd,hjde->hjke", up, heads, precision="highest").reshape(wo.shape)


def fold_v(wv, bv, wo, down, up, *, widths, group_size):
    """W_v [E, Hkv*d] -> [E, sum k_v], b_v likewise, W_o [H*d, E] -> [G*sum k_v, E] (packed query-head order)."""
    d = down.shape[1]
    cols = _kept(widths, d)
    rows = _kept([w for w in widths for _ in range(group_size)], d)
    new_wv, new_bv = _heads_times(wv, down)[:, cols], None if bv is None else _heads_times(bv, down)[cols]
    return new_wv, new_bv, _up_times_wo(wo, up, group_size=group_size)[rows]


def fold_k_lowrank(wk, bk, down, up, *, widths):
    """Palu: W_k(g) -> W_k(g) down[:, :k] (packed), b_k likewise, and per-group k_up = up[:k] [k, d]."""
    cols = _kept(widths, down.shape[1])
    return (
        _heads_times(wk, down)[:, cols],
        None if bk is None else _heads_times(bk, down)[cols],
        [up[g, :k] for g, k in enumerate(widths)],
    )


def permute_heads(w: dict, order, group_size: int, head_dim: int) -> dict:
    """One layer's projections ``w`` ({(proj, "kernel" | "bias"): array or None}) with the KV heads in ``order``:
    the columns of q (G query heads per KV head), k and v and their biases, and the rows of o."""
    order = jnp.asarray(order)

    def heads(x, block):
        return x.reshape(*x.shape[:-1], -1, block)[..., order, :].reshape(x.shape)

    out = dict(w)
    for (proj, kind), x in w.items():
        if x is not None and proj in ("q", "k", "v"):
            out[proj, kind] = heads(x, (group_size if proj == "q" else 1) * head_dim)
    if w["o", "kernel"] is not None:  # [H * d, E]
        out["o", "kernel"] = heads(w["o", "kernel"].T, group_size * head_dim).T
    return out


def fold(model: Model, plan, bases: dict) -> Model:
    """A new model whose weights carry ``plan``'s truncated bases (``bases``: {"k": Basis, "v": Basis}), its KV
    heads in ``plan.layer_order``."""
    dtype = model.dtype
    old = separate_params(model.module)
    module = nnx.eval_shape(lambda: Transformer(model.config, plan=plan, dtype=dtype, rngs=nnx.Rngs(0)))
    new = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))

    def f32(path):
        return None if path not in old else old[path].astype(jnp.float32)

    values: dict[tuple, jax.Array] = {}
    for i, layout in enumerate(module.layouts):
        a = ("layers", i, "attn")
        order = list(plan.layer_order(i))
        w = {(p, kind): f32((*a, p, kind)) for p in ("q", "k", "v", "o") for kind in ("kernel", "bias")}
        if order != sorted(order):
            w = permute_heads(w, order, layout.group_size, layout.head_dim)
            values.update({(*a, p, kind): x for (p, kind), x in w.items() if p in ("q", "k") and x is not None})
        down, up = (
            {kind: jnp.asarray(getattr(b, which)[i], jnp.float32)[jnp.asarray(order)] for kind, b in bases.items()}
            for which in ("down", "up")
        )
        wv, bv, wo = fold_v(
            w["v", "kernel"],
            w["v", "bias"],
            w["o", "kernel"],
            down["v"],
            up["v"],
            widths=layout.v_widths,
            group_size=layout.group_size,
        )
        values.update({(*a, "v", "kernel"): wv, (*a, "o", "kernel"): wo, (*a, "v", "bias"): bv})
        if plan.method == "zack":
            values[(*a, "qk_rotation")] = packed_rotation(down["k"], layout.k_widths)
            if plan.qk_basis == "pair":  # queries on their own directions: up's rows (A^T), transposed
                values[(*a, "q_rotation")] = packed_rotation(jnp.swapaxes(up["k"], -1, -2), layout.k_widths)
        elif model.config.gemma_norms:  # k is normed before RoPE: the basis stays a projection of its own
            values.update({(*a, "k_down", g): down["k"][g, :, :k] for g, k in enumerate(layout.k_widths)})
            values.update({(*a, "k_up", g): up["k"][g, :k] for g, k in enumerate(layout.k_widths)})
        else:
            wk, bk, k_ups = fold_k_lowrank(w["k", "kernel"], w["k", "bias"], down["k"], up["k"], widths=layout.k_widths)
            values.update({(*a, "k", "kernel"): wk, (*a, "k", "bias"): bk})
            values.update({(*a, "k_up", g): k_up for g, k_up in enumerate(k_ups)})
    for path, var in new.items():
        value = values.get(path)
        if value is None:
            value = old[path]
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise AssertionError(f"folded {path} has shape {value.shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(value, dtype))
    old.clear()  # Model joins the projections layer by layer: each layer's separate copies go as it does
    values.clear()
    return Model(module, model.tokenizer, plan, model.source, kv_bits=model.kv_bits)
