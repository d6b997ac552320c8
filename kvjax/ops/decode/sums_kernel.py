"""The decode step's softmax weights added into each stored slot's sum (issue 37: "decode-time metrics come out of
the decode kernel, not a second pass"; Pallas, Triton lowering). ``head_kernel``'s weights output leaves each query
row's scores [B, Hkv, G, slots] (log2 units) and each row's merged denominator; ``add_weights`` turns the scores a
head sees into weights, squares them where asked (KV-Compress's full form), sums them over the group and adds them
to the head's sums, in place (the sums are aliased), reading only the slots a head stores.

Why a kernel, not jnp: XLA's fusion of the same epilogue read every slot a head may store, stored or not, and took
61 us a layer on an H100 at B32 x 8K (1.96 ms of an 11.5 ms step; bench/results/eviction.md "Eviction on the H100
(2026-12-06, third session)"), where the bytes of the stored slots ask a few. A program here takes one (sequence,
KV head) and one tile of slots, and does nothing for a tile past what the head stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.ops.pallas_util import MASK, NOWHERE, whole_block

TILE = 1024  # slots a program


def _kernel(
    raw_ref, lse_ref, lo_ref, hi_ref, sums_in_ref, sums_ref, *, group, block_g, cap, held, tile, square, interpret
):
    """Program (head row r, tile j): slots j * tile .. of row r's sums (``held`` a row) += the group's weights there
    (the scores ``cap`` a row)."""
    del sums_in_ref  # aliased to ``sums_ref``
    r, j = pl.program_id(0), pl.program_id(1)
    lo, hi = lo_ref[r], jnp.minimum(hi_ref[r], cap)
    start = j * tile

    @pl.when(start < hi)
    def _():
        slot = start + jnp.arange(tile)
        ok = (slot >= lo) & (slot < hi)
        rows = jnp.arange(block_g)
        real = rows < group
        lse = plgpu.load(lse_ref.at[r * group + jnp.where(real, rows, 0)], mask=real, other=0.0)
        mask = real[:, None] & ok[None, :]
        index = (r * group + rows[:, None]) * cap + slot[None, :]
        raw = plgpu.load(raw_ref.at[jnp.where(mask, index, 0) if interpret else index], mask=mask, other=MASK)
        w = jnp.where(mask, jnp.exp2(raw - lse[:, None]), 0.0)
        added = jnp.sum(w * w if square else w, axis=0)
        at = r * held + slot
        before = plgpu.load(sums_ref.at[jnp.where(ok, at, 0) if interpret else at], mask=ok, other=0.0)
        plgpu.store(sums_ref.at[jnp.where(ok, at, NOWHERE) if interpret else at], before + added, mask=ok)


@functools.partial(jax.jit, static_argnames=("square", "interpret"))
def add_weights(raw, lse, first, stored, sums, *, square: bool = False, interpret: bool = False):
    """``sums`` [B, Hkv, cap] float32 plus, on each head's slots ``first`` <= s < ``stored`` ([B, Hkv] int32; a row
    adding nothing gives ``stored`` 0), the group's softmax weights ``exp2(raw - lse)`` summed over the group (each
    squared first where ``square``): ``raw`` [B, Hkv, G, cap] the decode kernel's scores, ``lse`` [B, Hkv, G] their
    rows' log2 denominators; a head's slots past ``cap`` (the scores' last axis, at most the sums') add nothing.
    Equal to ``add_weights_reference``; the sums are updated in place where donated."""
    b, heads, group, cap = raw.shape
    held = sums.shape[-1]
    if sums.shape != (b, heads, held) or held < cap or lse.shape != (b, heads, group):
        raise ValueError(f"sums {sums.shape} and lse {lse.shape} do not match the scores {raw.shape}")
    tile = min(TILE, max(16, pl.next_power_of_2(cap)))
    inputs = [
        raw.astype(jnp.float32).reshape(-1),
        lse.astype(jnp.float32).reshape(-1),
        first.astype(jnp.int32).reshape(-1),
        stored.astype(jnp.int32).reshape(-1),
        sums.reshape(-1),
    ]
    block_g = max(2, pl.next_power_of_2(group))
    kernel = functools.partial(
        _kernel, group=group, block_g=block_g, cap=cap, held=held, tile=tile, square=square, interpret=interpret
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(inputs[-1].shape, jnp.float32),
        grid=(b * heads, pl.cdiv(cap, tile)),
        in_specs=[whole_block(x) for x in inputs],
        out_specs=whole_block(inputs[-1]),
        input_output_aliases={4: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kvjax_add_decode_weights",
    )(*inputs)
    return out.reshape(b, heads, held)


def weights_of(raw, lse, stored, first):
    """float32 [B, Hkv, G, slots]: the decode kernel's scores ``raw`` [B, Hkv, G, slots] (log2 units) as softmax
    weights under each row's ``lse`` [B, Hkv, G], 0 on slots a head does not see (past ``stored``, before ``first``):
    slots the kernel never wrote are masked, never read as numbers."""
    slot = jnp.arange(raw.shape[-1])[None, None, :]
    seen = ((slot < stored[..., None]) & (slot >= first[..., None]))[:, :, None, :]
    w = jnp.exp2(jnp.where(seen, raw, MASK) - lse[..., None])
    return jnp.where(seen, w, 0.0)


def add_weights_reference(raw, lse, first, stored, sums, *, square: bool = False):
    """``add_weights`` in jnp."""
    w = weights_of(raw, lse, stored, first)
    added = (w * w if square else w).sum(axis=2)
    return sums + jnp.pad(added, ((0, 0), (0, 0), (0, sums.shape[-1] - raw.shape[-1])))
