"""Tensor parallelism on JAX's own machinery (issue 38, item 1), first form: a model's full causal forward over a
1-D mesh of devices (axis "tp"), in the Megatron layout. Each device holds its placed KV heads' columns of q, k and v
and rows of o (``shards``, ``placement``), its share of the MLP (gate and up columns, down rows), and runs the layer
inside one ``shard_map`` with explicit specs; one ``psum`` after attention and one after the MLP sum the partial
outputs (XLA's all-reduce; NCCL on GPUs). A bias after a ``psum`` (o's, down's) is held by the first device only, so
it is added once. No hand-written communication.

Not yet in this form (issue 38's next steps, ``bench/notes/2026-12-03-live-default-and-placement.md``): the
embedding and lm_head are replicated (vocabulary-parallel next); compressed models, whose devices' heads have
different widths and so need one padded local layout for the one SPMD program, are refused in one line; the engine,
its page pools and its kernels are single-device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.models.transformer import Transformer, separate_params
from kvjax.ops.prefill.reference import causal_attention
from kvjax.parallel.placement import Placement, layout_bytes, place
from kvjax.parallel.shards import columns, even_split

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A model split over ``mesh``: the local module's ``graphdef`` (one device's share, the same on every device),
    its ``state`` with every array stacked over the devices on a leading axis sharded along "tp", and the
    ``placement`` that chose each device's heads."""

    mesh: Mesh
    graphdef: nnx.GraphDef
    state: nnx.State
    placement: Placement


def shard(model, devices: int) -> Sharded:
    """``model`` (a ``kvjax.Model``) split over the first ``devices`` devices by byte-balanced placement
    (``placement.place``); refused in one line where this form cannot split it."""
    cfg = model.config
    if model.plan is not None:
        raise ValueError("tensor parallelism runs uncompressed models for now; compressed ones are not supported yet")
    available = len(jax.devices())
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= available:
        raise ValueError(f"tensor_parallel must be 1..{available} (the devices JAX sees), got {devices!r}")
    if cfg.num_kv_heads % devices:
        raise ValueError(f"{cfg.num_kv_heads} KV heads cannot be shared evenly by {devices} devices")
    placement = place(layout_bytes(list(model.layouts)), devices)
    per, _ = even_split(cfg.intermediate_size, devices)
    local_cfg = dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // devices,
        num_kv_heads=cfg.num_kv_heads // devices,
        intermediate_size=per,
    )
    local = nnx.eval_shape(lambda: Transformer(local_cfg, dtype=model.dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(local)
    params = separate_params(model.module)
    mesh = Mesh(np.asarray(jax.devices()[:devices]), (AXIS,))
    spread = NamedSharding(mesh, PartitionSpec(AXIS))
    for path, var in nnx.to_flat_state(state):
        parts = [_part(params[path], path, model.layouts, placement, d, per) for d in range(devices)]
        want = tuple(var.get_value().shape)
        if any(tuple(p.shape) != want for p in parts):
            raise AssertionError(f"{path}: a device's share has shape {parts[0].shape}, the local module {want}")
        var.set_value(jax.device_put(jnp.stack([jnp.asarray(p) for p in parts]), spread))
    return Sharded(mesh, graphdef, state, placement)


def _part(x, path: tuple, layouts, placement: Placement, device: int, per: int):
    """Device ``device``'s share of parameter ``x`` at ``path`` (the separate form's names)."""
    if path[0] != "layers":
        return x  # embedding, final norm, lm_head: replicated in this form
    layer, owner, name, kind = path[1], path[2], path[3] if len(path) > 3 else None, path[-1]
    heads = placement.heads[layer, device]
    layout = layouts[layer]
    if owner == "attn" and name in ("q", "k", "v"):
        cols = columns(layout, heads, {"q": "q_full", "k": "k_full", "v": "v"}[name])
        return x[..., cols]
    if owner == "attn" and name == "o":
        if kind == "bias":
            return x if device == 0 else jnp.zeros_like(x)
        return x[columns(layout, heads, "o")]
    if owner == "mlp" and name in ("gate", "up"):
        return _padded(x, x.ndim - 1, per * placement.devices)[..., device * per : (device + 1) * per]
    if owner == "mlp" and name == "down":
        if kind == "bias":
            return x if device == 0 else jnp.zeros_like(x)
        return _padded(x, 0, per * placement.devices)[device * per : (device + 1) * per]
    return x  # norms (Gemma's per-head q/k norms too): replicated


def _padded(x, axis: int, size: int):
    """``x`` with zeros appended along ``axis`` up to ``size`` (an MLP width the devices do not divide)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def logits(sharded: Sharded, tokens) -> jax.Array:
    """float32 logits [B, T, V] of the full causal forward of ``tokens`` [B, T] over the devices: the model's
    ``Model.logits``, up to the order of the all-reduce's sums."""
    return _logits(sharded.graphdef, sharded.mesh, sharded.state, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logits(graphdef, mesh, state, tokens):
    def local(state, tokens):
        module = nnx.merge(graphdef, jax.tree.map(lambda x: x[0], state))
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

        def attend(i, q, k, v, rebuild=None, rotation=None):
            return causal_attention(q, k, v, module.layouts[i], rebuild)

        hidden = module.hidden(tokens, positions, attend, reduce=lambda y: jax.lax.psum(y, AXIS))
        return module.logits(hidden)

    spec = PartitionSpec(AXIS)
    run = jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec()), out_specs=PartitionSpec(), check_vma=False)
    return run(state, tokens)
