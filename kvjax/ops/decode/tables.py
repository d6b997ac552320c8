"""What the decode kernels compile for, and the tables they read at run time: run classes shared by a model's layers,
and each layer's unit and row tables.

A class is the tiles of a run's K and V pieces (``pieces``), and its head count only where the run folds token
chunks into spare rows of the score tile (``folds``), whose code depends on it. Everything else about a run (its
head count otherwise, its widths, where each head's rows and columns sit, the layer's row widths) travels in int32
tables that the kernel and the merge read at run time, offsets in units of 16 so the compiler still sees 16-aligned
vectors. So the code of the decode and merge kernels depends on the classes of the layers that share them
(``kernel_groups``), never on the layer, and XLA compiles each once for its group instead of once per layer
(bench/results/startup.md "Engine: compile times", "Engine: first call of a step").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.columns import column_offsets
from kvjax.ops.decode.config import DecodeConfig
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.units import Run, head_runs
from kvjax.ops.tiles import pow2_floor, segments

# Columns of a unit's row in the unit table: its class, its head count, its first head's column in packed q, K, V
# and output rows, and the width of its last K and last V piece (the last five in units of 16).
CLASS, HEADS, Q_OFF, K_OFF, V_OFF, O_OFF, K_LAST, V_LAST = range(8)
UNIT_FIELDS = 8
# Fields of the row table, each a vector over the score tile's rows (row ``i * G + g``: query g of the run's head
# i): the head's first column and width among the run's K and V columns, and where the row's query starts in a
# q row and its output in a packed output row, relative to the unit's offsets, less the head's first column.
K_START, K_WIDTH, V_START, V_WIDTH, Q_ROW, O_ROW = range(6)
ROW_FIELDS = 6


def step_tokens(k_tile: int, v_tile: int, config: DecodeConfig) -> int:
    """Tokens per loop step for a run's tiles: ``block_tokens`` at 128+128 wide, more for narrower runs (so bytes
    in flight stay about constant), at most ``max_step_tokens``."""
    return min(config.max_step_tokens, pow2_floor(config.block_tokens * 256 / (k_tile + v_tile)))


def folds(rows: int, k_tile: int, step: int, fold_tokens: int) -> int:
    """How many token chunks of a step share the 16-row score tile (a power of two), for a run with ``rows`` real
    query rows (its heads x group size).

    With F folds, rows ``c*rows .. c*rows+rows-1`` score chunk ``c`` of the step, so softmax work per byte falls
    F-fold. Bounded by the rows (F*rows <= 16), by chunks of at least ``fold_tokens`` tokens, and by F*k_tile <=
    256 (the F masked copies of q live in registers for the whole item)."""
    return max(1, min(pow2_floor(ROWS // rows), step // fold_tokens, 256 // k_tile))


def pieces(cols: int, config: DecodeConfig) -> tuple[tuple[int, int, int], ...]:
    """How the kernel reads a run's ``cols`` K (or V) columns: (start, tile, columns) power-of-two pieces."""
    return segments(cols, config.max_segments, config.piece_saving)


@dataclasses.dataclass(frozen=True)
class RunClass:
    """Runs that share code: their K and V columns are read as pieces of these tiles. ``num_heads``: the runs'
    head count where the code folds token chunks (``folds`` > 1); 0 where it does not, and runs of any head count
    share the code, reading theirs from the unit table. ``*_exact``: every run of the class fills its last piece,
    so those loads need no column mask."""

    num_heads: int
    k_tiles: tuple[int, ...]
    v_tiles: tuple[int, ...]
    k_exact: bool = True
    v_exact: bool = True

    @property
    def key(self) -> tuple:
        return self.num_heads, self.k_tiles, self.v_tiles

    @property
    def k_cols(self) -> int:
        """Tile columns of K (the columns every step computes on)."""
        return sum(self.k_tiles)

    @property
    def v_cols(self) -> int:
        return sum(self.v_tiles)


def _key(run: Run, group: int, config: DecodeConfig) -> tuple:
    k_tiles, v_tiles = (tuple(t for _, t, _ in pieces(c, config)) for c in (run.k_cols, run.v_cols))
    kt, vt = sum(k_tiles), sum(v_tiles)
    folded = folds(run.num_heads * group, kt, step_tokens(kt, vt, config), config.fold_tokens) > 1
    return (run.num_heads if folded else 0, k_tiles, v_tiles)


def _fills(cols: int, config: DecodeConfig) -> bool:
    _, t, c = pieces(cols, config)[-1]
    return t == c


def run_classes(layouts, config: DecodeConfig) -> tuple[RunClass, ...]:
    """The classes of every run of ``layouts`` (the layers that share the kernels), in first-seen order."""
    exact: dict[tuple, list[bool]] = {}
    for layout in layouts:
        for run in head_runs(layout, config):
            fills = exact.setdefault(_key(run, layout.group_size, config), [True, True])
            fills[0] &= _fills(run.k_cols, config)
            fills[1] &= _fills(run.v_cols, config)
    return tuple(RunClass(*key, *fills) for key, fills in exact.items())


@dataclasses.dataclass(frozen=True)
class LayerTables:
    """One layer's run-time tables (int32, widths and offsets in units of 16)."""

    units: np.ndarray  # [units * UNIT_FIELDS]
    rows: np.ndarray  # [units * ROW_FIELDS * ROWS]
    cols: np.ndarray  # [4]: ``columns.row_widths``


def layer_tables(
    layout: HeadLayout,
    classes: tuple[RunClass, ...],
    config: DecodeConfig,
    units: int,
    wide_rows: int = 0,
) -> LayerTables:
    """The tables of ``layout``'s runs (``units.head_runs``) for kernels compiled for ``classes``, padded to
    ``units`` runs (the most any shared layer has); rows past a run's heads are zero (width 0: no head).

    ``wide_rows`` > 0: q comes wide (``models.rotation.QKRotation.wide``: ``wide_rows`` rows of ``k_cols`` columns
    a sequence, query head h in row h), so a row's query is its head's row at the K columns the row reads: the
    kernel's one addressing (unit offset + row offset + K column) covers both forms."""
    offs = column_offsets(layout)
    # a query head's columns when q comes wide, one row a head (0: packed, the run's own K columns)
    head_width = layout.k_cols if wide_rows else 0
    keys = [c.key for c in classes]
    g = layout.group_size
    unit = np.zeros((units, UNIT_FIELDS), np.int32)
    row = np.zeros((units, ROW_FIELDS, ROWS), np.int32)
    for u, run in enumerate(head_runs(layout, config)):
        k_last, v_last = (pieces(c, config)[-1][2] for c in (run.k_cols, run.v_cols))
        at = [offs[n][run.first] for n in "qkvo"]
        if head_width:  # the run's first query head (wide: at the run's K columns of it)
            at[0] = run.first * g * head_width + (at[1] if wide_rows else 0)
        unit[u] = (keys.index(_key(run, g, config)), run.num_heads, *at, k_last, v_last)
        for i, (ks, kw, vs, vw) in enumerate(zip(run.k_starts, run.k_widths, run.v_starts, run.v_widths)):
            for j in range(g):
                q_row = (i * g + j) * head_width if head_width else (g - 1) * ks + j * kw
                row[u, :, i * g + j] = ks, kw, vs, vw, q_row, (g - 1) * vs + j * vw
    unit[:, Q_OFF:] //= columns.UNIT
    q_cols = (wide_rows or layout.num_heads) * head_width if head_width else layout.q_cols
    cols = columns.row_widths(layout, q_cols)
    return LayerTables(unit.ravel(), (row // columns.UNIT).ravel(), cols)


def kernel_groups(layouts, config: DecodeConfig) -> dict[HeadLayout, tuple[HeadLayout, ...]]:
    """Each layout's kernel group: the layouts whose runs share its compiled kernels. Layers whose runs fall in the
    same classes always share; groups then merge, largest first, while their classes together stay within
    ``config.kernel_classes`` (compile time grows faster than a kernel's classes: bench/results/startup.md "Engine:
    compile times")."""
    layouts = tuple(dict.fromkeys(layouts))
    sets = {lay: frozenset(_key(run, lay.group_size, config) for run in head_runs(lay, config)) for lay in layouts}
    groups: list[set] = []  # each group's classes
    for classes in sorted(set(sets.values()), key=lambda c: (-len(c), sorted(c))):
        fits = [g for g in groups if len(g | classes) <= config.kernel_classes]
        if fits:
            min(fits, key=lambda g: len(g | classes) - len(g)).update(classes)
        else:
            groups.append(set(classes))
    member = {lay: next(i for i, g in enumerate(groups) if sets[lay] <= g) for lay in layouts}
    return {lay: tuple(other for other in layouts if member[other] == member[lay]) for lay in layouts}


def most_units(layouts, config: DecodeConfig) -> int:
    """The most runs any of ``layouts`` is cut into."""
    return max(len(head_runs(layout, config)) for layout in layouts)
