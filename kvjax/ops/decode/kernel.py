"""The decode op's run step: paged attention over KV heads of different widths, one persistent program per
schedule row (Pallas, Triton lowering).

Each program walks its row of the host-built ``plan.DecodeSchedule``: for every item (sequence, unit, chunk of
pages) it loads the unit's query heads once ([16, k_tile], rows past the real ones masked), streams the chunk's K
and V rows out of the packed pages through the block table with an online softmax, and writes either the
normalized output (the group's only chunk) or a partial (acc, max, sum) that ``merge.merge`` combines.

A unit is a run of adjacent KV heads (``units``): row ``i*G + g`` of the score tile holds query g of head i, masked
to head i's columns of the run's K tile, so each row scores only its own head, and one page lookup per token and
one padded tile serve the whole run. A step moves ``block_tokens * 256 / (k_tile + v_tile)`` tokens (capped), so
bytes in flight stay constant as widths shrink; when a unit fills few of the 16 rows, the step's tokens fold into
the spare rows (``folds``). Steps with every token visible run unmasked. Units of one shape share a code path,
picked per item by ``lax.switch``; column offsets come from static tables in multiples of 16, so loads are 16-byte
vectors that never touch a column the unit does not own. A run's K or V columns are read as two power-of-two
pieces where that saves ``piece_saving`` columns (160 = 128 + 32).

Why Triton: decode is a gather of ``[tokens, width]`` tiles at 16-column offsets inside packed rows through the
block table, which masked pointer loads express directly, the pipeliner overlaps the next tile's loads with the
current dots, and ``interpret=True`` runs the same kernel on the CPU for CI. Mosaic GPU would need one TMA
descriptor per head width and offset, and has no CPU interpreter. Neither lowering has scalar prefetch, so the
schedule is an ordinary int32 input read with scalar loads. Where the time goes: bench/RESULTS.md "Decode: where
the time goes (Nsight Compute)".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DecodeConfig
from kvjax.ops.decode.cost import ROWS, loaded
from kvjax.ops.decode.merge import merge
from kvjax.ops.decode.plan import END_PAGE, FIRST_PAGE, SEQ, SLOT, UNIT, DecodeSchedule
from kvjax.ops.decode.units import RunShape, head_runs
from kvjax.ops.pallas_util import LOG2E, MASK, column_offsets, dot_precision, load_columns, lookup, offset16
from kvjax.ops.tiles import pow2_floor, segments

BLOCK_H = ROWS  # query rows per item: a GQA group (G <= 8) padded to the tensor cores' smallest M


@dataclasses.dataclass(frozen=True)
class RunClass(RunShape):
    """The runs of one layer that share a shape, with each run's first-head column offsets in units of 16: a run
    of n heads reads like one head ``k_cols`` + ``v_cols`` wide whose score tile has n * G real rows."""

    units: tuple[int, ...] = ()  # the runs' indices in the layer (the schedule's unit ids)
    q_off: tuple[int, ...] = ()
    k_off: tuple[int, ...] = ()
    v_off: tuple[int, ...] = ()
    o_off: tuple[int, ...] = ()


def run_classes(layout: HeadLayout, config: DecodeConfig) -> tuple[tuple[RunClass, ...], tuple[int, ...]]:
    """The layer's run classes (runs from ``units.head_runs(layout, config)``), and each run's class index."""
    offs = column_offsets(layout)
    runs = head_runs(layout, config)
    shapes = list(dict.fromkeys(r.shape for r in runs))
    classes = []
    for shape in shapes:
        units = tuple(u for u, r in enumerate(runs) if r.shape == shape)
        classes.append(
            RunClass(
                shape.k_widths,
                shape.v_widths,
                units,
                *(tuple(offs[n][runs[u].first] // 16 for u in units) for n in "qkvo"),
            )
        )
    return tuple(classes), tuple(shapes.index(r.shape) for r in runs)


def step_tokens(k_tile: int, v_tile: int, block_tokens: int, max_tokens: int) -> int:
    """Tokens per loop step for a head class: ``block_tokens`` at 128+128 wide, more for narrower heads, capped."""
    return min(max_tokens, pow2_floor(block_tokens * 256 / (k_tile + v_tile)))


def folds(group: int, k_tile: int, step: int, fold_tokens: int) -> int:
    """How many token chunks of a step share the 16-row score tile (a power of two).

    A group has G real query rows; with F folds, rows ``c*G .. c*G+G-1`` score chunk ``c`` of the step, so softmax
    work per byte falls F-fold. Bounded by the rows (F*G <= 16), by chunks of at least ``fold_tokens`` tokens, and
    by F*k_tile <= 256 (the F masked copies of q live in registers for the whole item)."""
    return max(1, min(pow2_floor(BLOCK_H // group), step // fold_tokens, 256 // k_tile))


def _per_row(values, index):
    """A per-head static table as a value per row (``index``: the row's head in its run); a plain int when every
    head has the same value (so one head's code stays as it was)."""
    return values[0] if len(set(values)) == 1 else lookup(index, tuple(range(len(values))), values)


def _in_head(cols, start, width):
    """Which of a run's ``cols`` belong to the row's head (columns ``start .. start + width - 1``)."""
    return cols < width if isinstance(start, int) and start == 0 else (cols >= start) & (cols < start + width)


def _attend_item(cls, item, refs, *, group, rows_per_slot, page_size, window, scale, config: DecodeConfig):
    """Online-softmax attention of one item (its run class's widths are static) and the write of its result."""
    table_ref, q_ref, k_ref, v_ref, out_ref, acc_ref, m_ref, l_ref = refs
    seq, unit, first, end, slot, length = item
    run_rows = cls.num_heads * group  # real rows of the score tile: head i of the run has rows i*G .. i*G+G-1
    k_pieces, v_pieces = (segments(c, config.max_segments, config.piece_saving) for c in (cls.k_cols, cls.v_cols))
    kt, vt = (sum(t for _, t, _ in pieces) for pieces in (k_pieces, v_pieces))
    bt = step_tokens(kt, vt, config.block_tokens, config.max_step_tokens)
    nf = folds(run_rows, kt, bt, config.fold_tokens)
    bc = bt // nf  # tokens per chunk
    precision = dot_precision(k_ref.dtype)
    qo, ko, vo, oo = (offset16(unit, cls.units, offs) for offs in (cls.q_off, cls.k_off, cls.v_off, cls.o_off))

    rows = jnp.arange(BLOCK_H)[:, None]
    chunk_of_row, head_of_row, query_of_row = rows // run_rows, rows % run_rows // group, rows % group
    k_start, k_width = _per_row(cls.k_starts, head_of_row), _per_row(cls.k_widths, head_of_row)
    v_start, v_width = _per_row(cls.v_starts, head_of_row), _per_row(cls.v_widths, head_of_row)
    q_row = _per_row(tuple(group * s for s in cls.k_starts), head_of_row) + query_of_row * k_width - k_start
    o_row = _per_row(tuple(group * s for s in cls.v_starts), head_of_row) + query_of_row * v_width - v_start

    def fold(x, c):  # rows of chunk c kept, the others zeroed
        return x if nf == 1 else jnp.where(chunk_of_row == c, x, 0).astype(x.dtype)

    def load_q(start, t, w):
        cols = start + jnp.arange(t)[None, :]  # the run's K columns
        mask = (rows < nf * run_rows) & _in_head(cols, k_start, k_width)
        q = plgpu.load(q_ref.at[seq, jnp.where(mask, qo + q_row + cols, 0)], mask=mask, other=0.0)
        q = (q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype)  # scores come out in log2 units
        return [fold(q, c) for c in range(nf)]

    q_folds = [load_q(*piece) for piece in k_pieces]  # [piece][fold]

    lo = first * page_size
    hi = jnp.minimum(end * page_size, length)
    visible_from = jnp.maximum(length - window, 0) if window else 0
    pages_per_seq = table_ref.shape[1]

    def load_chunk(tok, masked):
        """K and V pieces [bc, tile] of tokens ``tok`` through the block table, and which of them are visible."""
        valid = (tok < hi) & (tok >= visible_from) if masked else None
        if masked:
            page = plgpu.load(table_ref.at[seq, jnp.minimum(tok // page_size, pages_per_seq - 1)], mask=valid, other=0)
        else:
            page = table_ref[seq, tok // page_size]
        row = (page * page_size + tok % page_size)[:, None]
        ks = [load_columns(k_ref, (row,), ko + a, jnp.arange(t)[None, :], w, valid) for a, t, w in k_pieces]
        vs = [load_columns(v_ref, (row,), vo + a, jnp.arange(t)[None, :], w, valid) for a, t, w in v_pieces]
        return ks, vs, valid

    def step(j, carry, masked):
        accs, m, l = carry
        chunks = [load_chunk(lo + j * bt + c * bc + jnp.arange(bc), masked) for c in range(nf)]
        s = functools.reduce(
            operator.add,
            [
                plgpu.dot(q_folds[i][c], k, trans_b=True, precision=precision)
                for c, (ks, _, _) in enumerate(chunks)
                for i, k in enumerate(ks)
            ],
        )
        if masked:
            visible = functools.reduce(
                operator.or_, [(chunk_of_row == c) & valid[None, :] for c, (_, _, valid) in enumerate(chunks)]
            )
            s = jnp.where(visible, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        pv = p.astype(k_ref.dtype)
        p_folds = [fold(pv, c) for c in range(nf)]
        accs = tuple(
            acc * alpha[:, None]
            + functools.reduce(
                operator.add, [plgpu.dot(pf, vs[i], precision=precision) for pf, (_, vs, _) in zip(p_folds, chunks)]
            )
            for i, acc in enumerate(accs)
        )
        return accs, m_new, l * alpha + p.sum(axis=1)

    carry = (
        tuple(jnp.zeros((BLOCK_H, t), jnp.float32) for _, t, _ in v_pieces),
        jnp.full((BLOCK_H,), MASK, jnp.float32),
        jnp.zeros((BLOCK_H,), jnp.float32),
    )
    span = jnp.maximum(hi - lo, 0)
    full = 0 if window else span // bt  # steps with every token visible run without masks
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    accs, m, l = lax.fori_loop(full, pl.cdiv(span, bt), functools.partial(step, masked=True), carry)
    if nf > 1:
        accs, m, l = _unfold(accs, m, l, run_rows, nf)

    # Masked lanes get out-of-range indices: the GPU never touches them, and interpret mode drops them rather than
    # letting a masked lane's write-back collide with a real lane's store.
    direct = slot < 0
    part = jnp.maximum(slot, 0) * rows_per_slot + jnp.arange(BLOCK_H)
    part_mask = (jnp.arange(BLOCK_H) < run_rows) & ~direct
    part = jnp.where(part_mask, part, m_ref.shape[0])
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    for acc, (a, t, w) in zip(accs, v_pieces):
        cols = a + jnp.arange(t)[None, :]  # the run's V columns
        out_mask = (rows < run_rows) & _in_head(cols, v_start, v_width) & direct
        plgpu.store(
            out_ref.at[seq, jnp.where(out_mask, oo + o_row + cols, out_ref.shape[1])],
            (acc * inv_l[:, None]).astype(out_ref.dtype),
            mask=out_mask,
        )
        plgpu.store(acc_ref.at[part[:, None], cols], acc, mask=part_mask[:, None] & (cols < a + w))
    plgpu.store(m_ref.at[part], m, mask=part_mask)
    plgpu.store(l_ref.at[part], l, mask=part_mask)


def _unfold(accs, m, l, group, nf):
    """Merge the softmax states of the folds: row ``c*G + g`` into row ``g`` (rows past G are left undefined)."""
    r = jnp.arange(BLOCK_H)
    head_of_row, real = r % group, r < nf * group
    m_head = jnp.full((BLOCK_H,), MASK, jnp.float32)
    for g in range(group):
        m_head = jnp.where(head_of_row == g, jnp.max(jnp.where(real & (head_of_row == g), m, MASK)), m_head)
    w = jnp.where(real, jnp.exp2(m - m_head), 0.0)
    l_head = jnp.zeros((BLOCK_H,), jnp.float32)
    for g in range(group):
        l_head = jnp.where(head_of_row == g, jnp.sum(jnp.where(head_of_row == g, l * w, 0.0)), l_head)
    same_head = (head_of_row[:, None] == head_of_row[None, :]).astype(jnp.float32)
    accs = tuple(plgpu.dot(same_head, acc * w[:, None], precision=lax.Precision.HIGHEST) for acc in accs)
    return accs, m_head, l_head


def _kernel(items_ref, counts_ref, lengths_ref, *refs, classes, class_of, **static):
    pid = pl.program_id(0)
    branches = [functools.partial(_attend_item, cls, refs=refs, **static) for cls in classes]
    units = tuple(range(len(class_of)))

    def run(i, carry):
        seq, unit = items_ref[pid, i, SEQ], items_ref[pid, i, UNIT]
        item = (
            seq,
            unit,
            items_ref[pid, i, FIRST_PAGE],
            items_ref[pid, i, END_PAGE],
            items_ref[pid, i, SLOT],
            lengths_ref[seq],
        )
        if len(branches) == 1:
            branches[0](item)
        else:
            lax.switch(lookup(unit, units, class_of), [lambda it, b=b: b(it) for b in branches], item)
        return carry

    lax.fori_loop(0, counts_ref[pid], run, 0)


@functools.partial(jax.jit, static_argnames=("layout", "interpret"))
def paged_decode(
    q, k_pages, v_pages, block_table, lengths, schedule: DecodeSchedule, layout: HeadLayout, *, interpret: bool = False
):
    """One new query per sequence against its paged cache; equal to ``reference.paged_decode_attention``.

    q [B, q_cols]; k_pages [num_pages, page_size, k_cols], v_pages likewise; block_table [B, pages_per_seq] int32;
    lengths [B] int32 (the new token included); schedule: one layer's ``DecodeSchedule`` built for these lengths
    or any they do not exceed (its ``config`` says how units were cut and how the kernel runs). Returns
    [B, out_cols] in q's dtype. Rows with length 0 are unspecified.
    """
    config = schedule.config
    b = q.shape[0]
    num_pages, page_size, _ = k_pages.shape
    g = layout.group_size
    classes, class_of = run_classes(layout, config)
    rows = BLOCK_H * schedule.num_slots  # a partial slot has a row per row of the score tile
    v_max = max(loaded(c.v_cols, config) for c in classes)
    kernel = functools.partial(
        _kernel,
        classes=classes,
        class_of=class_of,
        group=g,
        rows_per_slot=BLOCK_H,
        page_size=page_size,
        window=layout.sliding_window,
        scale=1.0 / math.sqrt(layout.head_dim),
        config=config,
    )
    out_shape = (
        jax.ShapeDtypeStruct((b, layout.out_cols), q.dtype),
        jax.ShapeDtypeStruct((rows, v_max), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
    )
    out, acc, m, l = pl.pallas_call(
        kernel,
        grid=(schedule.num_programs,),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="kvjax_paged_decode",
    )(
        schedule.items,
        schedule.counts,
        lengths.astype(jnp.int32),
        block_table.astype(jnp.int32),
        q,
        k_pages.reshape(num_pages * page_size, -1),
        v_pages.reshape(num_pages * page_size, -1),
    )
    runs = head_runs(layout, config)
    return merge(out, acc, m, l, schedule.merge_dest, schedule.merge_range, layout, runs, interpret=interpret)
