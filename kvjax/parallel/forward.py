"""Tensor parallelism on JAX's own machinery (issue 38, item 1): a model's causal forward over a 1-D mesh (axis "tp")
in the Megatron layout, one ``shard_map`` a layer with one ``psum`` after attention and one after the MLP; no
hand-written communication.

``shard`` splits a ``kvjax.Model`` (uncompressed or plain ZACK) into a ``Sharded``: each device's placed KV heads
(``placement``, ``shards``) padded to one shape, its share of the MLP and of the vocabulary. ``logits`` equals
``Model.logits`` up to the order of the all-reduce's sums. ``hidden``, ``gathered_logits`` and ``spmd`` are the
pieces the engine's steps run in (``EngineConfig.tensor_parallel``). ``check`` refuses in one line what this form
cannot split (Palu and banded plans among them). Several processes each put only their own devices' shares.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.models.config import ModelConfig
from kvjax.models.transformer import Transformer, separate_params
from kvjax.ops.prefill.reference import causal_attention
from kvjax.parallel.placement import Placement, even, layout_bytes, place
from kvjax.parallel.shards import columns, even_split, into, padded_layout, widest_first

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Sharded:
    """A model split over ``mesh``: the local module's ``graphdef`` (one device's share, the same on every device),
    its ``state`` with every array stacked over the devices on a leading axis sharded along "tp", and the
    ``placement`` that chose each device's heads; ``vocab_size``: the model's (each device holds a padded share)."""

    mesh: Mesh
    graphdef: nnx.GraphDef
    state: nnx.State
    placement: Placement
    vocab_size: int
    layouts: tuple  # each layer's local (padded) layout: what every device's cache holds
    config: ModelConfig  # the local module's config (its heads, MLP and vocabulary shares)


@dataclasses.dataclass(frozen=True)
class _LocalPlan:
    """What ``Transformer`` reads of a rank plan, for one device's share: the method and each layer's padded local
    widths (``shards.padded_widths``) and its Q/K basis kind (a pair's query directions are shared like the keys')."""

    method: str | None
    widths: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    band: None = None
    qk_basis: str | None = None

    def layer_widths(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.widths[layer]


def shard(model, devices: int, seed: int = 0, params: dict | None = None, placement: str = "bytes") -> Sharded:
    """``model`` (a ``kvjax.Model``: uncompressed or plain ZACK) split over the first ``devices`` devices by
    byte-balanced placement (``placement.place``), each device's heads widest first and padded to one local layout
    (``shards.padded_layout``); refused in one line where this form cannot split it. A model of shapes only (its
    module built under ``nnx.eval_shape``: ``shapes_only``) gets random shares drawn on each device from ``seed``,
    never whole on one: how a benchmark runs a shape larger than one device holds (Llama-3.1-70B's 141 GB).
    ``params``: the weights by path (``separate_params``' names) where they are not the module's, as
    ``io.saved.restore_sharded`` reads them spread over the devices; each device's share is cut from them and put
    on its device alone. ``placement``: "bytes" (``placement.place``) or "even" (``placement.even``, the even-count
    baseline it is measured against)."""
    check(model, devices, placement)
    cfg, method = model.config, None if model.plan is None else model.plan.method
    placed, order, locals_ = device_layouts(model.layouts, devices, placement)
    per, _ = even_split(cfg.intermediate_size, devices)
    vocab, _ = even_split(cfg.vocab_size, devices)
    local_cfg = dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // devices,
        num_kv_heads=max(1, cfg.num_kv_heads // devices),  # fewer heads than devices: one a device, replicated
        intermediate_size=per,
        vocab_size=vocab,
    )
    widths = tuple((lay.k_widths, lay.v_widths) for lay in locals_)
    plan = None if method is None else _LocalPlan(method, widths, qk_basis=model.plan.qk_basis)
    local = nnx.eval_shape(lambda: Transformer(local_cfg, plan=plan, dtype=model.dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(local)
    given = params is not None
    if params is None and not shapes_only(model):
        params = separate_params(model.module)
    mesh = Mesh(np.asarray(jax.devices()[:devices]), (AXIS,))
    spread = NamedSharding(mesh, PartitionSpec(AXIS))
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        want = tuple(var.get_value().shape)
        if params is None:
            var.set_value(_random_shares(mesh, (devices, *want), var.get_value().dtype, seed * 100003 + i))
            continue
        share = functools.partial(
            _part, params[path], path, model.layouts, locals_, order, per=per, shape=want, replicas=placed.replicas
        )
        mine = [(d, device) for d, device in enumerate(mesh.devices) if device.process_index == jax.process_index()]
        parts = [jax.device_put(share(d, devices=devices)[None], device) for d, device in mine]  # this host's
        if any(tuple(p.shape[1:]) != want for p in parts):
            raise AssertionError(f"{path}: a device's share has shape {parts[0].shape[1:]}, the local module {want}")
        var.set_value(jax.make_array_from_single_device_arrays((devices, *want), spread, parts))
        if given:  # cutting a spread array runs collectives: one program in flight at a time (XLA's CPU devices
            jax.block_until_ready(parts)  # share a few threads, and interleaved collective programs can starve)
    return Sharded(mesh, graphdef, state, placed, cfg.vocab_size, tuple(locals_), local_cfg)


def device_layouts(layouts, devices: int, placement: str = "bytes") -> tuple[Placement, list, list]:
    """(placement, each layer's devices' heads widest first, each layer's padded local layout): which heads each
    device holds (by bytes, ``placement.place``, or ``even``) and the one layout every device runs."""
    placed = (place if placement == "bytes" else even)(layout_bytes(list(layouts)), devices)
    order = widest_first(placed)
    return placed, order, [padded_layout(layout, heads, placed.replicas) for layout, heads in zip(layouts, order)]


def check(model, devices, placement: str = "bytes") -> None:
    """Refuse, in one line, a split this form cannot make: Palu and banded plans, more devices than JAX sees, KV heads
    the devices do not divide (or, fewer heads than devices, that cannot be replicated evenly: ``placement``)."""
    method = None if model.plan is None else model.plan.method
    if method not in (None, "zack") or getattr(model.plan, "band", None) is not None:
        raise ValueError("tensor parallelism runs uncompressed and plain ZACK models for now, not Palu or banded ones")
    available = len(jax.devices())
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= available:
        platform = jax.devices()[0].platform
        hint = " (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N shows N)" if platform == "cpu" else ""
        raise ValueError(
            f"tensor_parallel must be 1..{available}, the {platform} devices JAX sees here{hint}; got {devices!r}"
        )
    if placement not in ("bytes", "even"):
        raise ValueError(f"head placement must be 'bytes' or 'even', got {placement!r}")
    kv, group = model.config.num_kv_heads, model.config.num_heads // model.config.num_kv_heads
    if kv >= devices and kv % devices:
        raise ValueError(f"{kv} KV heads cannot be shared evenly by {devices} devices")
    if kv < devices and (devices % kv or group % (devices // kv)):
        raise ValueError(
            f"{kv} KV heads cannot be replicated on {devices} devices: each head's {group} query heads must split "
            f"evenly among the {devices // kv} devices that would hold it"
        )


def shapes_only(model) -> bool:
    """Whether ``model``'s parameters are shapes without values (its module built under ``nnx.eval_shape``)."""
    return isinstance(model.module.embed.get_value(), jax.ShapeDtypeStruct)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _random_shares(mesh: Mesh, shape: tuple, dtype, seed) -> jax.Array:
    """Normal values times 0.02 of ``shape`` (devices first), each device drawing its own share (JAX's partitionable
    threefry) into its memory."""
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.02
    return jax.lax.with_sharding_constraint(x.astype(dtype), NamedSharding(mesh, PartitionSpec(AXIS)))


def _part(x, path: tuple, layouts, locals_, order, device: int, *, per: int, devices: int, shape, replicas: int = 1):
    """Device ``device``'s share of parameter ``x`` at ``path`` (the separate form's names), of shape ``shape``;
    ``replicas``: devices that hold each KV head (the placement's: device d is replica d % replicas of its head)."""
    if path[0] in ("embed", "lm_head"):  # by vocabulary: the embedding's rows, lm_head's columns
        axis = 0 if path[0] == "embed" else 1
        return _share(x, axis, shape[axis], device, devices)
    if path[0] != "layers":
        return x  # the final norm: replicated
    layer, owner, name, kind = path[1], path[2], path[3], path[-1]
    if name in ("o", "down") and kind == "bias":  # added after the psum: by one device only
        return x if device == 0 else jnp.zeros_like(x)
    if owner == "mlp":  # gate and up by columns, down by rows
        axis = 0 if name == "down" else x.ndim - 1
        return _share(x, axis, per, device, devices)
    heads, layout, local = order[layer][device], layouts[layer], locals_[layer]
    mine = (device % replicas, replicas)  # the replica's query heads of each group
    if owner == "attn" and name in ("q", "k"):  # full width before RoPE and the rotation: no padding
        return x[..., columns(layout, heads, {"q": "q_full", "k": "k_full"}[name], *mine)]
    if owner == "attn" and name in ("v", "qk_rotation", "q_rotation", "o"):  # the cached widths: padded locally
        which = {"v": "v", "qk_rotation": "k", "q_rotation": "k", "o": "o"}[name]
        src, dst = into(layout, heads, local, which, *mine)
        if name == "o":
            return jnp.zeros(shape, x.dtype).at[dst].set(x[src])
        return jnp.zeros(shape, x.dtype).at[..., dst].set(x[..., src])
    return x  # norms (Gemma's per-head q/k norms too): replicated


def _share(x, axis: int, size: int, device: int, devices: int):
    """Device ``device``'s ``size`` rows (or columns) along ``axis`` of ``x``, padded with zeros to ``size x
    devices`` (an MLP width or a vocabulary the devices do not divide)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size * devices - x.shape[axis])
    return jax.lax.slice_in_dim(jnp.pad(x, pad), device * size, (device + 1) * size, axis=axis)


def logits(sharded: Sharded, tokens) -> jax.Array:
    """float32 logits [B, T, V] of the full causal forward of ``tokens`` [B, T] over the devices: the model's
    ``Model.logits``, up to the order of the all-reduce's sums."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return _logits(sharded.graphdef, sharded.mesh, sharded.vocab_size, sharded.state, tokens)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _logits(graphdef, mesh, vocab_size: int, state, tokens):
    def local(state, tokens):
        module = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

        def attend(i, q, k, v, rebuild=None, rotation=None):
            if rotation is not None:
                q, k = rotation.packed(q, k)
            return causal_attention(q, k, v, module.layouts[i], rebuild)

        return (gathered_logits(module, hidden(module, tokens, positions, attend), vocab_size),)

    return spmd(local, mesh, stacked=(True, False), returns=(False,))(state, tokens)[0]


def hidden(module: Transformer, tokens, positions, attend) -> jax.Array:
    """``Transformer.hidden`` on one device's share, inside ``shard_map``: each device looks up the tokens its share
    of the vocabulary holds (zeros for the rest) and a ``psum`` joins them; every layer's partial attention and MLP
    outputs are summed by a ``psum`` (``Block``'s ``reduce``). The result is the same on every device."""
    rows = module.config.vocab_size  # this device's share of the vocabulary
    mine = tokens - jax.lax.axis_index(AXIS) * rows
    held = (mine >= 0) & (mine < rows)
    x = module.embed_tokens(jnp.where(held, mine, 0))  # a token another device holds looks up zeros here
    x = jax.lax.psum(jnp.where(held[..., None], x, jnp.zeros_like(x)), AXIS)
    return module.hidden_from(x, positions, attend, reduce=lambda y: jax.lax.psum(y, AXIS))


def gathered_logits(module: Transformer, hidden, vocab_size: int) -> jax.Array:
    """float32 logits [..., vocab_size] on every device: each device's share of the vocabulary, ``all_gather``ed
    (the padded rows past ``vocab_size`` cut)."""
    return jax.lax.all_gather(module.logits(hidden), AXIS, axis=-1, tiled=True)[..., :vocab_size]


def spmd(fn, mesh: Mesh, stacked: tuple[bool, ...], returns: tuple[bool, ...] | bool):
    """``fn`` run on every device of ``mesh`` inside one ``shard_map`` (``check_vma=False``: a ``pallas_call`` has no
    sharding rule). ``stacked[i]``: argument i is per device, every leaf with a leading device axis sharded along
    "tp" (parameters, cache pools), which ``fn`` sees without it; otherwise it is the same on every device (step
    inputs). ``returns[j]`` says the same of ``fn``'s outputs (a tuple): a per-device output regains the axis, a
    whole one must be equal on every device (sampled tokens, computed from gathered logits); a bool: ``fn`` returns
    one output, so flagged."""
    single = isinstance(returns, bool)
    flags = (returns,) if isinstance(returns, bool) else returns

    def local(*args):
        args = tuple(jax.tree.map(lambda x: x[0], a) if s else a for a, s in zip(args, stacked, strict=True))
        out = (fn(*args),) if single else fn(*args)
        out = tuple(jax.tree.map(lambda x: x[None], o) if s else o for o, s in zip(out, flags, strict=True))
        return out[0] if single else out

    spec, whole = PartitionSpec(AXIS), PartitionSpec()
    out_specs = tuple(spec if s else whole for s in flags)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(spec if s else whole for s in stacked),
        out_specs=out_specs[0] if single else out_specs,
        check_vma=False,
    )


def stacked_zeros(mesh: Mesh, make):
    """``make()``'s pytree of arrays (one device's cache), zeros on every device of ``mesh``, stacked on a leading
    axis sharded along "tp": each device allocates only its own share."""
    shapes = jax.eval_shape(make)
    n = mesh.devices.size
    spread = NamedSharding(mesh, PartitionSpec(AXIS))

    @functools.partial(jax.jit, out_shardings=jax.tree.map(lambda _: spread, shapes))
    def zeros():
        return jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), shapes)

    return zeros()


def local_heads(x, axis: int):
    """This device's run of ``x``'s heads along ``axis`` (inside ``shard_map``): an array over every device's KV heads
    in placed order (device ``d``'s at ``d * n`` onward, ``n`` = heads a device), as the host's per-head pages keep
    them (``runtime.head_pages``)."""
    n = x.shape[axis] // jax.lax.axis_size(AXIS)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(AXIS) * n, n, axis)


def all_heads(x, axis: int):
    """Every device's heads along ``axis``, in placed order (inside ``shard_map``): ``local_heads``' inverse."""
    return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)
