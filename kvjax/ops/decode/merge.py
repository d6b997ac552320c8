"""The decode op's merge step (Pallas, Triton lowering; as FlashInfer's merge of split-KV states): ``merge`` folds
the partial softmax states (acc, max, sum) of each split group into its rows of the packed output, in place.

A split group is (sequence, run of heads), and its chunks wrote adjacent partial slots. The merge reads only the
slots the schedule used, and its result depends on the group alone (the batch-invariant schedules rely on this);
rows of groups that were not split keep what the decode kernel wrote. Widths and offsets are read at run time, so
the layers of a kernel group share one compiled merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.ops import columns
from kvjax.ops.decode import tables
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.pallas_util import MASK, load_rows, store_rows, whole_block

SLOTS = 16  # partial slots a merge step reads at once


def _merge_kernel(
    index_ref, dest_ref, range_ref, units_ref, rows_ref, cols_ref, acc_ref, m_ref, l_ref, _, out_ref, **static
):
    g, row, layer = pl.program_id(0), pl.program_id(1), index_ref[0]
    seq, unit = dest_ref[layer, g, 0], dest_ref[layer, g, 1]

    @pl.when(seq >= 0)
    def _():
        width = rows_ref[(unit * tables.ROW_FIELDS + tables.V_WIDTH) * ROWS + row] * columns.UNIT

        @pl.when(width > 0)  # rows past the run's heads have no columns
        def _():
            first, count = range_ref[layer, g, 0], range_ref[layer, g, 1]
            refs = (units_ref, rows_ref, cols_ref, acc_ref, m_ref, l_ref, out_ref)
            _merge_row(seq, unit, row, width, first, count, refs, **static)


def _merge_row(seq, unit, row, width, first, count, refs, *, v_max, v_tile, interpret):
    """Fold score-tile row ``row`` of the ``count`` partial slots from ``first`` of (``seq``, ``unit``) into its
    output row (``refs``: the unit, row and column tables, the partial acc, m and l, and the output)."""
    units_ref, rows_ref, cols_ref, acc_ref, m_ref, l_ref, out_ref = refs

    def field(f):
        return rows_ref[(unit * tables.ROW_FIELDS + f) * ROWS + row] * columns.UNIT

    start = field(tables.V_START)
    to = units_ref[unit * tables.UNIT_FIELDS + tables.O_OFF] * columns.UNIT + field(tables.O_ROW) + start
    cols = jnp.arange(v_tile)[None, :]
    cols_ok = cols < width

    def step(b, carry):
        acc, m, l = carry
        slot = b * SLOTS + jnp.arange(SLOTS)
        live = slot < count
        part = (first + slot) * ROWS + row
        m_s = plgpu.load(m_ref.at[part], mask=live, other=MASK)
        l_s = plgpu.load(l_ref.at[part], mask=live, other=0.0)
        a_s = load_rows(acc_ref, part, v_max, start, cols, cols_ok, live)
        m_new = jnp.maximum(m, jnp.max(m_s))
        alpha, beta = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)
        return acc * alpha + jnp.sum(a_s * beta[:, None], axis=0, keepdims=True), m_new, l * alpha + jnp.sum(l_s * beta)

    init = (jnp.zeros((1, v_tile), jnp.float32), jnp.float32(MASK), jnp.float32(0.0))
    acc, _, l = lax.fori_loop(0, pl.cdiv(count, SLOTS), step, init)
    out = acc / jnp.where(l > 0, l, 1.0)
    o_cols = cols_ref[columns.O_COLS] * columns.UNIT
    store_rows(out_ref, jnp.full((1,), seq), o_cols, to, cols, out, cols_ok, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("v_max", "v_tile", "interpret"))
def merge(
    out, acc, m, l, index, merge_dest, merge_range, units, rows, cols, *, v_max: int, v_tile: int, interpret=False
):
    """Flat packed output ``out`` [B * out_cols] with every split group's rows replaced by the merge of its partials.

    acc [slots * ROWS * v_max] float32, m and l [slots * ROWS] float32 (log2 units); merge_dest, merge_range
    [L, M, 2]: the ``DecodeSchedule`` fields of every layer (seq -1: no group), of which layer ``index`` [1] int32
    is read; units, rows, cols: the layer's ``tables.LayerTables``; ``v_tile``: a tile as wide as the widest head's V
    columns."""
    kernel = functools.partial(_merge_kernel, v_max=v_max, v_tile=v_tile, interpret=interpret)
    args = [jnp.asarray(index, jnp.int32), merge_dest, merge_range, units, rows, cols, acc, m, l, out]
    return pl.pallas_call(
        kernel,
        grid=(merge_dest.shape[-2], ROWS),
        in_specs=[whole_block(x) for x in args],
        out_specs=whole_block(out),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={9: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kvjax_decode_merge",
    )(*args)
