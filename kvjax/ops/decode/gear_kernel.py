"""The decode op over GEAR pages (``gear.GearPageFormat``; Pallas, Triton lowering): one new query per sequence
against its pages, each read as GEAR stores it, ``D + A B^T + S``, and its exact tail, in one online softmax.
``gear_paged_decode`` equals ``reference.quantized_decode_attention`` over the same pages but rebuilds no key or
value: codes dequantized in registers, the low-rank part scored as ``(q B) A^T`` (GEAR's decode, section 3 of the
paper), each outlier added as its exact correction. ``GearDecodeOp`` is the engine's op: one program per (sequence,
KV head), a kernel per (K, V) width pair, no schedule (``schedule`` returns None). Priced offline:
bench/results/quantization.md "GEAR pages: decode kernel (offline)".

Constraints: q packed [B, q_cols]; a group of at most 16 queries a KV head; the pool and tail under 2^31 elements.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.columns import column_offsets
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.gear import GearPageFormat
from kvjax.ops.pallas_util import (
    LOG2E,
    MASK,
    NOWHERE,
    by_width_pair,
    dot_precision,
    online_update,
    whole_block,
)
from kvjax.ops.tiles import tile

BLOCK_H = ROWS  # query rows a program: a GQA group (G <= 16) padded to the tensor cores' smallest M
_PARTS = ("codes", "scale", "zero", "a", "b", "outliers", "outlier_index")
# a head's table row: per side (K then V) where each part starts in a page, in units of the view it is read through
# (codes: bytes; scales, factors and outlier values: float16s; outlier positions: their own integers); then the
# head's first K and V column in a tail row
FIELDS = 2 * len(_PARTS) + 2
K_TAIL, V_TAIL = 2 * len(_PARTS), 2 * len(_PARTS) + 1


def _field(side: str, part: str) -> int:
    return (0 if side == "k" else len(_PARTS)) + _PARTS.index(part)


def _table(fmt: GearPageFormat, layout: HeadLayout, heads: list[int]) -> np.ndarray:
    """[len(heads) * FIELDS] int32: each head's parts' starts (``FIELDS``)."""
    offs = column_offsets(layout)
    rows = np.zeros((len(heads), FIELDS), np.int64)
    for u, h in enumerate(heads):
        for side in ("k", "v"):
            for part, (start, dtype, _) in fmt.head_parts(side, h).items():
                unit = 1 if part == "codes" else 2 if part != "outlier_index" else dtype.itemsize
                rows[u, _field(side, part)] = start // unit
        rows[u, K_TAIL], rows[u, V_TAIL] = offs["k"][h], fmt.k_cols + offs["v"][h]
    return rows.astype(np.int32).ravel()


def _side_static(fmt: GearPageFormat, side: str, head: int, width: int) -> dict:
    """What a side's code depends on: its width, its outliers a page and the bytes of their positions."""
    parts = fmt.head_parts(side, head)
    n = parts["outliers"][2][0] if "outliers" in parts else 0
    return dict(width=width, outliers=n, index_bytes=parts["outlier_index"][1].itemsize if n else 0)


def _index_load(pool_ref, half_ref, at, mask, index_bytes):
    """Outlier positions at ``at`` (in units of their own integers from the pool's start; a 4-byte one read as its
    two little-endian 16-bit halves) as int32."""
    if index_bytes == 1:
        return plgpu.load(pool_ref.at[at], mask=mask, other=0).astype(jnp.int32)
    if index_bytes == 2:
        return plgpu.load(half_ref.at[at], mask=mask, other=0).astype(jnp.int32)
    lo = plgpu.load(half_ref.at[2 * at], mask=mask, other=0).astype(jnp.int32)
    hi = plgpu.load(half_ref.at[2 * at + 1], mask=mask, other=0).astype(jnp.int32)
    return lo + hi * 65536


@dataclasses.dataclass(frozen=True)
class _Head:
    """How one program reads its KV head's parts of a page: codes from the pool's bytes, scales, factors and outlier
    values through its float16 view, positions through its bytes or 16-bit view, each part where the head table
    puts it."""

    pool_ref: Any
    meta_ref: Any
    half_ref: Any
    heads_ref: Any
    unit: jax.Array
    bits: int
    rank: int
    page_size: int

    def field(self, side: str, part: str):
        return self.heads_ref[self.unit * FIELDS + _field(side, part)]

    def meta(self, at, mask):
        """float16 values at ``at`` (units of the view) as float32, 0 where ``mask`` is false."""
        return plgpu.load(self.meta_ref.at[jnp.where(mask, at, 0)], mask=mask, other=0).astype(jnp.float32)

    def codes(self, side: str, width: int, base, tok, col, mask):
        """The codes at tokens ``tok`` and columns ``col`` (broadcast together) of the page from byte ``base``,
        as float32: column ``c`` from byte ``c % (w/n)`` of its token's row, shifted by ``(c // (w/n)) * bits``."""
        n = 8 // self.bits
        plane = width // n
        byte = jnp.where(mask, tok * plane + lax.rem(col, plane), 0)
        shift = (jnp.minimum(lax.div(col, plane), n - 1) * self.bits).astype(jnp.uint32)
        raw = plgpu.load(self.pool_ref.at[base + self.field(side, "codes") + byte], mask=mask, other=0)
        return ((raw.astype(jnp.uint32) >> shift) & jnp.uint32((1 << self.bits) - 1)).astype(jnp.float32)

    def dense(self, side: str, width: int, base, cols, cols_ok):
        """D, the page's codes dequantized [PT, tile] (0 outside the page's tokens and the head's columns), and
        the low-rank factors' columns: A's [PT] and B's [tile], ``rank`` of each."""
        half = base // 2
        t = jnp.arange(max(16, tile(self.page_size)))
        t_ok = t < self.page_size
        mask = t_ok[:, None] & cols_ok[None, :]
        codes = self.codes(side, width, base, t[:, None], cols[None, :], mask)
        sc, ze = half + self.field(side, "scale"), half + self.field(side, "zero")
        if side == "k":  # a range per column over the page
            scale, zero = self.meta(sc + cols, cols_ok)[None, :], self.meta(ze + cols, cols_ok)[None, :]
        else:  # a range per token
            scale, zero = self.meta(sc + t, t_ok)[:, None], self.meta(ze + t, t_ok)[:, None]
        x = jnp.where(mask, codes * scale + zero, 0.0)
        a = [self.meta(half + self.field(side, "a") + t * self.rank + j, t_ok) for j in range(self.rank)]
        b = [self.meta(half + self.field(side, "b") + cols * self.rank + j, cols_ok) for j in range(self.rank)]
        return x, a, b

    def outliers(self, side: str, static: dict, base):
        """S: each outlier's (token, column, correction ``exact - (D + L)`` there, which are real) [NT] each, from
        the page's own codes, scales and factors at its place; None for a format without outliers."""
        count, width, index_bytes = static["outliers"], static["width"], static["index_bytes"]
        if not count:
            return None
        half = base // 2
        o = jnp.arange(max(16, tile(count)))
        ok = o < count
        at = base // index_bytes + self.field(side, "outlier_index") + o
        idx = _index_load(self.pool_ref, self.half_ref, jnp.where(ok, at, 0), ok, index_bytes)
        tok, col = lax.div(idx, width), lax.rem(idx, width)
        group = col if side == "k" else tok  # the outlier's quantization group
        scale, zero = (self.meta(half + self.field(side, name) + group, ok) for name in ("scale", "zero"))
        d = self.codes(side, width, base, tok, col, ok) * scale + zero
        low = functools.reduce(
            jnp.add,
            [
                self.meta(half + self.field(side, "a") + tok * self.rank + j, ok)
                * self.meta(half + self.field(side, "b") + col * self.rank + j, ok)
                for j in range(self.rank)
            ],
        )
        delta = jnp.where(ok, self.meta(half + self.field(side, "outliers") + o, ok) - d - low, 0.0)
        return tok, col, delta, ok


def _value_terms(p, a, b, out, vc, dt, precision):
    """What the weights p [16, PT] add to the output [16, VT] beyond D: ``(p A) B^T`` and each token's weight times
    its outliers' corrections, onto their columns (one-hot dots in the dots' dtype ``dt``, on the tensor cores)."""
    acc = jnp.zeros((p.shape[0], vc.shape[0]), jnp.float32)
    for a_j, b_j in zip(a, b):
        acc = acc + jnp.sum(p * a_j[None, :], axis=1)[:, None] * b_j[None, :]
    if out is not None:
        tok, col, delta, _ = out
        t = jnp.arange(p.shape[1])
        to_tok = (t[:, None] == tok[None, :]).astype(jnp.float32)  # [PT, NT]
        at_tok = plgpu.dot(p.astype(dt), to_tok.astype(dt), precision=precision) * delta[None, :]
        to_col = (col[:, None] == vc[None, :]).astype(jnp.float32)  # [NT, VT]
        acc = acc + plgpu.dot(at_tok.astype(dt), to_col.astype(dt), precision=precision)
    return acc


def _kernel(
    lengths_ref,
    block_ref,
    heads_ref,
    q_ref,
    pool_ref,
    meta_ref,
    half_ref,
    tail_ref,
    out_ref,
    *,
    k_side,
    v_side,
    bits,
    rank,
    page_size,
    page_bytes,
    pages_per_seq,
    group,
    window,
    scale,
    tail_row,
    interpret,
):
    seq, unit = pl.program_id(0), pl.program_id(1)
    units = pl.num_programs(1)
    P, PT = page_size, max(16, tile(page_size))
    kw, vw = k_side["width"], v_side["width"]
    dt = jnp.dtype(q_ref.dtype)
    precision = dot_precision(dt)
    head = _Head(pool_ref, meta_ref, half_ref, heads_ref, unit, bits, rank, page_size)

    rows = jnp.arange(BLOCK_H)
    real = rows < group
    t = jnp.arange(PT)
    kc, vc = jnp.arange(tile(kw)), jnp.arange(tile(vw))
    kc_ok, vc_ok = kc < kw, vc < vw
    q_at = ((seq * units + unit) * group + rows[:, None]) * kw

    def load_q(cols, cols_ok):  # query rows at ``cols`` [1, C], scaled: scores in log2 units
        mask = real[:, None] & cols_ok
        q = plgpu.load(q_ref.at[jnp.where(mask, q_at + cols, 0)], mask=mask, other=0).astype(jnp.float32)
        return q * (scale * LOG2E)

    q32 = load_q(kc[None, :], kc_ok[None, :])
    q = q32.astype(dt)
    length = lengths_ref[seq]
    full = length // P
    visible_from = jnp.maximum(length - window, 0) if window else 0

    def page_step(i, carry):
        base = block_ref[seq * pages_per_seq + i] * page_bytes
        k, ka, kb = head.dense("k", kw, base, kc, kc_ok)
        s = plgpu.dot(q, k.astype(dt), trans_b=True, precision=precision)  # D
        for a, b in zip(ka, kb):  # L: (q B) A^T
            s = s + jnp.sum(q32 * b[None, :], axis=1)[:, None] * a[None, :]
        k_out = head.outliers("k", k_side, base)
        if k_out is not None:  # S: each outlier's correction onto its token's score
            tok, col, delta, ok = k_out
            onehot = (tok[:, None] == t[None, :]).astype(dt)  # [NT, PT]
            corrections = (load_q(col[None, :], ok[None, :]) * delta[None, :]).astype(dt)
            s = s + plgpu.dot(corrections, onehot, precision=precision)
        visible = (t < P) & (i * P + t >= visible_from)
        v, va, vb = head.dense("v", vw, base, vc, vc_ok)
        v_out = head.outliers("v", v_side, base)
        extra = functools.partial(_value_terms, a=va, b=vb, out=v_out, vc=vc, dt=dt, precision=precision)
        return online_update(carry, jnp.where(visible[None, :], s, MASK), v.astype(dt), extra, precision)

    def tail_step(_, carry):
        pos = full * P + t
        visible = (t < P) & (pos < length) & (pos >= visible_from)
        row = (seq * P + t)[:, None] * tail_row

        def load(first, cols, cols_ok):
            mask = visible[:, None] & cols_ok[None, :]
            at = jnp.where(mask, row + first + cols[None, :], 0)
            return plgpu.load(tail_ref.at[at], mask=mask, other=0).astype(dt)

        k, v = load(heads_ref[unit * FIELDS + K_TAIL], kc, kc_ok), load(heads_ref[unit * FIELDS + V_TAIL], vc, vc_ok)
        s = plgpu.dot(q, k, trans_b=True, precision=precision)
        return online_update(carry, jnp.where(visible[None, :], s, MASK), v, None, precision)

    carry = (jnp.zeros((BLOCK_H, vc.shape[0]), jnp.float32), jnp.full((BLOCK_H,), MASK), jnp.zeros((BLOCK_H,)))
    carry = lax.fori_loop(visible_from // P, full, page_step, carry)  # pages wholly before a window are skipped
    acc, _, l = lax.fori_loop(0, (length % P > 0).astype(jnp.int32), tail_step, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    o_mask = real[:, None] & vc_ok[None, :]
    o_at = ((seq * units + unit) * group + rows[:, None]) * vw + vc[None, :]
    if interpret:
        o_at = jnp.where(o_mask, o_at, NOWHERE)
    plgpu.store(out_ref.at[o_at], out.astype(out_ref.dtype), mask=o_mask)


def check_format(layout: HeadLayout, fmt) -> GearPageFormat:
    """``fmt`` if it is a GEAR page format of ``layout``'s heads, else a ValueError saying why not."""
    return GearPageFormat.check_serves(layout, fmt, "gear.GearPageFormat")


@functools.partial(jax.jit, static_argnames=("layout", "fmt", "num_warps", "interpret"))
def gear_paged_decode(
    q, pages, tail, block_table, lengths, layout: HeadLayout, fmt: GearPageFormat, *, num_warps=4, interpret=False
):
    """One new query per sequence against its GEAR pages; equal to ``reference.quantized_decode_attention``.

    q [B, q_cols] packed; pages [num_pages, fmt.page_bytes] uint8; tail [>= B, page_size, k_cols + v_cols] (row i:
    sequence i's partial last page, ``quant_paging``); block_table [B, pages_per_seq] int32; lengths [B] int32 (the
    new token included, already written). Returns [B, out_cols] in q's dtype; rows with length 0 are unspecified.
    """
    check_format(layout, fmt)
    b, p = q.shape[0], fmt.page_size
    if q.ndim != 2 or q.shape[1] != layout.q_cols:
        raise ValueError(f"q must be [B, {layout.q_cols}], got {q.shape}")
    if pages.dtype != jnp.uint8 or pages.ndim != 2 or pages.shape[1] != fmt.page_bytes:
        raise ValueError(f"pages must be uint8 [num_pages, {fmt.page_bytes}], got {pages.dtype} {pages.shape}")
    if tail.ndim != 3 or tail.shape[0] < b or tail.shape[1:] != (p, fmt.k_cols + fmt.v_cols):
        raise ValueError(f"tail must be [>= {b}, {p}, {fmt.k_cols + fmt.v_cols}], got {tail.shape}")
    if pages.size >= 2**31 or tail.size >= 2**31:
        raise ValueError("the GEAR decode kernel addresses a layer's pool and tail with int32 offsets")
    g = layout.group_size
    if g > BLOCK_H:
        raise ValueError(f"GEAR decode scores at most {BLOCK_H} queries a KV head, got {g}")
    flat_pool = pages.reshape(-1)
    meta = lax.bitcast_convert_type(pages.reshape(-1, 2), jnp.float16)  # scales, factors, outliers: a bitcast
    halves = lax.bitcast_convert_type(pages.reshape(-1, 2), jnp.uint16)
    lengths = lengths.astype(jnp.int32)
    blocks = block_table.astype(jnp.int32).reshape(-1)

    def attend(kw, vw, heads, qh):
        static = dict(
            k_side=_side_static(fmt, "k", heads[0], kw),
            v_side=_side_static(fmt, "v", heads[0], vw),
            bits=fmt.bits,
            rank=fmt.spec.rank,
            page_size=p,
            page_bytes=fmt.page_bytes,
            pages_per_seq=block_table.shape[1],
            group=g,
            window=layout.sliding_window,
            scale=1.0 / math.sqrt(layout.head_dim),
            tail_row=fmt.k_cols + fmt.v_cols,
            interpret=interpret,
        )
        args = [lengths, blocks, jnp.asarray(_table(fmt, layout, heads))]
        args += [qh.reshape(-1), flat_pool, meta, halves, tail.reshape(-1)]
        shape = jax.ShapeDtypeStruct((b * len(heads) * g * vw,), q.dtype)
        got = pl.pallas_call(
            functools.partial(_kernel, **static),
            out_shape=shape,
            grid=(b, len(heads)),
            in_specs=[whole_block(x) for x in args],
            out_specs=whole_block(shape),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            name=f"kvjax_gear_decode_k{kw}_v{vw}",
        )(*args)
        return got.reshape(b, len(heads), g * vw)

    return by_width_pair(q, layout, attend)


class GearDecodeOp:
    """Decode attention over a model's GEAR layers, held by the engine as it holds ``op.DecodeOp``: ``schedule``
    has nothing to schedule (a program per sequence and KV head; returns None), ``run`` attends one layer on the
    device. Queries come packed (``wide_queries`` False: the engine packs them with ``QKRotation.packed``)."""

    wide_queries = False

    def __init__(self, layouts, formats, *, interpret: bool = False):
        layouts, formats = list(layouts), list(formats)
        if len(formats) != len(layouts):
            raise ValueError(f"{len(formats)} page formats for {len(layouts)} layouts")
        self.formats: dict[HeadLayout, GearPageFormat] = {}
        for lay, fmt in zip(layouts, formats):
            if self.formats.setdefault(lay, check_format(lay, fmt)) != fmt:
                raise ValueError(f"two page formats for one layout: {self.formats[lay]} and {fmt}")
        self.interpret = interpret

    def schedule(self, lengths) -> None:
        return None

    def run(self, q, pages, tail, block_table, lengths, schedule, layout: HeadLayout):
        """One layer's attention (``schedule`` unused); see ``gear_paged_decode``."""
        fmt = self.formats.get(layout)
        if fmt is None:
            raise ValueError(f"{layout} is not one of the layouts this decode op was built for")
        return gear_paged_decode(q, pages, tail, block_table, lengths, layout, fmt, interpret=self.interpret)
