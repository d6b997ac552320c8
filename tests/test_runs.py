"""Runs of adjacent KV heads (kvjax.ops.decode.units, .search): the cheapest cut into allowed runs, the cheapest head
order, and widths moved so runs fill their tiles, all checked against the library's own cost model by brute force."""

import dataclasses
import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.cost import ROWS, allowed
from kvjax.ops.decode.search import fill_runs, loaded_cost, order_heads, permuted, runs_cost
from kvjax.ops.decode.units import head_runs, run_cost
from kvjax.ops.tiles import loaded_columns, segments, tile

WIDTH = st.sampled_from(range(16, 129, 16))
# Runs read as up to two power-of-two pieces: the piece logic these layouts were written for.
PACK_128, PACK_256 = (dataclasses.replace(DECODE, pack_tile=t, max_segments=2) for t in (128, 256))
# Cost models of every shape: the searches must be cheapest under any of them, not just under the tuned defaults.
CONFIGS = st.builds(
    lambda pack, cost, floor, weight: dataclasses.replace(
        DECODE, pack_tile=pack, token_cost=cost, floor_tile=floor, tile_weight=weight
    ),
    st.sampled_from([0, 64, 128, 256]),
    st.integers(0, 64),
    st.sampled_from([0, 64, 128]),
    st.integers(0, 2),
)


@st.composite
def layouts(draw, min_heads=1, max_heads=6, groups=(1, 2, 4, 8)):
    """A layer of ``min_heads`` to ``max_heads`` KV heads of widths 16 to 128 (multiples of 16), group in groups."""
    n, group = draw(st.integers(min_heads, max_heads)), draw(st.sampled_from(groups))
    k, v = (tuple(draw(st.lists(WIDTH, min_size=n, max_size=n))) for _ in range(2))
    return HeadLayout(group * n, n, 128, k, v)


def cuts(n):
    """Every cut of n adjacent heads into runs, as (first, end) bounds."""
    for mask in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(mask) if c] + [n]
        yield list(itertools.pairwise(bounds))


def cut_cost(lay, cut, config):
    return sum(run_cost(lay.k_widths[a:b], lay.v_widths[a:b], lay.group_size, config) for a, b in cut)


def best_cost(lay, config):
    """A token's cost over the layer's runs at its best head order (by tiles)."""
    return runs_cost(permuted(lay, order_heads(lay, config)), config)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 600), st.integers(1, 3), st.sampled_from([0, 16, 64]))
def test_segments_read_each_column_once(width, max_segments, min_saving):
    """A head is read as power-of-two pieces that hold each of its columns exactly once, never more than one tile."""
    pieces = segments(width, max_segments, min_saving)
    assert 1 <= len(pieces) <= max_segments
    assert [start for start, _, _ in pieces] == list(itertools.accumulate([t for _, t, _ in pieces[:-1]], initial=0))
    assert sum(cols for _, _, cols in pieces) == width == pieces[-1][0] + pieces[-1][2]  # no gap, no overlap
    assert [t for _, t, _ in pieces] == sorted((t for _, t, _ in pieces), reverse=True)
    for _, t, cols in pieces:
        assert t >= 16 and t & (t - 1) == 0 and 0 < cols <= t
    assert width <= loaded_columns(width, max_segments, min_saving) <= tile(width)
    assert loaded_columns(width, 1, min_saving) == tile(width)


@settings(max_examples=150, deadline=None)
@given(layouts(), CONFIGS)
def test_runs_partition_the_heads_cheapest_first(lay, config):
    """Runs are adjacent heads, each head's columns in exactly one run, every run allowed by the row and tile
    limits, and no other cut of the heads into runs is cheaper (brute force over the cut points)."""
    runs = head_runs(lay, config)
    assert [h for r in runs for h in range(r.first, r.first + r.num_heads)] == list(range(lay.num_kv_heads))
    assert sum((r.k_widths for r in runs), ()) == lay.k_widths and sum((r.v_widths for r in runs), ()) == lay.v_widths
    for r in runs:
        assert r.k_widths == lay.k_widths[r.first : r.first + r.num_heads]
        assert r.num_heads == 1 or (
            r.num_heads * lay.group_size <= ROWS and max(tile(r.k_cols), tile(r.v_cols)) <= config.pack_tile
        )
        assert allowed(r.num_heads, tile(r.k_cols), tile(r.v_cols), lay.group_size, config)
    cost = sum(run_cost(r.k_widths, r.v_widths, lay.group_size, config) for r in runs)
    assert cost == runs_cost(lay, config) == min(cut_cost(lay, cut, config) for cut in cuts(lay.num_kv_heads))


@settings(max_examples=100, deadline=None)
@given(layouts(min_heads=2), CONFIGS)
@example(HeadLayout(8, 4, 64, (16, 16, 32, 16), (16, 32, 16, 16)), dataclasses.replace(DECODE, pack_tile=64))
def test_packing_only_merges_heads_where_it_pays(lay, config):
    """pack_tile 0 keeps one head per run; packing never costs more than that, and where two adjacent heads cost
    less together than apart, some run holds several heads."""
    alone = dataclasses.replace(config, pack_tile=0)
    assert [r.num_heads for r in head_runs(lay, alone)] == [1] * lay.num_kv_heads
    assert runs_cost(lay, config) <= runs_cost(lay, alone)
    k, v, g = lay.k_widths, lay.v_widths, lay.group_size
    if any(
        run_cost(k[h : h + 2], v[h : h + 2], g, config)
        < run_cost(k[h : h + 1], v[h : h + 1], g, config) + run_cost(k[h + 1 : h + 2], v[h + 1 : h + 2], g, config)
        for h in range(lay.num_kv_heads - 1)
    ):
        assert max(r.num_heads for r in head_runs(lay, config)) > 1


@settings(max_examples=60, deadline=None)
@given(layouts(min_heads=2, max_heads=6, groups=(1, 2, 4)), CONFIGS)
def test_head_order_makes_the_cheapest_runs(lay, config):
    """order_heads is a permutation whose runs no other order beats (brute force), the identity where that is
    already as cheap."""
    heads = lay.num_kv_heads
    order = order_heads(lay, config)
    assert sorted(order) == list(range(heads))
    ordered = permuted(lay, order)
    assert ordered.k_widths == tuple(lay.k_widths[h] for h in order)
    assert ordered.v_widths == tuple(lay.v_widths[h] for h in order)
    best = min(runs_cost(permuted(lay, p), config) for p in itertools.permutations(range(heads)))
    assert runs_cost(ordered, config) == best
    if runs_cost(lay, config) == best:
        assert order == tuple(range(heads))


@st.composite
def complementary_layouts(draw):
    """Pairs of heads whose K widths and V widths each add up to 128, shuffled."""
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from(range(16, 113, 16)), st.sampled_from(range(16, 113, 16))), min_size=1, max_size=4
        )
    )
    heads = draw(st.permutations([h for k, v in pairs for h in ((k, v), (128 - k, 128 - v))]))
    n, group = len(heads), draw(st.sampled_from([1, 2, 4, 8]))
    return HeadLayout(group * n, n, 128, tuple(k for k, _ in heads), tuple(v for _, v in heads))


@settings(max_examples=60, deadline=None)
@given(complementary_layouts())
@example(HeadLayout(16, 4, 128, (48, 64, 80, 64), (96, 64, 32, 64)))
def test_head_order_pairs_complementary_widths(lay):
    """Heads that fill 128 + 128-column tiles in pairs are ordered into full runs (48 next to 80, 96 next to 32):
    as many runs as full tiles need, each holding exactly 128 K and 128 V columns."""
    runs = head_runs(permuted(lay, order_heads(lay, PACK_128)), PACK_128)
    assert [(r.k_cols, r.v_cols) for r in runs] == [(128, 128)] * (lay.num_kv_heads // 2)


@settings(max_examples=60, deadline=None)
@given(layouts(min_heads=2, max_heads=8, groups=(1, 2, 4)), st.sampled_from([128, 256]))
@example(HeadLayout(32, 8, 128, (32, 32, 64, 32, 32, 32, 48, 48), (16, 80, 48, 32, 32, 16, 32, 32)), 128)
def test_narrow_runs_cost_as_much_as_full_ones(lay, pack_tile):
    """With the floor at the widest tile, a narrow run costs as much as a full one, so the fewest runs win: the
    runs are the fewest allowed ones (brute force), each priced as one full-width head."""
    config = dataclasses.replace(DECODE, pack_tile=pack_tile, floor_tile=pack_tile)
    runs = head_runs(lay, config)
    g = lay.group_size
    fewest = min(
        len(cut)
        for cut in cuts(lay.num_kv_heads)
        if all(allowed(b - a, tile(sum(lay.k_widths[a:b])), tile(sum(lay.v_widths[a:b])), g, config) for a, b in cut)
    )
    assert len(runs) == fewest
    full = run_cost((128,), (128,), g, config)
    assert all(run_cost(r.k_widths, r.v_widths, g, config) == full for r in runs)


@settings(max_examples=80, deadline=None)
@given(layouts(min_heads=2, max_heads=8, groups=(1, 2, 4)), st.sampled_from([PACK_128, PACK_256]))
def test_loaded_cost_counts_pieces_within_tiles(lay, config):
    """Reading runs as pieces never loads more than whole tiles: the loaded cost is at most the runs' cost by
    tiles at the best order, and equal to it for a kernel that reads every run as one tile."""
    assert loaded_cost(lay, config) <= best_cost(lay, config)
    one_tile = dataclasses.replace(config, max_segments=1)
    assert loaded_cost(lay, one_tile) == best_cost(lay, one_tile)


@settings(max_examples=60, deadline=None)
@given(
    layouts(min_heads=2, max_heads=8, groups=(1, 2, 4)),
    st.sampled_from([PACK_128, PACK_256]),
    st.sampled_from([16, 32, 48]),
)
def test_filled_widths_keep_the_totals_and_the_bounds(lay, config, max_shift):
    """The fill keeps the layer's K and V totals and each width's bounds and steps, and never raises the runs' cost
    by tiles or the loaded cost; it moves nothing without lowering both."""
    k, v = fill_runs(lay, config, max_shift)
    for new, old in ((k, lay.k_widths), (v, lay.v_widths)):
        assert sum(new) == sum(old)
        assert all(w % 16 == 0 and 16 <= w <= 128 for w in new)
        assert max(abs(a - b) for a, b in zip(new, old)) <= max_shift
    filled = HeadLayout(lay.num_heads, lay.num_kv_heads, 128, k, v)
    assert best_cost(filled, config) <= best_cost(lay, config)
    assert loaded_cost(filled, config) <= loaded_cost(lay, config)
    if (k, v) != (lay.k_widths, lay.v_widths):
        assert best_cost(filled, config) < best_cost(lay, config)
        assert loaded_cost(filled, config) < loaded_cost(lay, config)


def test_fill_makes_full_runs_of_a_rate_half_layer():
    """The bench's rate-0.5 layer: runs of K 128 + V 208, 256 + 176 and 128 + 128 columns become two full runs;
    layers whose runs are already full stay as they are."""
    lay = HeadLayout(32, 8, 128, (48, 32, 48, 80, 64, 112, 48, 80), (96, 48, 64, 80, 64, 32, 96, 32))
    k, v = fill_runs(lay, PACK_256, 32)
    filled = HeadLayout(32, 8, 128, k, v)
    runs = head_runs(permuted(filled, order_heads(filled, PACK_256)), PACK_256)
    assert [(r.k_cols, r.v_cols) for r in runs] == [(256, 256), (256, 256)]
    assert sum(abs(a - b) for a, b in zip(k + v, lay.k_widths + lay.v_widths)) <= 128
    for full in (HeadLayout.uniform(32, 8, 128), HeadLayout(32, 8, 128, (64,) * 8, (64,) * 8)):
        assert fill_runs(full, PACK_256, 32) == (full.k_widths, full.v_widths)


def test_fill_keeps_widths_whose_runs_would_load_more():
    """The bench's rate-0.7 layer: for a kernel that reads each run as one tile, moves make it cheaper; but the
    kernel reads its 192- and 160-column runs as pieces (128 + 64, 128 + 32), so the same moves would make it load
    more, and the fill keeps the widths."""
    lay = HeadLayout(32, 8, 128, (32, 64, 48, 48, 32, 32, 32, 32), (16, 48, 32, 32, 80, 32, 32, 16))
    one_tile = dataclasses.replace(PACK_256, max_segments=1)
    k, v = fill_runs(lay, one_tile, 32)
    by_tiles = HeadLayout(32, 8, 128, k, v)
    assert (k, v) != (lay.k_widths, lay.v_widths) and best_cost(by_tiles, PACK_256) < best_cost(lay, PACK_256)
    assert loaded_cost(by_tiles, PACK_256) > loaded_cost(lay, PACK_256)
    assert fill_runs(lay, PACK_256, 32) == (lay.k_widths, lay.v_widths)


def test_fill_moves_the_columns_that_cost_least():
    """Where several heads could give up the columns, the loss table picks the cheapest donor."""
    lay = HeadLayout(32, 8, 128, (48, 32, 48, 80, 64, 112, 48, 80), (96, 48, 64, 80, 64, 32, 96, 32))
    m = 2
    loss = np.abs(np.arange(-m, m + 1))[None, :].repeat(8, 0).astype(float)  # the default: columns moved
    k, v = fill_runs(lay, PACK_256, 32, k_loss=loss)
    assert (k, v) == fill_runs(lay, PACK_256, 32)
    donors = [h for h in range(8) if k[h] < lay.k_widths[h]]
    assert donors
    loss[donors, :m] = 50.0  # now shrinking those heads is dear
    k2, v2 = fill_runs(lay, PACK_256, 32, k_loss=loss)
    assert best_cost(HeadLayout(32, 8, 128, k2, v2), PACK_256) == best_cost(HeadLayout(32, 8, 128, k, v), PACK_256)
    assert all(k2[h] >= lay.k_widths[h] for h in donors)
