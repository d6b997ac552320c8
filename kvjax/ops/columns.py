"""Where each KV head's columns sit in a layer's packed rows, in the one int32 encoding the decode, prefill and Palu
kernels read at run time (so layers whose heads fit the same tiles share one compiled kernel: bench/results/startup.md
"Engine: compile times"). Offsets and widths count units of 16 columns, multiplied back in the kernel, so every head
starts 16-aligned and loads as 16-byte vectors. ``head_columns``: a row a KV head, fields ``Q_OFF, K_OFF, V_OFF,
O_OFF, K_WIDTH, V_WIDTH`` (a kernel may append its own after ``HEAD_FIELDS``); ``row_widths``: a layer's ``Q_COLS,
K_COLS, V_COLS, O_COLS``; ``read_head`` and ``read_widths`` read them inside a kernel. The decode kernel's unit
table (``ops.decode.tables``) places runs of heads from the same offsets."""

from __future__ import annotations

import numpy as np

from kvjax.layout import HeadLayout

UNIT = 16  # columns a stored offset or width counts
Q_OFF, K_OFF, V_OFF, O_OFF, K_WIDTH, V_WIDTH = range(6)  # fields of a head table row
HEAD_FIELDS = 6
Q_COLS, K_COLS, V_COLS, O_COLS = range(4)  # entries of a layer's row widths


def column_offsets(layout: HeadLayout) -> dict[str, list[int]]:
    """Each KV head's first column in packed q, K, V and output rows (keys "q", "k", "v", "o"), multiples of 16;
    a ValueError names the layout where a width is not a multiple of 16 (the kernels cannot load it)."""
    g = layout.group_size
    offs = dict(
        q=HeadLayout.offsets(layout.k_widths, g),
        k=HeadLayout.offsets(layout.k_widths),
        v=HeadLayout.offsets(layout.v_widths),
        o=HeadLayout.offsets(layout.v_widths, g),
    )
    if any(o % UNIT for lst in offs.values() for o in lst) or any(w % UNIT for w in layout.k_widths + layout.v_widths):
        raise ValueError(f"head widths must be multiples of 16 for the Pallas kernels: {layout}")
    return offs


def head_columns(layout: HeadLayout, heads=None, q_width: int | None = None) -> np.ndarray:
    """int32 [len(heads), HEAD_FIELDS] (default: every KV head, in order), in units of 16. ``q_width``: queries come
    unpacked, every query head ``q_width`` columns wide (Palu's full-width queries), so head h's queries start at
    ``h * G * q_width``."""
    offs, g = column_offsets(layout), layout.group_size
    heads = range(layout.num_kv_heads) if heads is None else heads
    rows = [
        (
            offs["q"][h] if q_width is None else h * g * q_width,
            offs["k"][h],
            offs["v"][h],
            offs["o"][h],
            layout.k_widths[h],
            layout.v_widths[h],
        )
        for h in heads
    ]
    return np.asarray(rows, np.int32).reshape(-1, HEAD_FIELDS) // UNIT


def row_widths(layout: HeadLayout, q_cols: int | None = None) -> np.ndarray:
    """int32 [4]: the layer's packed q, K, V and output row widths in units of 16 (``q_cols``: the query row's, where
    queries do not come packed)."""
    q = layout.q_cols if q_cols is None else q_cols
    return np.asarray([q, layout.k_cols, layout.v_cols, layout.out_cols], np.int32) // UNIT


def read_head(ref, row, fields=tuple(range(HEAD_FIELDS))) -> tuple:
    """In a kernel: head table row ``row``'s ``fields``, in columns (traced int32 scalars)."""
    return tuple(ref[row, f] * UNIT for f in fields)


def read_widths(ref) -> tuple:
    """In a kernel: the packed q, K, V and output row widths from a ``row_widths`` table, in columns."""
    return tuple(ref[f] * UNIT for f in (Q_COLS, K_COLS, V_COLS, O_COLS))
