"""Runs of adjacent KV heads (kvjax.runs): a partition of the heads, within the tile and row limits, cheapest; the
head order whose runs cost least; and widths moved between heads so runs fill their tiles."""
import itertools

import numpy as np
import pytest

from kvjax.layout import HeadLayout
from kvjax.runs import (FLOOR_TILE, ROWS, TOKEN_COST, fill_runs, head_runs, loaded_cost, order_heads, permuted,
                        runs_cost, tile)


def random_layout(rng, group, min_heads, max_heads):
    """A layer of ``min_heads`` to ``max_heads - 1`` KV heads of random widths (multiples of 16 up to 128)."""
    heads = int(rng.integers(min_heads, max_heads))
    widths = lambda: tuple(int(w) for w in rng.choice(np.arange(16, 129, 16), heads))  # noqa: E731
    return HeadLayout(group * heads, heads, 128, widths(), widths())


def cost(run_widths):
    k, v = (sum(w) for w in zip(*run_widths))
    return max(tile(k) + tile(v), 2 * FLOOR_TILE) + TOKEN_COST


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_runs_partition_the_heads_cheapest_first(group):
    rng = np.random.default_rng()
    lay = random_layout(rng, group, 1, 7)
    heads = lay.num_kv_heads
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


@pytest.mark.parametrize("group", [1, 2, 4])
def test_head_order_makes_the_cheapest_runs(group):
    rng = np.random.default_rng()
    lay = random_layout(rng, group, 2, 7)
    heads = lay.num_kv_heads
    max_tile = int(rng.choice([128, 256]))
    order = order_heads(lay, max_tile)
    assert sorted(order) == list(range(heads))
    ordered = permuted(lay, order)
    assert ordered.k_widths == tuple(lay.k_widths[h] for h in order)
    # no order of the heads gives cheaper runs (brute force over the permutations)
    best = min(runs_cost(permuted(lay, p), max_tile) for p in itertools.permutations(range(heads)))
    assert runs_cost(ordered, max_tile) == best
    if runs_cost(lay, max_tile) == best:
        assert order == tuple(range(heads))


def test_head_order_pairs_complementary_widths():
    lay = HeadLayout(16, 4, 128, (48, 64, 80, 64), (96, 64, 32, 64))
    order = order_heads(lay, 128)
    runs = head_runs(permuted(lay, order), 128)
    assert sorted(sorted(r.k_widths) for r in runs) == [[48, 80], [64, 64]]


def test_narrow_runs_cost_as_much_as_full_ones():
    """The floor: fewer runs beat narrower ones (three 128+128 runs, not four with two narrow ones)."""
    lay = HeadLayout(32, 8, 128, (32, 32, 64, 32, 32, 32, 48, 48), (16, 80, 48, 32, 32, 16, 32, 32))
    assert len(head_runs(lay, 128)) == 3
    assert runs_cost(permuted(lay, order_heads(lay, 128)), 128) == runs_cost(lay, 128)


def best_cost(k, v, group, max_tile):
    lay = HeadLayout(group * len(k), len(k), 128, tuple(k), tuple(v))
    return runs_cost(permuted(lay, order_heads(lay, max_tile)), max_tile)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_filled_widths_keep_the_totals_and_the_bounds(group):
    rng = np.random.default_rng()
    lay = random_layout(rng, group, 2, 9)
    max_tile, max_shift = int(rng.choice([128, 256])), int(rng.choice([16, 32, 48]))
    k, v = fill_runs(lay, max_tile, max_shift)
    for new, old in ((k, lay.k_widths), (v, lay.v_widths)):
        assert sum(new) == sum(old)
        assert all(w % 16 == 0 and 16 <= w <= 128 for w in new)
        assert max(abs(a - b) for a, b in zip(new, old)) <= max_shift
    cost = best_cost(k, v, group, max_tile)
    assert cost <= best_cost(lay.k_widths, lay.v_widths, group, max_tile)
    if (k, v) != (lay.k_widths, lay.v_widths):
        assert cost < best_cost(lay.k_widths, lay.v_widths, group, max_tile)  # no move without a gain


def test_fill_makes_full_runs_of_a_rate_half_layer():
    """The bench's rate-0.5 layer: runs of K 128 + V 208, 256 + 176 and 128 + 128 columns become two full runs."""
    lay = HeadLayout(32, 8, 128, (48, 32, 48, 80, 64, 112, 48, 80), (96, 48, 64, 80, 64, 32, 96, 32))
    k, v = fill_runs(lay, 256, 32)
    filled = HeadLayout(32, 8, 128, k, v)
    runs = head_runs(permuted(filled, order_heads(filled, 256)), 256)
    assert [(r.k_cols, r.v_cols) for r in runs] == [(256, 256), (256, 256)]
    assert sum(abs(a - b) for a, b in zip(k + v, lay.k_widths + lay.v_widths)) <= 128
    for full in (HeadLayout.uniform(32, 8, 128), HeadLayout(32, 8, 128, (64,) * 8, (64,) * 8)):
        assert fill_runs(full, 256, 32) == (full.k_widths, full.v_widths)


def test_fill_keeps_widths_whose_runs_would_load_more():
    """The bench's rate-0.7 layer: cheaper by tiles after moves, but the kernel already reads its 192- and
    160-column runs as pieces (128 + 64, 128 + 32), and the moves would make it load more columns."""
    lay = HeadLayout(32, 8, 128, (32, 64, 48, 48, 32, 32, 32, 32), (16, 48, 32, 32, 80, 32, 32, 16))
    assert fill_runs(lay, 256, 32) == (lay.k_widths, lay.v_widths)
    assert loaded_cost(lay) == 608 + 2 * TOKEN_COST


def test_fill_moves_the_columns_that_cost_least():
    """Where several heads could give up the columns, the loss table picks the cheapest donor."""
    lay = HeadLayout(32, 8, 128, (48, 32, 48, 80, 64, 112, 48, 80), (96, 48, 64, 80, 64, 32, 96, 32))
    m = 2
    loss = np.abs(np.arange(-m, m + 1))[None, :].repeat(8, 0).astype(float)  # the default: columns moved
    k, v = fill_runs(lay, 256, 32, k_loss=loss)
    assert (k, v) == fill_runs(lay, 256, 32)
    donors = [h for h in range(8) if k[h] < lay.k_widths[h]]
    assert donors
    loss[donors, :m] = 50.0  # now shrinking those heads is dear
    k2, v2 = fill_runs(lay, 256, 32, k_loss=loss)
    assert best_cost(k2, v2, 4, 256) == best_cost(k, v, 4, 256)
    assert all(k2[h] >= lay.k_widths[h] for h in donors)
