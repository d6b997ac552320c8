"""Banded ZACK's decode queries for every band at once, made before the decode kernel, which then reads the query of
each step's band as plain ZACK's kernel reads its one query (DESIGN.md section 7, "Banded bases").

Sequence s's packed query for keys of band b, ``q_b = U^T RoPE(-b W) q_post``, is row ``b * B + s``. ``band_queries``
makes them in a Pallas kernel, a program for a block of one sequence's bands and one KV head (the query turned back
by each band's start angle, then one product by the head's basis columns), and only for the bands the sequence
reaches; ``band_queries_reference`` is the same product as one XLA GEMM a layer. Made apart from the decode kernel,
the projection costs G / W of the keys' bytes (bench/results/kernels.md "Banded decode kernel").
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.pallas_util import dot_precision, load_rows, store_rows, whole_block
from kvjax.ops.tiles import is_pow2, pow2_ceil, tile

BAND_BLOCK = 64  # bands a program turns and projects at once: the rows of its products


def band_table(bands: int, band: int, inv_freq):
    """float32 [bands, d]: cos then sin of each band's start angle (b * band * theta_p), in float32 as RoPE's
    reference computes its angles (``models.rope.apply_rope``)."""
    starts = (jnp.arange(bands, dtype=jnp.int32) * band).astype(jnp.float32)
    angle = starts[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.concatenate([jnp.cos(angle), jnp.sin(angle)], axis=1)


def band_queries(
    q,
    basis,
    inv_freq,
    band: int,
    layout: HeadLayout,
    bands: int,
    scale: float = 1.0,
    *,
    lengths=None,
    shared: tuple[HeadLayout, ...] | None = None,
    interpret: bool = False,
    block: int = BAND_BLOCK,
    piece: int | None = None,
    num_warps: int = 4,
    blocks: int = 1,
    seqs: int = 1,
):
    """[bands * B, q_cols] in q's dtype: row ``b * B + s`` is sequence s's packed query for keys of band b, times
    ``scale``, for every band b with ``b * band < lengths[s]`` (the rest of the rows are left unwritten; every
    band without ``lengths``).

    q [B, H * d] whole post-RoPE heads; basis [d, k_cols] the layer's packed directions
    (``models.rotation.QKRotation.matrix``); inv_freq [d/2] RoPE's frequencies. Each query is turned and scaled in
    float32, then multiplied by the basis in q's dtype with float32 sums. ``shared``: the layouts of every layer
    that runs this kernel (one compiled kernel for all, as the decode kernel's). Head dims whose half is no power
    of two of at least 16 (no Triton tile) take ``band_queries_reference``. ``block`` bands a program, ``piece``
    basis columns a product (None: the widest head's tile; pieces past a head's width are skipped),
    ``num_warps``, ``blocks`` (blocks of bands a program makes one after another, its queries and basis loaded
    once) and ``seqs`` (sequences a program makes, each block's angles and the basis loaded once for all) are the
    kernel's knobs: pieces of 32 columns ran 1.6-1.7x slower than one tile on the H200
    (bench/results/kernels.md "Banded decode kernel")."""
    d, b = layout.head_dim, q.shape[0]
    half = d // 2
    if not is_pow2(half, 16):
        return band_queries_reference(q, basis, inv_freq, band, layout, bands, scale)
    bands = operator.index(bands)
    shared = shared or (layout,)
    width_tile = max(tile(w) for lay in shared for w in lay.k_widths)
    piece = width_tile if piece is None else piece
    if not (is_pow2(block, 16) and is_pow2(piece, 16)):
        raise ValueError(f"block and piece must be powers of two >= 16, got {block} and {piece}")
    for name, value in (("blocks", blocks), ("seqs", seqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    seqs = min(seqs, b)
    block = min(block, max(16, pow2_ceil(bands)))
    blocks = min(blocks, pl.cdiv(bands, block))
    lengths = jnp.full((b,), bands * band, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    args = [
        lengths,
        jnp.asarray(columns.head_columns(layout)),
        jnp.asarray(columns.row_widths(layout)),
        band_table(bands, band, inv_freq).reshape(-1),
        q.reshape(-1),
        basis.astype(q.dtype).reshape(-1),
    ]
    kernel = functools.partial(
        _kernel,
        batch=b,
        group=layout.group_size,
        half=half,
        q_stride=layout.num_heads * d,
        width_tile=width_tile,
        piece=min(piece, width_tile),
        block=block,
        blocks=blocks,
        seqs=seqs,
        band=band,
        bands=bands,
        scale=scale,
        interpret=interpret,
    )
    out = jax.ShapeDtypeStruct((bands * b * layout.q_cols,), q.dtype)
    got = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(b, seqs), layout.num_kv_heads, pl.cdiv(bands, block * blocks)),
        in_specs=[whole_block(x) for x in args],
        out_specs=whole_block(out),
        out_shape=out,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kvjax_band_queries",
    )(*args)
    return got.reshape(bands * b, layout.q_cols)


def _kernel(
    lengths_ref,
    heads_ref,
    widths_ref,
    table_ref,
    q_ref,
    basis_ref,
    out_ref,
    *,
    batch,
    group,
    half,
    q_stride,
    width_tile,
    piece,
    block,
    blocks,
    seqs,
    band,
    bands,
    scale,
    interpret,
):
    """Program (i, h, j): for KV head h's G query heads, the bands j * blocks * block ... that each of sequences
    i * seqs ... reaches, ``block`` at a time. The queries (and the basis, in one tile) are loaded before the first
    product, and each block's angles once for all its sequences: a load written after a store waits behind it, and
    in so short a program loads in series were most of its time (bench/results/kernels.md "The band queries: the
    code as it stands, and what their time follows")."""
    head, first = pl.program_id(1), pl.program_id(2) * blocks * block
    seq_ids = [pl.program_id(0) * seqs + k for k in range(seqs)]
    lengths = [jnp.where(s < batch, lengths_ref[jnp.minimum(s, batch - 1)], 0) for s in seq_ids]
    longest = functools.reduce(jnp.maximum, lengths)

    @pl.when(first * band < longest)
    def _():
        q_off, k_off, k_width = columns.read_head(heads_ref, head, (columns.Q_OFF, columns.K_OFF, columns.K_WIDTH))
        q_cols, k_cols, _, _ = columns.read_widths(widths_ref)
        dims = jnp.arange(half)
        dtype = basis_ref.dtype
        precision = dot_precision(dtype)
        starts = [jnp.minimum(s, batch - 1) * q_stride + head * group * 2 * half for s in seq_ids]
        queries = [_group_queries(q_ref, at, group, half, scale) for at in starts]

        def basis_piece(start):  # basis columns start .. start + piece of the head: the columns, mask, [half, piece] x2
            cols = start + jnp.arange(piece)[None, :]
            cols_ok = cols < k_width
            u1 = load_rows(basis_ref, dims, k_cols, k_off, cols, cols_ok)
            u2 = load_rows(basis_ref, dims + half, k_cols, k_off, cols, cols_ok)
            return cols, cols_ok, u1, u2

        whole = basis_piece(0) if piece == width_tile else None

        def make(i, carry):  # the block of bands at = first + i * block ..., for every sequence that reaches it
            at = first + i * block
            rows = at + jnp.arange(block)
            rows_ok = rows < bands
            pair = jnp.arange(half)[None, :]
            cos = load_rows(table_ref, rows, 2 * half, 0, pair, None, rows_ok)  # [block, half]
            sin = load_rows(table_ref, rows, 2 * half, half, pair, None, rows_ok)

            def project(start, s, heads):  # basis columns start .. start + piece, for sequence s's query heads
                cols, cols_ok, u1, u2 = whole if whole is not None else basis_piece(start)
                rows_at = rows * batch + s  # the output rows of these bands of the sequence
                for g, (q1, q2) in enumerate(heads):
                    # RoPE(-bW) q: pair p's first half is cos q1 + sin q2, its second cos q2 - sin q1
                    t1 = (cos * q1 + sin * q2).astype(dtype)
                    t2 = (cos * q2 - sin * q1).astype(dtype)
                    out = plgpu.dot(t1, u1, precision=precision) + plgpu.dot(t2, u2, precision=precision)
                    at_row = q_off + g * k_width
                    store_rows(out_ref, rows_at, q_cols, at_row, cols, out, cols_ok, rows_ok, interpret=interpret)

            for s, length, heads in zip(seq_ids, lengths, queries, strict=True):
                # every head fills its first piece; a sequence past the batch has length 0
                reached = at * band < length
                pl.when(reached)(functools.partial(project, 0, s, heads))
                for start in range(piece, width_tile, piece):
                    pl.when(reached & (start < k_width))(functools.partial(project, start, s, heads))
            return carry

        if blocks == 1:
            make(0, 0)
        else:  # as many of the program's blocks as its longest sequence reaches
            reached = pl.cdiv(pl.cdiv(longest, band) - first, block)
            lax.fori_loop(0, jnp.minimum(reached, blocks), make, 0)


def _group_queries(q_ref, at, group: int, half: int, scale: float) -> list:
    """The G query heads from flat offset ``at`` of ``q_ref``: (first half, second half) each, [1, half] in float32
    times ``scale``."""
    dims = jnp.arange(half)
    heads = []
    for g in range(group):
        q1 = plgpu.load(q_ref.at[at + g * 2 * half + dims]).astype(jnp.float32)[None, :] * scale
        q2 = plgpu.load(q_ref.at[at + g * 2 * half + half + dims]).astype(jnp.float32)[None, :] * scale
        heads.append((q1, q2))
    return heads


def band_queries_reference(q, basis, inv_freq, band: int, layout: HeadLayout, bands: int, scale: float = 1.0):
    """``band_queries`` for every band as one XLA GEMM: the product of ``band_table`` by one [d, B * q_cols] matrix
    of q and the basis, in q's dtype (float32 at full precision) with float32 sums."""
    b, d = q.shape[0], layout.head_dim
    half = d // 2
    heads, cols = layout.packed_columns()
    qh = q.reshape(b, layout.num_heads, d).astype(jnp.float32)[:, heads]  # [B, q_cols, d]
    q1, q2 = qh[..., :half], qh[..., half:]
    u = basis.astype(jnp.float32)[:, cols].T  # [q_cols, d]
    u1, u2 = u[:, :half], u[:, half:]
    m = jnp.concatenate([u1 * q1 + u2 * q2, u1 * q2 - u2 * q1], axis=-1) * scale  # [B, q_cols, d]
    table = band_table(bands, band, inv_freq).astype(q.dtype)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # M whole before the product: fused into the GEMM's prologue (a gather and float32 math a tile), the product
    # ran at 16 TFLOP/s, 130 us a layer at W = 64 on the H200 (bench/results/kernels.md "Banded decode kernel")
    m = jax.lax.optimization_barrier(m.astype(q.dtype))
    out = jnp.einsum("nd,bcd->nbc", table, m, preferred_element_type=jnp.float32, precision=precision)
    return out.astype(q.dtype).reshape(bands * b, layout.q_cols)
