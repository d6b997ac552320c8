"""Palu's decode in one kernel (Pallas, Triton lowering): each tile of cached K latent is rebuilt to full K, rotated
by RoPE and scored without leaving the chip, as Palu's authors fuse it (the Palu paper, section 3.4), so ZACK is
compared against Palu's best decode. ``palu_decode`` equals ``reference.paged_decode_attention`` with the layer's K
rebuild; ``PaluDecodeOp`` is the engine's op (no host schedule).

One program per (sequence, KV head, split), heads in one launch per K tile (``head_classes``); each sequence takes
the splits this step's live rows need (``live_splits``). With ``band`` (banded ZACK: ``models.latent.LatentK``),
each token's angle is its band's start, not its own position. A program computes its trig once: each loop step's
angles come from the last step's by angle addition (bench/results/kernels.md "Palu's decode kernel: no trig in the
loop").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.pallas_util import (
    LOG2E,
    MASK,
    NOWHERE,
    dot_precision,
    load_rows,
    merge_splits,
    online_update,
    page_rows,
    store_rows,
    whole_block,
)
from kvjax.ops.tiles import pow2_floor, tile

ROWS = 16  # query rows per program: a GQA group (G <= 16) padded to the tensor cores' smallest M
STEP, WARPS = 32, 4  # tokens a loop step and warps: the best measured (bench/results/kernels.md "Palu's decode kernel")
MAX_SPLITS, TARGET_PROGRAMS = 16, 1024  # the grid's splits per sequence; the programs live rows should fill


@functools.cache
def head_classes(layout: HeadLayout) -> tuple[tuple[int, ...], ...]:
    """The layer's KV heads grouped by K tile (``tiles.tile`` of the latent width), narrowest first: each class is
    one launch whose rebuild multiplies by its own tile, not the layer's widest (as fast as one launch at the
    widest tile on the 8B shape's plan, bench/results/kernels.md "Palu's decode kernel", and no padded ``up``)."""
    by_tile: dict[int, list[int]] = {}
    for g, w in enumerate(layout.k_widths):
        by_tile.setdefault(tile(w), []).append(g)
    return tuple(tuple(by_tile[t]) for t in sorted(by_tile))


@functools.cache
def _head_table(layout: HeadLayout, heads: tuple[int, ...]) -> np.ndarray:
    """The ``columns.head_columns`` rows of ``heads`` for full-width queries (run-time values, so layers with the
    same tiles share the compiled kernel)."""
    return columns.head_columns(layout, heads, q_width=layout.head_dim)


@functools.cache
def _row_widths(layout: HeadLayout) -> np.ndarray:
    """``columns.row_widths`` with full-width queries."""
    return columns.row_widths(layout, q_cols=layout.num_heads * layout.head_dim)


def default_splits(batch: int, num_kv_heads: int, target_programs: int = TARGET_PROGRAMS) -> int:
    """Splits per sequence so that about ``target_programs`` programs run (a power of two, 1 to ``MAX_SPLITS``)."""
    return int(min(MAX_SPLITS, pow2_floor(max(1, target_programs // (batch * num_kv_heads)))))


def live_splits(lengths, num_kv_heads: int, splits: int, target_programs: int = TARGET_PROGRAMS):
    """``default_splits`` of the rows with a length (int32 scalar, traced), at most ``splits``: inactive rows of a
    padded batch do no work, so they must not thin the live rows' splits."""
    live = jnp.maximum(jnp.sum(lengths > 0), 1)
    options = 2 ** jnp.arange(MAX_SPLITS.bit_length(), dtype=jnp.int32)  # 1, 2, 4, ... MAX_SPLITS
    fits = (options <= splits) & (options * live * num_kv_heads <= target_programs)
    return jnp.max(jnp.where(fits, options, 1)).astype(jnp.int32)


def _kernel(
    lengths_ref,
    used_ref,
    heads_ref,
    widths_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    up_ref,
    freq_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    group,
    page_size,
    head_dim,
    k_tile,
    v_tile,
    step,
    splits,
    window,
    scale,
    band,
    interpret,
):
    seq, slot, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_heads = pl.num_programs(1)  # the class's heads
    half = head_dim // 2
    dtype = k_ref.dtype
    precision = dot_precision(dtype)
    q_off, k_off, v_off, _, k_width, v_width = columns.read_head(heads_ref, slot)
    q_cols, k_cols, v_cols, _ = columns.read_widths(widths_ref)
    length = lengths_ref[seq]

    rows = jnp.arange(ROWS)
    real = rows < group
    seqs = jnp.full((ROWS,), seq)
    halves = jnp.arange(half)[None, :]
    q_at = (q_off + rows * head_dim)[:, None]  # full-width queries: head h's start at h * G * d

    def load_q(offset):
        q = load_rows(q_ref, seqs, q_cols, q_at + offset, halves, None, real)
        return (q.astype(jnp.float32) * (scale * LOG2E)).astype(dtype)  # scores come out in log2 units

    q1, q2 = load_q(0), load_q(half)
    up_rows = slot * k_tile + jnp.arange(k_tile)
    up1 = load_rows(up_ref, up_rows, head_dim, 0, halves)  # [k_tile, d/2], zero past the head's width
    up2 = load_rows(up_ref, up_rows, head_dim, half, halves)
    freq = plgpu.load(freq_ref.at[jnp.arange(half)])[None, :]  # [1, d/2] float32
    # each token's angle: its position, or its band's start (a step starts at a multiple of itself, so a band of
    # at least a step holds the whole step, and a narrower one divides it)
    offsets = jnp.arange(step)
    if band is not None:
        offsets = offsets // band * band if band < step else jnp.zeros_like(offsets)
    offset_angle = offsets.astype(jnp.float32)[:, None] * freq
    cos_in, sin_in = jnp.cos(offset_angle), jnp.sin(offset_angle)  # [step, d/2]: in-step offsets, once a program

    per_step = step // page_size
    pages = pl.cdiv(length, page_size)
    used = used_ref[0]  # splits this step's sequences take (<= splits); a program past them reads nothing
    per_split = pl.cdiv(pl.cdiv(pages, used), per_step) * per_step
    lo = split * per_split * page_size
    hi = jnp.minimum((split + 1) * per_split * page_size, length)
    visible_from = jnp.maximum(length - window, 0) if window else 0
    if window:
        lo = jnp.maximum(lo, visible_from // step * step)
    k_cols_ok = jnp.arange(k_tile)[None, :] < k_width
    v_cols_ok = jnp.arange(v_tile)[None, :] < v_width

    # the angle a step's tokens start from (its first token's, or its band's start) moves by ``jump`` from one step
    # to the next (every step; with bands of a step or more, at each band's end), by angle addition: the step's
    # cosines and sines come from the last step's, so the loop computes no trig (which took 63% of its
    # instructions, bench/results/kernels.md "Palu's decode kernel: no trig in the loop")
    wide_band = band is not None and band >= step
    jump = jnp.float32(band if wide_band else step) * freq
    c_jump, s_jump = jnp.cos(jump), jnp.sin(jump)

    def body(j, carry):
        acc, m, l, c0, s0 = carry
        first = lo + j * step
        tok = first + jnp.arange(step)
        valid = (tok < hi) & (tok >= visible_from)
        row = page_rows(table_ref, seq, tok, page_size, valid)
        latent = load_rows(k_ref, row, k_cols, k_off, jnp.arange(k_tile)[None, :], k_cols_ok, valid)
        k1 = plgpu.dot(latent, up1, precision=precision)  # float32, where the reference rounds to the cache's dtype
        k2 = plgpu.dot(latent, up2, precision=precision)
        cos = c0 * cos_in - s0 * sin_in
        sin = s0 * cos_in + c0 * sin_in
        r1 = (k1 * cos - k2 * sin).astype(dtype)
        r2 = (k2 * cos + k1 * sin).astype(dtype)
        s = plgpu.dot(q1, r1, trans_b=True, precision=precision) + plgpu.dot(q2, r2, trans_b=True, precision=precision)
        s = jnp.where(valid[None, :], s, MASK)
        v = load_rows(v_ref, row, v_cols, v_off, jnp.arange(v_tile)[None, :], v_cols_ok, valid).astype(dtype)
        acc, m, l = online_update((acc, m, l), s, v, None, precision)
        c1, s1 = c0 * c_jump - s0 * s_jump, s0 * c_jump + c0 * s_jump
        if wide_band:  # the angle moves at a band's end only
            moves = (first + step) % band == 0
            c1, s1 = jnp.where(moves, c1, c0), jnp.where(moves, s1, s0)
        return acc, m, l, c1, s1

    start = (lo // band * band if wide_band else lo).astype(jnp.float32) * freq
    carry = (
        jnp.zeros((ROWS, v_tile), jnp.float32),
        jnp.full((ROWS,), MASK, jnp.float32),
        jnp.zeros((ROWS,), jnp.float32),
        jnp.cos(start),
        jnp.sin(start),
    )
    acc, m, l, _, _ = lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), step), body, carry)

    part = ((seq * num_heads + slot) * splits + split) * group + rows
    store_rows(acc_ref, part, v_tile, 0, jnp.arange(v_tile)[None, :], acc, None, real, interpret=interpret)
    part = jnp.where(real, part, NOWHERE if interpret else 0)
    plgpu.store(m_ref.at[part], m, mask=real)
    plgpu.store(l_ref.at[part], l, mask=real)


@functools.cache
def _packed_index(layout: HeadLayout) -> np.ndarray:
    """For each packed output column (head g's queries side by side, each ``v_widths[g]`` wide), its place in the
    classes' merged outputs laid side by side ([class heads, G, the class's V tile] each)."""
    g_size, where, start = layout.group_size, {}, 0
    for heads in head_classes(layout):
        v_tile = tile(max(layout.v_widths[g] for g in heads))
        for i, g in enumerate(heads):
            where[g] = (start + i * g_size * v_tile, v_tile)
        start += len(heads) * g_size * v_tile
    index = [
        where[g][0] + q * where[g][1] + c
        for g, w in enumerate(layout.v_widths)
        for q in range(g_size)
        for c in range(w)
    ]
    return np.asarray(index, np.int32)


def _merge(acc, m, l, heads: int, group: int, splits: int, v_tile: int):
    """A class's partial softmax states [B * heads * splits * G, ...] -> [B, heads * G * v_tile] float32."""
    acc = acc.reshape(-1, heads, splits, group, v_tile)
    out = merge_splits(acc, m.reshape(-1, heads, splits, group), l.reshape(-1, heads, splits, group))
    return out.reshape(out.shape[0], -1)


@functools.partial(
    jax.jit, static_argnames=("layout", "splits", "step", "num_warps", "num_stages", "band", "interpret")
)
def palu_decode(
    q,
    k_pages,
    v_pages,
    block_table,
    lengths,
    up,
    inv_freq,
    layout: HeadLayout,
    *,
    splits: int = 1,
    target_programs: int | None = TARGET_PROGRAMS,
    step: int = STEP,
    num_warps: int = WARPS,
    num_stages: int = 2,
    band: int | None = None,
    interpret: bool = False,
):
    """One new query per sequence against its Palu-compressed paged cache; equal to
    ``reference.paged_decode_attention`` with the layer's K rebuild (``models.latent.LatentK``; ``band`` is its
    ``band``: banded ZACK keys turned by their band's start angle).

    q [B, H*d] (post-RoPE, full heads); k_pages [num_pages, page_size, k_cols] the K latent, v_pages
    [num_pages, page_size, v_cols]; block_table [B, pages_per_seq]; lengths [B] (the new token included); up: each
    KV head's [k_widths[g], d] (``LatentK.up``); inv_freq [d/2]. Heads run in one launch per K tile
    (``head_classes``); each sequence takes ``live_splits`` of the grid's ``splits`` (about ``target_programs``
    programs over the rows of nonzero length), or all of them with ``target_programs=None`` (then a row's result
    depends on that row alone). Returns [B, out_cols] in q's dtype; rows of length 0 are zero."""
    b = q.shape[0]
    page_size = k_pages.shape[1]
    hkv, g, d = layout.num_kv_heads, layout.group_size, layout.head_dim
    if g > ROWS or step % page_size or len(up) != hkv or any(u.shape[1] != d for u in up):
        raise ValueError(f"palu_decode: group {g} <= {ROWS}, step {step} a multiple of {page_size}, up per KV head")
    if band is not None and (band < 1 or (step % band if band < step else band % step)):
        raise ValueError(f"palu_decode: a band divides the step ({step}) or is a multiple of it, got {band}")
    lengths, block_table = lengths.astype(jnp.int32), block_table.astype(jnp.int32)
    flat = [q.reshape(-1), k_pages.reshape(-1), v_pages.reshape(-1)]
    freq = jnp.asarray(inv_freq, jnp.float32)
    if target_programs is None:
        used = jnp.full((1,), splits, jnp.int32)
    else:
        used = live_splits(lengths, hkv, splits, target_programs).reshape(1)
    outs = []
    for heads in head_classes(layout):
        k_tile, v_tile = tile(max(layout.k_widths[h] for h in heads)), tile(max(layout.v_widths[h] for h in heads))
        ups = jnp.stack([jnp.pad(up[h], ((0, k_tile - up[h].shape[0]), (0, 0))) for h in heads])
        parts = b * len(heads) * splits * g
        kernel = functools.partial(
            _kernel,
            group=g,
            page_size=page_size,
            head_dim=d,
            k_tile=k_tile,
            v_tile=v_tile,
            step=step,
            splits=splits,
            window=layout.sliding_window,
            scale=1.0 / math.sqrt(d),
            band=band,
            interpret=interpret,
        )
        args = [lengths, used, jnp.asarray(_head_table(layout, heads)), jnp.asarray(_row_widths(layout)), block_table]
        args += flat
        args += [ups.astype(k_pages.dtype).reshape(-1), freq]
        out_shape = [
            jax.ShapeDtypeStruct((parts * v_tile,), jnp.float32),
            jax.ShapeDtypeStruct((parts,), jnp.float32),
            jax.ShapeDtypeStruct((parts,), jnp.float32),
        ]
        acc, m, l = pl.pallas_call(
            kernel,
            grid=(b, len(heads), splits),
            in_specs=[whole_block(x) for x in args],
            out_specs=[whole_block(x) for x in out_shape],
            out_shape=out_shape,
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name="kvjax_palu_decode",
        )(*args)
        outs.append(_merge(acc, m, l, len(heads), g, splits, v_tile))
    merged = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)
    return merged[:, _packed_index(layout)].astype(q.dtype)


class PaluDecodeOp:
    """Palu layers' decode as the engine holds it: no host schedule (``schedule`` returns None; each program splits its
    sequence by the length it reads, into as many splits as this step's live rows need: ``live_splits``; with
    ``batch_invariant``, into all ``splits``, so a row's result never depends on the others), ``run`` attends one layer
    with its K rebuild."""

    def __init__(
        self,
        *,
        splits: int | None = None,
        batch_invariant: bool = False,
        step: int = STEP,
        num_warps: int = WARPS,
        interpret: bool = False,
    ):
        self.splits = MAX_SPLITS if splits is None else validate.integer("splits", splits, low=1)
        self.target_programs = None if batch_invariant else TARGET_PROGRAMS
        self.step, self.num_warps, self.interpret = step, num_warps, interpret

    def schedule(self, lengths) -> None:
        return None

    def run(self, q, k_pages, v_pages, block_table, lengths, rebuild, layout: HeadLayout):
        """One layer's attention; ``rebuild`` holds the layer's ``up`` and ``inv_freq`` (the model's
        ``LatentK``); see ``palu_decode``."""
        return palu_decode(
            q,
            k_pages,
            v_pages,
            block_table,
            lengths,
            rebuild.up,
            rebuild.inv_freq,
            layout,
            splits=self.splits,
            target_programs=self.target_programs,
            step=self.step,
            num_warps=self.num_warps,
            band=rebuild.band,
            interpret=self.interpret,
        )
