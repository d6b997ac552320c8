"""The decode op's one cost model: what one token of a work unit costs, in columns of width.

A unit (a run of adjacent KV heads, ``units``) costs per token its K + V columns (the bytes it reads), plus
``tile_weight`` times the columns of the tiles it computes on, at least those of a ``floor_tile`` + ``floor_tile``
unit (a narrow unit takes about as long as a full one: bench/results/kernels.md "Decode: runs of heads and head
order"), plus ``token_cost`` for the per-token work that does not shrink with width.

The schedule weighs units with ``unit_cost``. The offline searches over runs (``units.head_runs``,
``search.order_heads``, ``search.fill_runs``) compare ways to cut one layer whose K and V totals are fixed, so the
bytes are the same for every candidate and they price with ``token_cost`` alone.
"""

from __future__ import annotations

import math

from kvjax.ops.decode.config import DecodeConfig
from kvjax.ops.tiles import loaded_columns

ROWS = 16  # rows of the kernel's score tile (the tensor cores' smallest M): a run's heads x group size fit in it


def allowed(num_heads: int, k_tile: int, v_tile: int, group_size: int, config: DecodeConfig) -> bool:
    """Whether one item may read these heads together: one head always; several only within the score tile's rows
    and tiles at most ``config.pack_tile`` wide."""
    return num_heads == 1 or (
        config.pack_tile > 0 and num_heads * group_size <= ROWS and max(k_tile, v_tile) <= config.pack_tile
    )


def token_cost(
    num_heads: int, k_tile: int, v_tile: int, group_size: int, config: DecodeConfig, columns: int = 0
) -> float:
    """One token of a unit of ``num_heads`` heads computing on ``k_tile`` + ``v_tile`` tile columns and reading
    ``columns`` K + V columns; inf where the unit is not ``allowed``."""
    if not allowed(num_heads, k_tile, v_tile, group_size, config):
        return math.inf
    return columns + config.tile_weight * max(k_tile + v_tile, 2 * config.floor_tile) + config.token_cost


def loaded(width: int, config: DecodeConfig) -> int:
    """Tile columns the kernel computes on for ``width`` columns of a run (up to ``max_segments`` pieces)."""
    return loaded_columns(width, config.max_segments, config.piece_saving)


def unit_cost(num_heads: int, k_cols: int, v_cols: int, group_size: int, config: DecodeConfig) -> int:
    """One token of a unit as the kernel reads it: its bytes plus the tiles of its pieces (``loaded``)."""
    return int(
        token_cost(num_heads, loaded(k_cols, config), loaded(v_cols, config), group_size, config, k_cols + v_cols)
    )
