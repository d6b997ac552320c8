"""The decode op over quantized pages (Pallas, Triton lowering): one new query per sequence against its int4 or int2
pages, dequantized in registers as they stream, and its exact tail, in one online softmax. ``quantized_paged_decode``
equals ``reference.quantized_decode_attention``; ``QuantDecodeOp`` is the op the engine holds as it holds
``op.DecodeOp``, with the bf16 op's schedule and ``merge.merge`` (one KV head a unit unless ``plan_config`` packs runs).
A layer runs one kernel a head class (``head_classes``, ``unit_kernels``), so layers share compiled kernels
(bench/results/quantization.md "Quantized pages: compile times (offline)"). ``QuantKernelConfig`` holds the knobs.

Constraints: q packed [B, q_cols] or wide (``QKRotation.wide``); widths multiples of 16; a group of at most 16
queries a KV head; pool and tail under 2^31 elements (int32 offsets). Any page size works.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.ops.columns import column_offsets
from kvjax.ops.decode import tables
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.kernel import launch_and_merge
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.schedule import (
    END_PAGE,
    FIRST_PAGE,
    SEQ,
    SLOT,
    UNIT,
    DecodeSchedule,
    as_layouts,
)
from kvjax.ops.decode.units import head_runs
from kvjax.ops.pallas_util import LOG2E, MASK, NOWHERE, dot_precision, page_of
from kvjax.ops.quant import PageFormat, check_bits
from kvjax.ops.tiles import is_pow2, tile

BLOCK_H = ROWS  # query rows per item: a GQA group (G <= 16) padded to the tensor cores' smallest M
QUANT_DECODE = dataclasses.replace(DECODE, pack_tile=0)  # the schedule's config: one KV head a unit
PACK_TILE = 128  # with packed runs (``plan_config``): the widest K or V a run of several heads reads

# Fields of a unit's row in the head table (a unit: one KV head, or a run of adjacent heads, ``plan_config``), each of
# its first head: its class, its codes' first byte in a page's K and V code rows, its first K and V column (key meta,
# tail), its index (value meta), where its queries start in a q row and the step between them, likewise its outputs,
# the columns of its K and V planes (``quant.pack``: width / codes a byte); then the unit's heads, and where each
# head's plane ends among the run's plane bytes, K and V (``RUN_HEADS`` ends a side; past the last head, the total).
CLASS, K_BYTE, V_BYTE, K_COL, V_COL, HEAD, Q_BASE, Q_STEP, O_BASE, O_STEP, K_PLANE, V_PLANE = range(12)
RUN_HEADS = 4  # the most heads a run holds: 16 rows of the score tile over G >= 4 queries (``plan_config``)
NUM_HEADS = 12
K_ENDS, V_ENDS = 13, 13 + RUN_HEADS  # first field of each side's plane ends
HEAD_FIELDS = 13 + 2 * RUN_HEADS
# Entries of the layer table: a page's bytes; the K codes' row bytes; the V codes' first byte and row bytes; then in
# float16 units (the metadata's view of the pool): a page's size, the key meta's start and the distance from its
# scale row to its zero row, the value meta's start and from its scales to its zeros; a tail row's columns and its
# first V column; q and output row widths.
PAGE_BYTES, K_ROW, V_CODES, V_ROW, PAGE_HALVES, K_META, K_ZEROS, V_META, V_ZEROS = range(9)
TAIL_ROW, TAIL_V, Q_ROW, O_ROW = range(9, 13)
LAYER_FIELDS = 13


@dataclasses.dataclass(frozen=True)
class QuantKernelConfig:
    """How the quantized decode kernel runs (hashable: a static argument of the jitted kernel); a GPU sweep varies these
    with ``dataclasses.replace``. The schedule's config (``DecodeConfig``) cuts the work; its kernel fields are not read
    here."""

    chunk_tokens: int = 32  # tokens a chunk reads from one page (fewer to divide the page): one lookup, one key range
    # tokens a loop step reads: 128 for a head whose K and V tiles hold 256 columns or more (a rate-0 layer: 304 us,
    # 359 at 64), 64 for every narrower head, whose registers spill at more (a rate-0.5 layer: 464 us at 64, 530 at
    # 256; its compile 40 s against 163). H100/H200, bench/results/quantization.md "Quantized pages: decode kernel"
    step_tokens: int = 128
    narrow_step_tokens: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # head classes one compiled kernel switches between: a layer of more runs one kernel after another. Compile time
    # grows with the square of a kernel's size (bench/results/quantization.md "Quantized pages: compile times
    # (offline)"), so 1 (a kernel a class, the same for every layer) keeps it linear in the classes
    classes_per_kernel: int = 1

    def __post_init__(self):
        validate.int_fields(self, at_least_one=tuple(f.name for f in dataclasses.fields(self)))
        for name in ("chunk_tokens", "step_tokens", "narrow_step_tokens"):
            if not is_pow2(getattr(self, name), 16):
                raise ValueError(f"{name} must be a power of two of at least 16, got {getattr(self, name)}")

    def chunk(self, page_size: int) -> int:
        """Tokens a chunk reads: ``chunk_tokens``, or fewer to divide the page (a chunk is one page's)."""
        return min(self.chunk_tokens, page_size & -page_size)

    def chunks_per_step(self, k_tile: int, v_tile: int, page_size: int) -> int:
        """Chunks a step of a head with these tiles reads: ``step_tokens`` when they hold 256 columns or more,
        ``narrow_step_tokens`` when fewer; at least one chunk."""
        tokens = self.step_tokens if k_tile + v_tile >= 256 else self.narrow_step_tokens
        return max(1, tokens // self.chunk(page_size))


QUANT_KERNEL = QuantKernelConfig()


def _pow2_divisor(values) -> int:
    """The largest power of two, up to 16, dividing every one of ``values`` (16 for none or all zero)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    return 16 if g == 0 else min(16, g & -g)


def plan_config(config: DecodeConfig, bits: int, packed: bool) -> DecodeConfig:
    """The schedule's config for quantized decode: one KV head a unit, or (``packed``) runs of up to ``16 / G`` (at most
    ``RUN_HEADS``) adjacent heads, read as one head of their planes side by side, each side at least one 16-column
    plane and at most ``PACK_TILE`` columns (the cost model chooses the runs, ``units.head_runs``)."""
    if not packed:
        return dataclasses.replace(config, pack_tile=0, pack_min_cols=0)
    least = 16 * (8 // check_bits(bits))
    return dataclasses.replace(config, pack_tile=PACK_TILE, pack_min_cols=least, pack_max_heads=RUN_HEADS)


def _head_rows(layout: HeadLayout, fmt: PageFormat, wide_rows: int, config: DecodeConfig) -> np.ndarray:
    """[units, HEAD_FIELDS] the units' fields, whole (the class column left 0)."""
    offs, n, g = column_offsets(layout), fmt.per_byte, layout.group_size
    runs = head_runs(layout, config)
    rows = np.zeros((len(runs), HEAD_FIELDS), np.int64)
    for u, run in enumerate(runs):
        h, kw, vw = run.first, run.k_widths[0], run.v_widths[0]
        ko, vo = offs["k"][h], offs["v"][h]
        q_base, q_step = (h * g * layout.k_cols + ko, layout.k_cols) if wide_rows else (offs["q"][h], kw)
        fields = (ko // n, vo // n, ko, vo, h, q_base, q_step, offs["o"][h], vw, kw // n, vw // n, run.num_heads)
        rows[u, 1 : NUM_HEADS + 1] = fields
        for at, widths in ((K_ENDS, run.k_widths), (V_ENDS, run.v_widths)):
            ends = np.cumsum(widths) // n
            rows[u, at : at + RUN_HEADS] = np.pad(ends, (0, RUN_HEADS - len(ends)), mode="edge")
    return rows


def _layer_row(layout: HeadLayout, fmt: PageFormat, wide_rows: int) -> np.ndarray:
    """[LAYER_FIELDS] the layer's entries, whole."""
    at, n, p, h = fmt.offsets, fmt.per_byte, fmt.page_size, fmt.heads
    q_row = wide_rows * layout.k_cols if wide_rows else layout.q_cols
    return np.array(
        [
            fmt.page_bytes,
            fmt.k_cols // n,
            at["v_codes"],
            fmt.v_cols // n,
            fmt.page_bytes // 2,
            at["k_meta"] // 2,
            fmt.k_cols,
            at["v_meta"] // 2,
            p * h,
            fmt.k_cols + fmt.v_cols,
            fmt.k_cols,
            q_row,
            layout.out_cols,
        ],
        np.int64,
    )


Side = tuple[str, int]  # how one side (K or V) of a head is read: ("planes", plane tile) or ("gather", width)


V_LEAST_TILE = 32  # a value plane narrower than this is read into a tile this wide, its extra columns masked


def side_class(width: int, bits: int, keys: bool = True) -> Side:
    """How the kernel reads a head's ``width`` K (``keys``) or V columns at ``bits``: ``("planes", tile)`` when its
    planes (``width / codes a byte`` columns) are at least 16 wide, each read into a ``tile``-column piece (the plane
    width itself read at run time, so heads of other widths with the same tile share the code), else ``("gather",
    width)``: the head as one gathered tile, whose byte pattern depends on its exact width (``_Reader``).

    Value planes of 16 columns are read into 32-column tiles (``V_LEAST_TILE``): as 16-column tiles their codes
    took 3.4x the byte permutes of a 64-column plane's, 46.9 loop instructions a (token, head) against 23.9 masked to
    32 (bench/results/quantization.md "Quantized pages: instructions per (token, head) (offline)"); key planes of 16
    stay 16 (17.6 against 20.5)."""
    plane = width // (8 // check_bits(bits))
    if plane < 16:
        return ("gather", width)
    return ("planes", tile(plane) if keys else max(V_LEAST_TILE, tile(plane)))


def head_classes(layout: HeadLayout, bits: int, config: DecodeConfig = QUANT_DECODE) -> tuple[tuple, ...]:
    """Each unit's class (``units.head_runs`` under the schedule's ``config``): the (K, V) ``side_class`` pair of its
    columns, and for a run of several heads a third entry, ``"run"`` (its rows gather each head's value scales). A
    compiled kernel has one branch a class."""
    return tuple(
        (side_class(r.k_cols, bits), side_class(r.v_cols, bits, keys=False)) + (("run",) if r.num_heads > 1 else ())
        for r in head_runs(layout, config)
    )


def unit_kernels(layout: HeadLayout, bits: int, config: DecodeConfig, per_kernel: int) -> tuple[int, ...]:
    """Which of the layer's kernels runs each unit: its classes in sorted order (``_Geometry``'s), ``per_kernel``
    (``QuantKernelConfig.classes_per_kernel``) a kernel. The schedule balances each kernel's units on their own
    (``schedule.build_decode_schedule``'s ``classes``)."""
    cls = head_classes(layout, bits, config)
    present = sorted(set(cls))
    return tuple(present.index(c) // per_kernel for c in cls)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """What a kernel group's code depends on: its classes (``head_classes``, in order), whether every head of a
    class fills its plane tiles (K, V: then no column mask), and the power of two each table field is stored divided
    by (per class for head fields, ``head_align[class][field]``)."""

    classes: tuple[tuple, ...]
    full: tuple[tuple[bool, bool], ...]
    head_align: tuple[tuple[int, ...], ...]
    layer_align: tuple[int, ...]
    units: int  # head-table rows: the most units of any layer of the group


def _fills(side: Side, width: int, bits: int) -> bool:
    """Whether a head of ``width`` columns read as ``side`` fills its tiles (no column of them masked)."""
    return width // (8 // bits) == side[1] if side[0] == "planes" else tile(width) == width


@functools.cache
def _geometry(
    shared: tuple[HeadLayout, ...], bits: int, page_size: int, wide_rows: int, config: DecodeConfig
) -> _Geometry:
    classes = tuple(sorted({c for lay in shared for c in head_classes(lay, bits, config)}))
    fmts = [PageFormat.for_layout(lay, page_size, bits) for lay in shared]
    per_class: list[list[np.ndarray]] = [[] for _ in classes]
    full = [[True, True] for _ in classes]
    for lay, fmt in zip(shared, fmts):
        runs = head_runs(lay, config)
        widths = [(r.k_cols, r.v_cols) for r in runs]
        heads = zip(head_classes(lay, bits, config), widths, _head_rows(lay, fmt, wide_rows, config))
        for cls, (kw, vw), row in heads:
            i = classes.index(cls)
            per_class[i].append(row)
            full[i] = [full[i][0] and _fills(cls[0], kw, bits), full[i][1] and _fills(cls[1], vw, bits)]
    head_align = tuple(tuple(_pow2_divisor(col) for col in np.stack(rows, 1)) for rows in per_class)
    layer_rows = np.stack([_layer_row(lay, fmt, wide_rows) for lay, fmt in zip(shared, fmts)], 1)
    layer_align = tuple(_pow2_divisor(col) for col in layer_rows)
    units = max(len(head_runs(lay, config)) for lay in shared)
    return _Geometry(classes, tuple(map(tuple, full)), head_align, layer_align, units)  # type: ignore[arg-type]


def _tables(
    layout: HeadLayout, fmt: PageFormat, geo: _Geometry, wide_rows: int, config: DecodeConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The layer's head table [units * HEAD_FIELDS] and layer table [LAYER_FIELDS], int32, each field divided by its
    alignment (rows past the layer's units are zero)."""
    heads = np.zeros((geo.units, HEAD_FIELDS), np.int64)
    units = zip(_head_rows(layout, fmt, wide_rows, config), head_classes(layout, fmt.bits, config))
    for h, (row, c) in enumerate(units):
        cls = geo.classes.index(c)
        heads[h] = row // np.asarray(geo.head_align[cls])
        heads[h, CLASS] = cls  # read as is, not scaled
    layer = _layer_row(layout, fmt, wide_rows) // np.asarray(geo.layer_align)
    if max(heads.max(), layer.max()) >= 2**31:
        raise ValueError("a layer too large for the kernel's int32 offsets")
    return heads.astype(np.int32).ravel(), layer.astype(np.int32)


# A code c < 2^bits as a float with no conversion instruction (the GPU converts at a fraction of its FMA rate: the
# first version of this kernel spent most of its time there): c OR'd into the mantissa of 2^m is 2^m + c exactly.
# dtype -> (unsigned type of its width, 2^m's bits, 2^m)
_MAGIC = {
    jnp.dtype(jnp.float32): (jnp.uint32, 0x4B000000, 2.0**23),
    jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x4300, 128.0),
    jnp.dtype(jnp.float16): (jnp.uint16, 0x6400, 1024.0),
}


def _meta(meta_ref, at, mask):
    """The pool's float16 values at ``at`` (in float16 units of its float16 view), as float32 (0 where ``mask`` is
    false)."""
    return plgpu.load(meta_ref.at[at], mask=mask, other=0).astype(jnp.float32)


def _biased(raw, shift, bits, dtype):
    """Codes of bytes ``raw`` (uint8 [T, C]) shifted right by ``shift`` (an int, or uint32 [1, C]) as ``dtype``,
    plus 2^m (``_MAGIC``): exact, with no conversion instruction."""
    uint, magic, _ = _MAGIC[jnp.dtype(dtype)]
    code = (raw.astype(jnp.uint32) >> shift) & jnp.uint32((1 << bits) - 1)
    return lax.bitcast_convert_type(code.astype(uint) | uint(magic), dtype)


def _codes(raw, shift, bits, dtype):
    """``_biased`` less 2^m: the codes themselves."""
    return _biased(raw, shift, bits, dtype) - jnp.asarray(_MAGIC[jnp.dtype(dtype)][2], dtype)


def _pick(values, which):
    """``values[which]`` elementwise for a small traced ``which`` (a chain of selects)."""
    out = values[-1]
    for i in range(len(values) - 2, -1, -1):
        out = jnp.where(which == i, values[i], out)
    return out


def _span(ends, which):
    """Where run head ``which`` (traced) starts and ends among the run's plane bytes, from the run's plane ``ends``."""
    return _pick((0, *ends[:-1]), which), _pick(ends, which)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One tile of ``tile`` columns of a unit (a dot a piece). A unit of one head: lane ``c`` < ``width`` is its
    column ``start + c``. A run (``ends``: where each head's plane ends among the run's plane bytes, traced): plane
    ``index`` of every head side by side, as their code bytes are; lane ``c`` is head ``h``'s (``ends[h-1] <= c <
    ends[h]``) column ``index * plane_h + c - ends[h-1]``, where ``plane_h`` is its plane's width. ``full``: whether
    ``width`` is the whole tile."""

    start: jax.Array | int
    tile: int
    width: jax.Array | int
    full: bool
    ends: tuple | None = None  # a run's plane ends, RUN_HEADS of them (None: a unit of one head)
    index: int = 0  # the plane
    per_byte: int = 1  # codes a byte: a head's plane is 1 / per_byte of its columns

    def cols(self):
        return jnp.arange(self.tile)[None, :]

    def ok(self):
        """Which tile columns are the unit's; None when all are."""
        return None if self.full else self.cols() < self.width

    def head(self):
        """Each lane's head in the unit [1, tile] (0 in a unit of one head)."""
        c = self.cols()
        if self.ends is None:
            return jnp.zeros_like(c)
        return functools.reduce(operator.add, [(c >= e).astype(jnp.int32) for e in self.ends[:-1]])

    def _plane(self):
        """Each lane's head's first plane byte and plane width among the run's [1, tile] each."""
        assert self.ends is not None
        first, end = _span(self.ends, self.head())
        return first, end - first

    def own(self):
        """Each lane's column in its own head [1, tile]."""
        if self.ends is None:
            return self.start + self.cols()
        first, plane = self._plane()
        return self.index * plane + self.cols() - first

    def at(self):
        """Each lane's column among the unit's [1, tile] (its heads' columns one after another)."""
        if self.ends is None:
            return self.own()
        first, plane = self._plane()
        return self.per_byte * first + self.index * plane + self.cols() - first


def _both(a, b):
    return a if b is None else (b if a is None else a & b)


@dataclasses.dataclass(frozen=True)
class _Reader:
    """How the kernel reads the heads of one class, K and V each in one of two forms (``dtype``: the dots' inputs,
    q's dtype):

    - **planes** (a plane of ``w/n`` >= 16 columns): a head's code row of ``w/n`` bytes is loaded once, each of its
      ``n`` planes (the bytes shifted by ``i * bits``) a dot against its block of ``w/n`` columns. Key scales are
      folded into q once a chunk (``(q * scale) . codes + q . zero``), value scales into the weights. The fastest
      form measured (bench/results/quantization.md "Quantized pages: decode kernel lab", ``wide``).
    - **gather** (narrower planes, too narrow for a dot): the head as one tile, column ``c`` from byte ``c % (w/n)``
      shifted by ``(c // (w/n)) * bits`` (re-read bytes are L1 hits), keys dequantized before their dot.

    ``k_dequant``: key planes dequantized before their dots too (``codes * scale + zero`` on the codes, a dot a plane
    with q as loaded) instead of folded into q. The per-head kernel's form: folding rescales q and sums its zero term
    a chunk, each a trip of q through shared memory and a reduction across warps (bench/results/eviction.md
    "Eviction on quantized pages: key scales on the codes")."""

    k_side: Side
    v_side: Side
    bits: int
    dtype: jnp.dtype
    k_full: bool  # every unit of the class fills its K (V) tiles
    v_full: bool
    k_plane: jax.Array | int  # a head's plane widths (traced: read from the head table)
    v_plane: jax.Array | int
    heads: jax.Array | None = None  # a run's heads (traced; None: one head)
    k_ends: tuple | None = None  # a run's plane ends, K and V (``_Piece``)
    v_ends: tuple | None = None
    k_dequant: bool = False

    @property
    def n(self) -> int:
        return 8 // self.bits

    def rows(self, group: int):
        """The unit's real query rows: ``group`` a head."""
        return group if self.heads is None else group * self.heads

    @staticmethod
    def planes(side: Side) -> bool:
        return side[0] == "planes"

    def side(self, keys: bool) -> tuple[Side, bool, jax.Array | int]:
        return (self.k_side, self.k_full, self.k_plane) if keys else (self.v_side, self.v_full, self.v_plane)

    def pieces(self, keys: bool) -> tuple[_Piece, ...]:
        """The K (``keys``) or V side of a unit as its planes, or as one tile (a dot each)."""
        (form, size), full, plane = self.side(keys)
        heads = self.heads
        if form != "planes":
            return (_Piece(0, tile(size), size, full),)  # one head (``plan_config``: runs fill a plane)
        if heads is None:  # one head
            return tuple(_Piece(i * plane, size, plane, full) for i in range(self.n))
        ends = self.k_ends if keys else self.v_ends
        assert ends is not None
        return tuple(_Piece(0, size, ends[-1], full, ends, i, self.n) for i in range(self.n))

    def tile(self, keys: bool) -> int:
        """Columns of the side's tiles together."""
        return sum(piece.tile for piece in self.pieces(keys))

    def bytes(self, keys: bool):
        """(byte of each loaded column in a head's code row [1, B], its shift (gather only), which bytes are the
        head's: None when all)."""
        n = self.n
        (form, width), _, _ = self.side(keys)
        if form == "planes":
            piece = self.pieces(keys)[0]
            return piece.cols(), None, piece.ok()
        c = jnp.arange(tile(width))[None, :]
        # planes of w/n columns, the first in the lowest bits; padding columns repeat the last plane's bytes (in
        # range; their q, scales and outputs unused). lax: no sign fix-ups to hide the contiguity from Triton
        shift = (jnp.minimum(lax.div(c, width // n), n - 1) * self.bits).astype(jnp.uint32)
        return lax.rem(c, width // n), shift, None

    def scores(self, qs, raw, meta, precision):
        """Scores [R, T] of the query pieces ``qs`` against the keys of code bytes ``raw`` [T, B], ``meta`` a
        (scale, zero) pair of rows [1, tile] a piece."""
        planes = self.planes(self.k_side)
        if self.k_dequant or not planes:
            shifts = [i * self.bits for i in range(self.n)] if planes else [self.bytes(True)[1]]
            ks = [(_codes(raw, sh, self.bits, jnp.float32) * scale + zero).astype(self.dtype)
                  for sh, (scale, zero) in zip(shifts, meta)]  # fmt: skip
            return _scores(qs, ks, precision)
        dots, rows = [], []
        for i, (q, (scale, zero)) in enumerate(zip(qs, meta)):
            q32 = q.astype(jnp.float32)
            codes = _codes(raw, i * self.bits, self.bits, self.dtype)
            dots.append(plgpu.dot((q32 * scale).astype(self.dtype), codes, trans_b=True, precision=precision))
            rows.append(q32 * zero)
        return functools.reduce(operator.add, dots) + jnp.sum(functools.reduce(operator.add, rows), axis=1)[:, None]

    def values(self, raw, p, scale, zero, precision):
        """Weights p [R, T] against the values of code bytes ``raw`` with per-token ``scale`` and ``zero`` ([T], or
        [R, T] in a run: each row its head's): ``(p * scale) . codes`` [R, tile] a piece and the row term ``p * zero``
        [R, T] to sum over tokens and add to every column (the scales folded into the weights: no per-value
        multiply)."""
        scale, zero = (x if x.ndim == 2 else x[None, :] for x in (scale, zero))
        ps = (p * scale).astype(self.dtype)
        if self.planes(self.v_side):
            shifts = [i * self.bits for i in range(self.n)]
        else:
            shifts = [self.bytes(False)[1]]
        dots = [plgpu.dot(ps, _codes(raw, sh, self.bits, self.dtype), precision=precision) for sh in shifts]
        return dots, p * zero


def _attend_item(cls_index, item, refs, *, geo, bits, page_size, group, window, scale, v_max, kernel, wide, interpret):
    """Online-softmax attention of one item (one KV head, or a run of them: row ``r`` is query ``r % G`` of the run's
    head ``r // G``, its q zero outside that head's columns) over its quantized chunks and, if it holds the sequence's
    partial last page, its tail; then the write of its result (module docstring)."""
    heads_ref, layer_ref, table_ref, q_ref, pool_ref, meta_ref, tail_ref, out_ref, acc_ref, m_ref, l_ref = refs
    seq, unit, first, end, slot, length = item
    k_side, v_side, *run = geo.classes[cls_index]
    align = geo.head_align[cls_index]
    P, dt = page_size, jnp.dtype(q_ref.dtype)
    tc = kernel.chunk(P)
    tile_rows = max(16, tc)  # a dot's dimension is at least 16: a chunk of fewer tokens masks the rest
    precision = dot_precision(dt)

    def head(f):
        return heads_ref[unit * HEAD_FIELDS + f] * align[f]

    reader = _Reader(k_side, v_side, bits, dt, *geo.full[cls_index], head(K_PLANE), head(V_PLANE), *_run(run, head))
    k_pieces, v_pieces = reader.pieces(True), reader.pieces(False)
    nc = kernel.chunks_per_step(reader.tile(True), reader.tile(False), P)

    def layer(f):
        return layer_ref[f] * geo.layer_align[f]

    rows = jnp.arange(BLOCK_H)
    real = rows < reader.rows(group)
    row_head = lax.div(rows, group)[:, None]  # each row's head in the unit
    q_rows, o_rows = _row_offsets(head, rows, row_head, group, reader, wide)

    def load_q(piece):
        at = seq * layer(Q_ROW) + q_rows + piece.own()
        q = plgpu.load(q_ref.at[at], mask=_own_lanes(piece, real, row_head), other=0).astype(jnp.float32)
        return (q * (scale * LOG2E)).astype(dt)  # scores in log2 units

    qs = [load_q(piece) for piece in k_pieces]
    full = length // P  # pages in the pool; the rest of the sequence is in its tail
    visible_from = jnp.maximum(length - window, 0) if window else 0
    lo = jnp.maximum(first * P, visible_from // tc * tc)  # chunks wholly before a sliding window are skipped
    hi = jnp.minimum(end, full) * P

    def chunk(tok0):
        """Scores [BLOCK_H, tc] of the chunk of tokens from ``tok0`` (one page's), and a function of its weights
        p [BLOCK_H, tc] giving ``_Reader.values``."""
        ok = tok0 < hi
        page = page_of(table_ref, seq, tok0, P, ok)
        r = jnp.arange(tile_rows)
        t = tok0 % P + r  # rows of the page
        visible = ok & (tok0 + r >= visible_from) & (r < tc)
        base, half = page * layer(PAGE_BYTES), page * layer(PAGE_HALVES)

        def codes(row_bytes, first_byte, keys):
            byte, _, byte_ok = reader.bytes(keys)
            at = base + t[:, None] * row_bytes + first_byte + byte
            return plgpu.load(pool_ref.at[at], mask=_both(visible[:, None], byte_ok), other=0)

        def key_meta(piece, rows_apart):
            at = half + layer(K_META) + head(K_COL) + rows_apart + piece.at()
            return _meta(meta_ref, at, _both(jnp.full((1, piece.tile), ok), piece.ok()))

        meta = [(key_meta(piece, 0), key_meta(piece, layer(K_ZEROS))) for piece in k_pieces]
        s = reader.scores(qs, codes(layer(K_ROW), head(K_BYTE), True), meta, precision)
        v_raw = codes(layer(V_ROW), layer(V_CODES) + head(V_BYTE), False)
        v_at, v_ok = _value_meta(half + layer(V_META), head(HEAD), P, t, visible, real, row_head, run)
        v_scale, v_zero = _meta(meta_ref, v_at, v_ok), _meta(meta_ref, v_at + layer(V_ZEROS), v_ok)
        return jnp.where(visible[None, :], s, MASK), lambda p: reader.values(v_raw, p, v_scale, v_zero, precision)

    def step(j, carry):
        tok0 = lo + j * (nc * tc)
        return _update(carry, [chunk(tok0 + c * tc) for c in range(nc)])

    def tail_step(_, carry):
        t = jnp.arange(tile(P))
        tok = full * P + t
        visible = (tok < length) & (tok >= visible_from)
        row = (seq * P + t)[:, None] * layer(TAIL_ROW)
        cols = (head(K_COL), layer(TAIL_V) + head(V_COL))
        return tail_update(carry, qs, (k_pieces, v_pieces), tail_ref, row, cols, visible, precision)

    carry = lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), nc * tc), step, empty_carry(v_pieces))
    has_tail = (length % P > 0) & (first <= full) & (full < end)
    accs, m, l = finish(lax.fori_loop(0, has_tail.astype(jnp.int32), tail_step, carry))
    out_at = seq * layer(O_ROW) + o_rows
    lanes = [(piece.own(), piece.at(), _own_lanes(piece, real, row_head)) for piece in v_pieces]
    _store(accs, m, l, slot, real, lanes, out_at, (out_ref, acc_ref, m_ref, l_ref), v_max, interpret)


def _run(run, head) -> tuple:
    """The ``_Reader`` fields of a run's heads (none for a unit of one head)."""
    if not run:
        return ()
    k, v = (tuple(head(at + i) for i in range(RUN_HEADS)) for at in (K_ENDS, V_ENDS))
    return head(NUM_HEADS), k, v


def _row_offsets(head, rows, row_head, group, reader, wide):
    """[BLOCK_H, 1] where each row's query starts in its sequence's q row (packed, or ``wide``), and its output in
    the output row. A run's row ``r`` is query ``r % G`` of its head ``r // G``, whose columns start after the run's
    earlier heads' (``per_byte`` x its first plane byte)."""
    r = rows[:, None]
    if reader.heads is None:
        return head(Q_BASE) + r * head(Q_STEP), head(O_BASE) + r * head(O_STEP)
    g, n = lax.rem(r, group), reader.n
    assert reader.k_ends is not None and reader.v_ends is not None
    (k0, k1), (v0, v1) = _span(reader.k_ends, row_head), _span(reader.v_ends, row_head)
    q = r * head(Q_STEP) + n * k0 if wide else group * n * k0 + g * n * (k1 - k0)
    return head(Q_BASE) + q, head(O_BASE) + group * n * v0 + g * n * (v1 - v0)


def _value_meta(start, head_index, page_size, t, visible, real, row_head, run):
    """Where a chunk's value scales are among the page's float16s, and which to read: [T] for one head; in a run
    [BLOCK_H, T], each row its own head's."""
    if run:
        return start + (head_index + row_head) * page_size + t[None, :], real[:, None] & visible[None, :]
    return start + head_index * page_size + t, visible


def _own_lanes(piece, real, row_head):
    """[BLOCK_H, tile] the lanes of each real row's own head (every real lane in a unit of one head)."""
    ok = real[:, None] if piece.ends is None else real[:, None] & (piece.head() == row_head)
    return _both(ok, piece.ok())


def _scores(qs, ks, precision):
    """Scores of the query pieces against the key pieces of the same columns: a dot a piece, summed."""
    return functools.reduce(operator.add, [plgpu.dot(q, k, trans_b=True, precision=precision) for q, k in zip(qs, ks)])


def _update(carry, parts):
    """The online-softmax update with the (scores, values) of a step's chunks. Row reductions cross the warps
    (through shared memory, with a barrier), so the chunks' tiles are combined elementwise first: one max, one sum
    and one sum of the values' row terms a step, however many chunks. A deferred carry (``empty_carry`` with
    ``rows``) keeps the sum and the row terms elementwise, rescaled as the accumulators are, and leaves their
    reductions to ``finish``: the max alone crosses the warps a step."""
    accs, m, l, z = carry
    top = functools.reduce(jnp.maximum, [s for s, _ in parts])
    m_new = jnp.maximum(m, top.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    ps = [jnp.exp2(s - m_new[:, None]) for s, _ in parts]
    accs = [acc * alpha[:, None] for acc in accs]
    rows = []
    for p, (_, values) in zip(ps, parts):
        pvs, row = values(p)
        accs = [acc + pv for acc, pv in zip(accs, pvs)]
        rows += [] if row is None else [row]
    p_sum = functools.reduce(operator.add, ps)
    if z is not None:  # deferred
        z = z * alpha[:, None] + (functools.reduce(operator.add, rows) if rows else 0.0)
        return accs, m_new, l * alpha[:, None] + p_sum, z
    if rows:
        total = jnp.sum(functools.reduce(operator.add, rows), axis=1)[:, None]
        accs = [acc + total for acc in accs]
    return accs, m_new, l * alpha + jnp.sum(p_sum, axis=1), None


def empty_carry(v_pieces, rows: int | None = None):
    """The online softmax before any chunk: a zero accumulator a V piece, ``MASK`` maxima, zero sums; with ``rows``
    (the chunks' rows), deferred (``_update``): the sums and the values' row terms [BLOCK_H, rows] each."""
    accs = [jnp.zeros((BLOCK_H, piece.tile), jnp.float32) for piece in v_pieces]
    m = jnp.full((BLOCK_H,), MASK, jnp.float32)
    if rows is None:
        return accs, m, jnp.zeros((BLOCK_H,), jnp.float32), None
    return accs, m, jnp.zeros((BLOCK_H, rows), jnp.float32), jnp.zeros((BLOCK_H, rows), jnp.float32)


def finish(carry):
    """(accumulators, maxima, sums) of a carry after its last update: a deferred one's reductions done."""
    accs, m, l, z = carry
    if z is None:
        return accs, m, l
    total = jnp.sum(z, axis=1)[:, None]
    return [acc + total for acc in accs], m, jnp.sum(l, axis=1)


def tail_update(carry, qs, pieces, tail_ref, rows, cols, visible, precision):
    """``_update`` with a chunk of exact rows from a tail (the query pieces ``qs`` in the dots' dtype): ``rows``
    [T, 1] each token's row offset in ``tail_ref``, ``cols`` the head's first (K, V) columns in a row, ``pieces`` its
    (K, V) pieces, ``visible`` [T] which tokens count."""
    dt = qs[0].dtype

    def load(first, piece):
        mask = _both(visible[:, None], piece.ok())
        return plgpu.load(tail_ref.at[rows + first + piece.at()], mask=mask, other=0).astype(dt)

    s = _scores(qs, [load(cols[0], piece) for piece in pieces[0]], precision)
    vs = [load(cols[1], piece) for piece in pieces[1]]
    values = lambda p: ([plgpu.dot(p.astype(dt), v, precision=precision) for v in vs], None)  # noqa: E731
    return _update(carry, [(jnp.where(visible[None, :], s, MASK), values)])


def _store(accs, m, l, slot, real, lanes, out_at, refs, v_max, interpret):
    """The group's only chunk (``slot`` < 0) writes its normalized output rows at ``out_at`` [BLOCK_H, 1] plus each
    lane's column in its own head; a chunk of a split group writes its partial (acc, m, l) to its slot, each lane at
    its column among the unit's, as ``merge.merge`` reads them. ``lanes``: per V piece (own column, unit column, which
    lanes of which rows are written). Interpret mode scatters every lane, so there masked lanes point past the
    buffers."""
    out_ref, acc_ref, m_ref, l_ref = refs
    direct = slot < 0
    rows = jnp.arange(BLOCK_H)
    part = jnp.maximum(slot, 0) * BLOCK_H + rows
    part_mask = real & ~direct
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    for acc, (own, unit_cols, mine) in zip(accs, lanes):
        out_mask = jnp.broadcast_to(mine & direct, acc.shape)
        acc_mask = jnp.broadcast_to(mine & part_mask[:, None], acc.shape)
        at, acc_at = out_at + own, part[:, None] * v_max + unit_cols
        if interpret:
            at, acc_at = jnp.where(out_mask, at, NOWHERE), jnp.where(acc_mask, acc_at, NOWHERE)
        plgpu.store(out_ref.at[at], (acc * inv_l[:, None]).astype(out_ref.dtype), mask=out_mask)
        plgpu.store(acc_ref.at[acc_at], acc, mask=acc_mask)
    if interpret:
        part = jnp.where(part_mask, part, NOWHERE)
    plgpu.store(m_ref.at[part], m, mask=part_mask)
    plgpu.store(l_ref.at[part], l, mask=part_mask)


def _kernel(index_ref, items_ref, counts_ref, lengths_ref, heads_ref, *refs, geo, only, chained, **static):
    """The items of this program whose head's class is one of ``only`` (indices into ``geo.classes``), each by its
    class's branch; ``chained``: the output buffers also came in as inputs (``launch_and_merge``), unused here."""
    pid, layer = pl.program_id(0), index_ref[0]
    refs = (heads_ref, *(refs[:-8] + refs[-4:] if chained else refs))
    branches = [functools.partial(_attend_item, c, refs=refs, geo=geo, **static) for c in only]

    def run(i, carry):
        seq, unit = items_ref[layer, pid, i, SEQ], items_ref[layer, pid, i, UNIT]
        item = (
            seq,
            unit,
            items_ref[layer, pid, i, FIRST_PAGE],
            items_ref[layer, pid, i, END_PAGE],
            items_ref[layer, pid, i, SLOT],
            lengths_ref[seq],
        )
        cls = heads_ref[unit * HEAD_FIELDS + CLASS]
        if len(only) == len(geo.classes) == 1:
            branches[0](item)
        elif len(only) == len(geo.classes):
            lax.switch(cls, [lambda it, b=b: b(it) for b in branches], item)
        elif len(only) == 1:  # an item of another kernel's class is skipped
            lax.cond(cls == only[0], branches[0], lambda it: None, item)
        else:  # branch 0 skips an item of another kernel's class
            which = functools.reduce(operator.add, [jnp.where(cls == c, j + 1, 0) for j, c in enumerate(only)])
            lax.switch(which, [lambda it: None] + [lambda it, b=b: b(it) for b in branches], item)
        return carry

    lax.fori_loop(0, counts_ref[layer, pid], run, 0)


def kernel_name(classes) -> str:
    """A kernel's name from the head classes it runs (the same in every layer, so CUPTI rows name the class):
    ``kvjax_quantized_decode_p32_g16_run`` is a run whose K is read in planes of 32 columns, its V gathered at 16."""
    tags = ["_".join(f"{side[0][0]}{side[1]}" for side in c[:2]) + ("_run" if len(c) > 2 else "") for c in classes]
    return "kvjax_quantized_decode_" + "__".join(tags)


def check_format(layout: HeadLayout, fmt) -> PageFormat:
    """``fmt`` if it is the quantized page format of ``layout``'s heads, else a ValueError saying why not."""
    return PageFormat.check_serves(layout, fmt, "quant.PageFormat")


def _check_schedule_config(config: DecodeConfig, bits: Sequence[int]) -> None:
    """A schedule config of one head a unit, or of runs whose planes fill 16 columns (``plan_config``)."""
    least = 16 * (8 // min(bits))
    if config.pack_tile and not (
        config.pack_min_cols >= least and config.pack_tile <= PACK_TILE and config.pack_max_heads <= RUN_HEADS
    ):
        raise ValueError(
            "quantized decode reads one KV head a unit (pack_tile=0), or runs of heads with pack_tile <= "
            f"{PACK_TILE}, pack_min_cols >= {least} and pack_max_heads <= {RUN_HEADS} (quant_kernel.plan_config); "
            f"got pack_tile={config.pack_tile}, pack_min_cols={config.pack_min_cols}, "
            f"pack_max_heads={config.pack_max_heads}"
        )


@functools.partial(jax.jit, static_argnames=("layout", "fmt", "kernel", "interpret", "shared"))
def quantized_paged_decode(
    q,
    pages,
    tail,
    block_table,
    lengths,
    schedule: DecodeSchedule,
    layout: HeadLayout,
    fmt: PageFormat,
    *,
    kernel: QuantKernelConfig = QUANT_KERNEL,
    interpret: bool = False,
    shared: tuple[HeadLayout, ...] | None = None,
):
    """One new query per sequence against its quantized cache; equal to ``reference.quantized_decode_attention``.

    q [B, q_cols] packed, or wide [B, >= H, k_cols] (``models.rotation.QKRotation.wide``: the kernel reads each
    head's own columns of its row); pages [num_pages, fmt.page_bytes] uint8 (``quant.PageFormat``); tail [>= B,
    page_size, k_cols + v_cols] (row i: sequence i's partial last page, ``quant_paging``); block_table [B,
    pages_per_seq] int32; lengths [B] int32 (the new token included, already written); schedule: a ``DecodeSchedule``
    built under ``plan_config`` for these lengths or any they do not exceed, set to this layer (any schedule is
    correct; one built with ``classes=unit_kernels(...)`` keeps every class kernel busy).
    Returns [B, out_cols] in q's dtype; rows with length 0 are unspecified. ``shared``: the layouts of every layer
    that runs this kernel with the same bits and page size (default: ``layout`` alone); its code depends on them, not
    on ``layout``, so XLA compiles one kernel for all of them.
    """
    check_format(layout, fmt)
    config = schedule.config
    _check_schedule_config(config, [fmt.bits])
    shared = shared or (layout,)
    if layout not in shared:
        raise ValueError("layout must be one of the shared layouts")
    b = q.shape[0]
    p = fmt.page_size
    if pages.dtype != jnp.uint8 or pages.ndim != 2 or pages.shape[1] != fmt.page_bytes:
        raise ValueError(f"pages must be uint8 [num_pages, {fmt.page_bytes}], got {pages.dtype} {pages.shape}")
    if pages.size >= 2**31 or tail.size >= 2**31:
        raise ValueError("the quantized decode kernel addresses a layer's pool and tail with int32 offsets")
    if tail.ndim != 3 or tail.shape[0] < b or tail.shape[1:] != (p, fmt.k_cols + fmt.v_cols):
        raise ValueError(f"tail must be [>= {b}, {p}, {fmt.k_cols + fmt.v_cols}], got {tail.shape}")
    wide_rows = q.shape[1] if q.ndim == 3 else 0
    if wide_rows and (wide_rows < layout.num_heads or q.shape[2] != layout.k_cols):
        raise ValueError(f"a wide q must be [B, >= {layout.num_heads}, {layout.k_cols}], got {q.shape}")
    if not wide_rows and (q.ndim != 2 or q.shape[1] != layout.q_cols):
        raise ValueError(f"q must be [B, {layout.q_cols}] or wide [B, >= H, k_cols], got {q.shape}")
    if layout.group_size > BLOCK_H:
        raise ValueError(f"quantized decode scores at most {BLOCK_H} queries a KV head, got {layout.group_size}")
    geo = _geometry(tuple(shared), fmt.bits, p, wide_rows, config)
    heads, layer_row = (jnp.asarray(t) for t in _tables(layout, fmt, geo, wide_rows, config))
    runs = [r for lay in shared for r in head_runs(lay, config)]
    v_max = max(tile(r.v_cols) for r in runs)  # partial rows hold a unit's V columns
    v_tile = max(tile(w) for r in runs for w in r.v_widths)  # the merge reads a row's own head
    static = dict(
        geo=geo,
        wide=bool(wide_rows),
        bits=fmt.bits,
        page_size=p,
        group=layout.group_size,
        window=layout.sliding_window,
        scale=1.0 / math.sqrt(layout.head_dim),
        v_max=v_max,
        kernel=kernel,
        interpret=interpret,
    )
    index = jnp.asarray(schedule.index, jnp.int32)
    args = [
        index,
        schedule.items,
        schedule.counts,
        lengths.astype(jnp.int32),
        heads,
        layer_row,
        block_table.astype(jnp.int32),
        q.reshape(-1),
        pages.reshape(-1),
        lax.bitcast_convert_type(pages.reshape(-1, 2), jnp.float16),  # the metadata's view: a bitcast, no copy
        tail.reshape(-1),
    ]
    # the merge reads the bf16 op's tables of the layer (one head a unit): its output offsets and widths
    merge_tables = tables.layer_tables(
        layout, tables.run_classes(shared, config), config, tables.most_units(set(shared), config)
    )
    # one kernel a group of classes, cut as the schedule cuts them (``unit_kernels``), each by its classes' branch
    # indices
    per_unit = unit_kernels(layout, fmt.bits, config, kernel.classes_per_kernel)
    by_kernel: dict[int, set[int]] = {}
    for c, j in zip(head_classes(layout, fmt.bits, config), per_unit):
        by_kernel.setdefault(j, set()).add(geo.classes.index(c))
    groups = [tuple(sorted(by_kernel[j])) for j in sorted(by_kernel)]
    kernels = [functools.partial(_kernel, only=g, chained=i > 0, **static) for i, g in enumerate(groups)]
    out = launch_and_merge(
        kernels,
        args,
        schedule,
        jax.ShapeDtypeStruct((b * layout.out_cols,), q.dtype),
        tuple(jnp.asarray(t) for t in (merge_tables.units, merge_tables.rows, merge_tables.cols)),
        v_max=v_max,
        v_tile=v_tile,
        compiler_params=plgpu.CompilerParams(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
        interpret=interpret,
        name=[kernel_name(geo.classes[i] for i in g) for g in groups],
    )
    return out.reshape(b, layout.out_cols)


def kernel_groups(
    formats: dict[HeadLayout, PageFormat], cap: float, config: DecodeConfig = QUANT_DECODE
) -> dict[HeadLayout, tuple[HeadLayout, ...]]:
    """Each layout's kernel group: layouts of the same bits, group size, window and head dim share one compiled
    kernel while the classes of their heads (``head_classes``) together stay within ``cap`` (each class is one more
    branch of the kernel); layouts of the same classes always share."""
    groups: list[tuple[tuple, set, list[HeadLayout]]] = []  # (static key, classes, layouts)
    by_classes: dict[tuple, list[HeadLayout]] = {}
    for lay, fmt in formats.items():
        key = (fmt.bits, fmt.page_size, lay.group_size, lay.sliding_window, lay.head_dim)
        by_classes.setdefault((key, frozenset(head_classes(lay, fmt.bits, config))), []).append(lay)
    for (key, classes), lays in sorted(by_classes.items(), key=lambda kv: (-len(kv[0][1]), sorted(kv[0][1]))):
        fits = [g for g in groups if g[0] == key and len(g[1] | classes) <= cap]
        if fits:
            g = min(fits, key=lambda g: len(g[1] | classes) - len(g[1]))
            g[1].update(classes)
            g[2].extend(lays)
        else:
            groups.append((key, set(classes), list(lays)))
    return {lay: tuple(g[2]) for g in groups for lay in g[2]}


class QuantDecodeOp(DecodeOp):
    """Decode attention over a model's quantized layers, held by the engine as it holds ``op.DecodeOp``:
    ``schedule(lengths)`` on the host (the bf16 op's schedule cache, one KV head a unit), ``run`` one layer on the
    device.

    ``bits``: the code width of every layer, or one per layout (4 or 2); ``formats``: the layers' page formats
    instead (one per layout, each ``PageFormat.for_layout`` of it). ``config``: the schedule's config, with
    ``pack_tile`` 0; ``kernel``: how the kernel runs (``QuantKernelConfig``). ``batch_invariant``: each sequence is
    split by its own length alone (``schedule.fixed_chunk_schedule``). Queries come wide (``wide_queries``: the engine
    rotates them with ``QKRotation.wide``), or packed."""

    wide_queries = True

    def __init__(
        self,
        layouts,
        page_size: int,
        pages_per_seq: int,
        *,
        bits: int | Sequence[int] = 4,
        formats: Sequence[PageFormat] | None = None,
        max_batch: int = 1,
        config: DecodeConfig = QUANT_DECODE,
        kernel: QuantKernelConfig = QUANT_KERNEL,
        num_programs: int | None = None,
        batch_invariant: bool = False,
        interpret: bool = False,
    ):
        layouts = as_layouts(layouts)
        if formats is None:
            per_layer = [bits] * len(layouts) if isinstance(bits, (int, np.integer)) else list(bits)
            if len(per_layer) != len(layouts):
                raise ValueError(f"{len(per_layer)} bit widths for {len(layouts)} layouts")
            formats = [PageFormat.for_layout(lay, page_size, check_bits(b)) for lay, b in zip(layouts, per_layer)]
        formats = list(formats)
        if len(formats) != len(layouts):
            raise ValueError(f"{len(formats)} page formats for {len(layouts)} layouts")
        self.formats: dict[HeadLayout, PageFormat] = {}
        for lay, fmt in zip(layouts, formats):
            check_format(lay, fmt)
            if fmt.page_size != page_size:
                raise ValueError(f"a page format of {fmt.page_size} tokens a page for pages of {page_size}")
            if self.formats.setdefault(lay, fmt) != fmt:
                raise ValueError(f"two page formats for one layout: {self.formats[lay]} and {fmt}")
        _check_schedule_config(config, [f.bits for f in formats])
        self.config, self.kernel, self.interpret = config, kernel, interpret
        # a kernel a class (``classes_per_kernel`` 1) is the same code for every layer that shares the geometry: one
        # group of all layers; kernels that switch between classes group layers under ``config.kernel_classes``
        cap = config.kernel_classes if kernel.classes_per_kernel > 1 else math.inf
        self.groups = kernel_groups(self.formats, cap, config)
        # each kernel's units scheduled over all programs on their own (batch-invariant schedules split by length alone)
        classes = None
        if not batch_invariant:
            per = kernel.classes_per_kernel
            classes = [unit_kernels(lay, fmt.bits, config, per) for lay, fmt in zip(layouts, formats)]
        self._schedule_cache(
            layouts, page_size, pages_per_seq, max_batch, config, num_programs, batch_invariant, classes
        )

    def run(self, q, pages, tail, block_table, lengths, schedule: DecodeSchedule, layout: HeadLayout, rebuild=None):
        """One layer's attention (``schedule``: that layer's, ``DecodeSchedule.layer``; ``layout``: one of the op's
        layouts); see ``quantized_paged_decode``. No ``rebuild``: quantized pages of rebuilt keys (Palu's, banded
        ZACK's) are refused before an engine is built (``compression.plan.check_kv_bits``)."""
        if rebuild is not None:
            raise ValueError("quantized decode reads no rebuilt keys (Palu, banded ZACK)")
        shared = self.groups.get(layout)
        if shared is None:
            raise ValueError(f"{layout} is not one of the layouts this decode op was built for")
        return quantized_paged_decode(
            q,
            pages,
            tail,
            block_table,
            lengths,
            schedule,
            layout,
            self.formats[layout],
            kernel=self.kernel,
            interpret=self.interpret,
            shared=shared,
        )
