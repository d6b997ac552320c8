"""The decode op's merge step: the partial softmax states of each split group folded into its packed output rows
(Pallas, Triton lowering; as FlashInfer's merge of split-KV states).

A split group is (sequence, run of heads); its chunks wrote (acc, max, sum) per row to adjacent partial slots of
``ROWS`` rows each (row ``i*G + g``: query g of the run's head i, over the run's V columns). One program per merge
row of the schedule folds its group's slots in chunk order with the online-softmax update, so it reads only the
slots the plan used, and the result depends on the group alone (the batch-invariant plans rely on this). Each row
reads and writes its own head's columns, so the tile is one head wide, and lands at its place in the packed output,
which is updated in place: rows of groups that were not split keep what the decode kernel wrote.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.units import Run
from kvjax.ops.pallas_util import MASK, load_rows, store_rows
from kvjax.ops.tiles import tile


def row_tables(layout: HeadLayout, runs: tuple[Run, ...]) -> np.ndarray:
    """int32 [3, units * ROWS]: per run and partial row, where the row's head starts among the run's V columns,
    where its output starts in a packed output row, and its width (0 for rows past the run's)."""
    g = layout.group_size
    o_off = HeadLayout.offsets(layout.v_widths, g)
    table = np.zeros((3, len(runs), ROWS), np.int32)
    for u, run in enumerate(runs):
        for i, (start, width) in enumerate(zip(run.v_starts, run.v_widths)):
            rows = slice(i * g, (i + 1) * g)
            table[:, u, rows] = np.array([start, 0, width])[:, None]
            table[1, u, rows] = o_off[run.first + i] + np.arange(g) * width
    return table.reshape(3, -1)


def _merge_kernel(dest_ref, range_ref, table_ref, acc_ref, m_ref, l_ref, _, out_ref, *, v, out_cols, v_tile, interpret):
    g = pl.program_id(0)
    seq = dest_ref[g, 0]

    @pl.when(seq >= 0)
    def _():
        rows = jnp.arange(ROWS)
        at = dest_ref[g, 1] * ROWS + rows
        start, to, width = (plgpu.load(table_ref.at[i, at]) for i in range(3))
        live = width > 0
        cols = jnp.arange(v_tile)[None, :]
        cols_ok = live[:, None] & (cols < width[:, None])

        def fold(s, carry):
            acc, m, l = carry
            part = (range_ref[g, 0] + s) * ROWS + rows
            m_s = plgpu.load(m_ref.at[part], mask=live, other=MASK)
            l_s = plgpu.load(l_ref.at[part], mask=live, other=0.0)
            a_s = load_rows(acc_ref, part, v, start[:, None], cols, cols_ok)
            m_new = jnp.maximum(m, m_s)
            alpha, beta = jnp.exp2(m - m_new), jnp.exp2(m_s - m_new)
            return acc * alpha[:, None] + a_s * beta[:, None], m_new, l * alpha + l_s * beta

        init = (jnp.zeros((ROWS, v_tile), jnp.float32), jnp.full((ROWS,), MASK, jnp.float32), jnp.zeros((ROWS,)))
        acc, _, l = lax.fori_loop(0, range_ref[g, 1], fold, init)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        store_rows(out_ref, jnp.full((ROWS,), seq), out_cols, to[:, None], cols, out, cols_ok, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("layout", "runs", "interpret"))
def merge(out, acc, m, l, merge_dest, merge_range, layout: HeadLayout, runs: tuple[Run, ...], *, interpret=False):
    """``out`` [B, out_cols] with every split group's rows replaced by the merge of its partials.

    acc [slots * ROWS, v] float32, m and l [slots * ROWS] float32 (log2 units); merge_dest, merge_range [M, 2]:
    one layer's ``DecodeSchedule`` fields (seq -1: no group)."""
    table = jnp.asarray(row_tables(layout, runs))
    kernel = functools.partial(
        _merge_kernel, v=acc.shape[1], out_cols=out.shape[1], v_tile=tile(max(layout.v_widths)), interpret=interpret
    )
    merged = pl.pallas_call(
        kernel,
        grid=(merge_dest.shape[0],),
        out_shape=jax.ShapeDtypeStruct((out.size,), out.dtype),
        input_output_aliases={6: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kvjax_decode_merge",
    )(merge_dest, merge_range, table, acc.reshape(-1), m, l, out.reshape(-1))
    return merged.reshape(out.shape)
