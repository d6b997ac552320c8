"""Runs of adjacent KV heads (kvjax.runs): a partition of the heads, within the tile and row limits, cheapest."""
import itertools

import numpy as np
import pytest

from kvjax.layout import HeadLayout
from kvjax.runs import ROWS, TOKEN_COST, head_runs, tile


def cost(run_widths):
    k, v = (sum(w) for w in zip(*run_widths))
    return tile(k) + tile(v) + TOKEN_COST


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_runs_partition_the_heads_cheapest_first(group):
    rng = np.random.default_rng()
    heads = int(rng.integers(1, 7))
    widths = lambda: tuple(int(w) for w in rng.choice(np.arange(16, 129, 16), heads))  # noqa: E731
    lay = HeadLayout(group * heads, heads, 128, widths(), widths())
    max_tile = int(rng.choice([64, 128, 256]))
    runs = head_runs(lay, max_tile)
    assert [h for r in runs for h in range(r.first, r.first + r.num_heads)] == list(range(heads))
    for r in runs:
        assert r.k_widths == lay.k_widths[r.first:r.first + r.num_heads]
        assert r.num_heads * group <= ROWS
        assert r.num_heads == 1 or max(tile(r.k_cols), tile(r.v_cols)) <= max_tile

    # no other cut of the heads into allowed runs costs less (brute force over the cut points)
    pairs = list(zip(lay.k_widths, lay.v_widths))
    best = None
    for cuts in itertools.product([False, True], repeat=heads - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [heads]
        parts = [pairs[a:b] for a, b in zip(bounds, bounds[1:])]
        if all(len(p) == 1 or (len(p) * group <= ROWS and max(tile(sum(k for k, _ in p)),
                                                                tile(sum(v for _, v in p))) <= max_tile)
               for p in parts):
            total = sum(cost(p) for p in parts)
            best = total if best is None else min(best, total)
    assert sum(cost(list(zip(r.k_widths, r.v_widths))) for r in runs) == best


def test_no_packing_keeps_one_head_per_run():
    lay = HeadLayout(8, 4, 64, (16, 16, 32, 16), (16, 32, 16, 16))
    assert [r.num_heads for r in head_runs(lay, 0)] == [1, 1, 1, 1]
    assert [r.num_heads for r in head_runs(lay, 64)] != [1, 1, 1, 1]
