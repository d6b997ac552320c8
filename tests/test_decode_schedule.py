"""The host decode schedule (kvjax.ops.decode.schedule, .schedule_cache): every visible page scheduled once and
inside its sequence, splits merged, loads as the cost model prices them, LPT and stream balanced, shapes bucketed,
schedules reused."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.cost import unit_cost
from kvjax.ops.decode.schedule import (
    END_PAGE,
    FIRST_PAGE,
    SEQ,
    SLOT,
    UNIT,
    ScheduleShape,
    build_decode_schedule,
    compiled_shape,
    fixed_chunk_schedule,
    load_balance,
    realized_loads,
    static_decode_schedule,
)
from kvjax.ops.decode.schedule_cache import ScheduleCache
from kvjax.ops.decode.units import head_runs


def config(**fields):
    return dataclasses.replace(DECODE, **fields)


def unit_costs(layout, cfg):
    """One token of each work unit of the layer, as the op's cost model prices it."""
    return [unit_cost(r.num_heads, r.k_cols, r.v_cols, layout.group_size, cfg) for r in head_runs(layout, cfg)]


def random_layouts(rng, num_layers, heads=8, window=None):
    def widths():
        return tuple(int(w) for w in rng.choice(np.arange(16, 129, 16), heads))

    return [HeadLayout(4 * heads, heads, 128, widths(), widths(), window) for _ in range(num_layers)]


def scheduled_items(schedule, layer):
    """(seq, unit, first, end, slot) of every real item of one layer."""
    items, counts = schedule.items[layer], schedule.counts[layer]
    return [tuple(int(x) for x in items[p, i]) for p in range(items.shape[0]) for i in range(counts[p])]


def random_classes(rng, layouts, cfg):
    """Per layer, each unit's class: one to three classes a layer, not every one present."""
    return [tuple(int(c) for c in rng.integers(0, rng.integers(1, 4), len(head_runs(lay, cfg)))) for lay in layouts]


@pytest.mark.parametrize("order", ["lpt", "naive", "stream", "auto"])
@pytest.mark.parametrize("window, pack_tile", [(None, 0), (200, 0), (None, 128), (200, 256)])
@pytest.mark.parametrize("by_class", [False, True])
def test_every_visible_page_once(order, window, pack_tile, by_class):
    """Every page of every (sequence, unit) group scheduled once, each item inside its sequence's visible pages and
    headroom; units are runs of heads when packed. Scheduled a class at a time, too, and the merge rows hold every
    split group's slots."""
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 3, window=window)
    lengths = rng.integers(0, 3000, 11)
    lengths[0], lengths[1] = 1, 0
    ps = 16
    headroom = rng.integers(0, 3, len(lengths)) if rng.random() < 0.5 else int(rng.integers(0, 3))  # per sequence
    cfg = config(order=order, min_chunk_tokens=32, pack_tile=pack_tile)
    classes = random_classes(rng, layouts, cfg) if by_class else None
    programs = int(rng.integers(4, 40))
    built = build_decode_schedule(lengths, layouts, ps, programs, config=cfg, headroom_pages=headroom, classes=classes)
    s = built.schedule
    assert s.config.pack_tile == pack_tile
    assert built.loads.shape == (sum(len(set(c)) for c in classes) if by_class else len(layouts), programs)
    for layer, lay in enumerate(layouts):
        units = len(head_runs(lay, s.config))
        assert_merge_rows(s, layer, scheduled_items(s, layer))
        assert built.num_items[layer] == s.counts[layer].sum()
        covered = {}
        for seq, unit, first, end, slot in scheduled_items(s, layer):
            assert 0 <= seq < len(lengths) and 0 <= unit < units and first < end
            for page in range(first, end):
                assert (seq, unit, page) not in covered
                covered[seq, unit, page] = slot
        for b, n in enumerate(lengths):
            for u in range(units):
                pages = [p for (sb, su, p) in covered if (sb, su) == (b, u)]
                if n == 0:
                    assert not pages
                    continue
                last = -(-n // ps) + np.broadcast_to(headroom, lengths.shape)[b]
                first = max(n - window, 0) // ps if window else 0
                assert sorted(pages) == list(range(first, last))
    assert built.covers(lengths) and not built.covers(lengths + (headroom + 1) * ps)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 700), min_size=1, max_size=10),
    st.integers(1, 4),
    st.integers(1, 9),
    st.sampled_from([None, 40, 100]),
    st.sampled_from([0, 256]),
)
def test_fixed_chunks_cover_every_visible_page_once(lengths, chunk_pages, programs, window, pack_tile):
    """The batch-invariant schedule: every item is one whole chunk [k * C, (k + 1) * C) that starts inside its
    sequence, goes through the merge in its group's slots in chunk order, and the chunks cover every visible page of
    every group once."""
    ps, splits = 16, 64
    lay = HeadLayout(16, 4, 128, (48, 64, 80, 64), (96, 64, 32, 64), window)
    built = fixed_chunk_schedule(
        lengths, lay, ps, programs, chunk_pages=chunk_pages, splits=splits, config=config(pack_tile=pack_tile)
    )
    s, units = built.schedule, len(head_runs(lay, built.schedule.config))
    covered = {}
    for seq, unit, first, end, slot in scheduled_items(s, 0):
        k = first // chunk_pages
        assert (first, end) == (k * chunk_pages, (k + 1) * chunk_pages) and first * ps < lengths[seq]
        assert 0 <= slot < s.num_slots
        for page in range(first, end):
            assert (seq, unit, page) not in covered
            covered[seq, unit, page] = slot
    for b, n in enumerate(lengths):
        visible = range(max(n - window, 0) // ps if window else 0, -(-n // ps))
        for u in range(units):
            pages = {p for (sb, su, p) in covered if (sb, su) == (b, u)}
            assert pages >= set(visible) and (n > 0 or not pages)
            if pages:  # no chunk lies wholly before the window
                assert min(pages) // chunk_pages == visible[0] // chunk_pages
    assert built.covers(lengths)
    assert_merge_rows(s, 0, scheduled_items(s, 0), every_group=True)


def assert_merge_rows(s, layer, items, every_group=False):
    """Every group of several chunks (or every group) has one merge row whose slot range holds its chunks' slots in
    chunk order, one slot each; no slot serves two groups; direct items have slot -1."""
    chunks = {}
    for seq, unit, _first, _end, slot in sorted(items, key=lambda it: it[2]):
        chunks.setdefault((seq, unit), []).append(slot)
    rows = {
        tuple(int(x) for x in d): tuple(int(x) for x in r) for d, r in zip(s.merge_dest[layer], s.merge_range[layer])
    }
    assert rows.pop((-1, -1), (0, 0)) == (0, 0) and all(r[1] > 0 for r in rows.values())
    used = [slot for begin, n in rows.values() for slot in range(begin, begin + n)]
    assert len(used) == len(set(used)) and all(0 <= slot < s.num_slots for slot in used)
    assert len(rows) == sum(every_group or len(v) > 1 for v in chunks.values())
    for group, slots in chunks.items():
        if group in rows:
            begin, n = rows[group]
            assert slots == list(range(begin, begin + n))
        else:
            assert slots == [-1]


@pytest.mark.parametrize("order", ["lpt", "stream"])
def test_split_groups_have_merge_slots(order):
    rng = np.random.default_rng()
    lay = random_layouts(rng, 1)[0]
    lengths = rng.integers(100, 20000, 3)
    s = build_decode_schedule(lengths, lay, 32, 132, config=config(min_chunk_tokens=64, order=order)).schedule
    assert_merge_rows(s, 0, scheduled_items(s, 0))
    assert s.merge_dest[0, 0, 0] >= 0  # something was split


@pytest.mark.parametrize("order", ["auto", "stream"])
def test_a_class_at_a_time_keeps_every_program_busy_in_each_class(order):
    """A rate-0.5-like layer at B32 x 8K with four classes of one or three heads: scheduled as one, a class's items
    sit on the few programs that drew them (its kernel takes as long as the whole layer); scheduled a class at a
    time, every class spreads over every program within 10% of its mean load (heads of one width: pages weigh
    alike; "auto" takes the stream schedule here, LPT's whole chunks leave a 1-head class 1.6x its mean)."""
    lay = HeadLayout(32, 8, 128, (64,) * 8, (64,) * 8)  # pages cost alike: balanced cost is balanced pages
    cls = (0, 1, 1, 1, 2, 2, 3, 3)
    lengths, P, ps = np.full(32, 8192), 132, 32

    def worst(built):  # per class: (largest program load, mean program load) in pages
        items = scheduled_items(built.schedule, 0)
        out = []
        for c in set(cls):
            load = np.zeros(P)
            for prog in range(P):
                for i in range(built.schedule.counts[0, prog]):
                    seq, unit, first, end, _ = built.schedule.items[0, prog, i]
                    load[prog] += (end - first) * (cls[unit] == c)
            out.append((load.max(), load.mean()))
        assert sum(e - f for _, _, f, e, _ in items) == 8 * 32 * 8192 // ps
        return out

    cfg = config(order=order, pack_tile=0)
    one = worst(build_decode_schedule(lengths, lay, ps, P, config=cfg))
    each = worst(build_decode_schedule(lengths, lay, ps, P, config=cfg, classes=[cls]))
    assert all(top <= 1.1 * mean + 1 for top, mean in each)
    assert sum(top for top, _ in one) > 2 * sum(top for top, _ in each)


def test_classes_must_name_every_unit_of_every_layer():
    lay = HeadLayout(8, 2, 128, (64, 32), (64, 32))
    with pytest.raises(ValueError, match="classes for 2 layers"):
        build_decode_schedule([100], lay, 16, 4, config=config(pack_tile=0), classes=[(0, 1), (0, 1)])
    with pytest.raises(ValueError, match="layer 0 has 2 units"):
        build_decode_schedule([100], lay, 16, 4, config=config(pack_tile=0), classes=[(0,)])


def test_lpt_balances_and_beats_naive():
    """On 5 fresh random batches: the list-scheduling bound always holds, LPT (and stream) always beat naive order,
    and LPT's typical (median) balance is above 0.9 (single draws dip below it about once in 300)."""
    balances = []
    for _ in range(5):
        rng = np.random.default_rng()
        layouts = random_layouts(rng, 4)
        lengths = rng.integers(64, 8192, 48)
        P = 64
        lpt, naive, stream = (
            build_decode_schedule(lengths, layouts, 16, P, config=config(order=o, pack_tile=0))
            for o in ("lpt", "naive", "stream")
        )  # one head per unit: 8 groups a sequence
        for layer, lay in enumerate(layouts):
            per_token = unit_costs(lay, lpt.schedule.config)
            costs = [
                (e - f) * 16 * per_token[u] + DECODE.item_overhead
                for _, u, f, e, _ in scheduled_items(lpt.schedule, layer)
            ]
            assert lpt.loads[layer].sum() == sum(costs)
            assert lpt.loads[layer].max() <= lpt.loads[layer].sum() / P + max(costs)  # the list-scheduling bound
        assert lpt.loads.max(axis=1).sum() < naive.loads.max(axis=1).sum()
        assert stream.loads.max(axis=1).sum() < naive.loads.max(axis=1).sum()
        balances.append(lpt.balance)
    assert np.median(balances) > 0.9


def test_stream_gives_every_program_an_equal_share():
    """Stream order cuts each layer's work into P equal shares: a program's load is the average up to the pages
    that cuts round or snap away, and the items of a program are adjacent stretches of the groups laid end to end."""
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 3)
    lengths = rng.integers(1, 6000, int(rng.integers(1, 40)))
    ps, P = 16, int(rng.integers(8, 200))
    cfg = config(order="stream", min_chunk_tokens=64, pack_tile=int(rng.choice([0, 256])))
    built = build_decode_schedule(lengths, layouts, ps, P, config=cfg)
    snap = max(1, cfg.min_chunk_tokens // ps // 4)
    for layer, lay in enumerate(layouts):
        work = built.loads[layer] - cfg.item_overhead * built.schedule.counts[layer]
        page = ps * max(unit_costs(lay, cfg))
        assert np.abs(work - work.sum() / P).max() <= 2 * (snap + 1) * page
        line = [(seq, unit, first) for seq, unit, first, _, _ in scheduled_items(built.schedule, layer)]
        assert line == sorted(line)  # program after program along the line, in natural group order


def test_auto_keeps_lpt_when_it_balances_else_cuts_equal_shares():
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 2)
    for lengths, P in ((rng.integers(200, 600, 256), 16), (np.full(3, 4096), 64)):  # many small groups; few long
        auto, lpt, stream = (
            build_decode_schedule(lengths, layouts, 16, P, config=config(order=o)) for o in ("auto", "lpt", "stream")
        )
        picked = lpt if lpt.balance >= DECODE.auto_balance else stream
        assert np.array_equal(auto.schedule.items, picked.schedule.items) and auto.balance == picked.balance
        assert auto.balance >= min(DECODE.auto_balance, stream.balance)


def test_shapes_are_bucketed_int32_and_layers_independent():
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 3)
    lengths = rng.integers(1, 5000, 7)
    s = build_decode_schedule(lengths, layouts, 32, 40).schedule
    for a in (s.items, s.counts, s.merge_dest, s.merge_range):
        assert a.dtype == np.int32
    for n in s.shape:
        assert n & (n - 1) == 0
    one = build_decode_schedule(lengths, layouts[1], 32, 40).schedule

    def same_work(sched, layer):
        """The items on each program in order; partial slots are numbered within the merge table, whose bucketed
        width all layers share, so only whether an item is direct or partial."""
        return [item[:4] + (item[4] < 0,) for item in scheduled_items(sched, layer)]

    assert same_work(one, 0) == same_work(s, 1)


def test_lpt_deal_matches_a_plain_loop():
    """The vectorized deal gives every program the same items in the same order as round-by-round LPT in Python:
    items sorted by cost (ties in natural order), each round's items to the programs by load (ties by index)."""
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 2)
    lengths = rng.integers(0, 4000, 21)
    ps, P = 16, int(rng.integers(3, 30))
    cfg = config(min_chunk_tokens=64, order="lpt", pack_tile=int(rng.choice([0, 256])))
    s = build_decode_schedule(lengths, layouts, ps, P, config=cfg).schedule
    for layer, lay in enumerate(layouts):
        per_token = unit_costs(lay, cfg)
        items = sorted(scheduled_items(s, layer))  # natural order: seq, unit, first page
        cost = [(e - f) * ps * per_token[u] + cfg.item_overhead for _, u, f, e, _ in items]
        order = sorted(range(len(items)), key=lambda i: (-cost[i], i))
        loads, rows = np.zeros(P, np.int64), [[] for _ in range(P)]
        for r in range(0, len(order), P):
            for program, i in zip(np.argsort(loads, kind="stable"), order[r : r + P]):
                rows[program].append(items[i])
                loads[program] += cost[i]
        assert rows == [[tuple(int(x) for x in it) for it in s.items[layer, p, : s.counts[layer, p]]] for p in range(P)]


def test_realized_loads_clip_items_to_the_real_lengths():
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 3)
    lengths = rng.integers(0, 3000, 9)
    ps = 16
    cfg = config(min_chunk_tokens=32, pack_tile=int(rng.choice([0, 256])))
    built = build_decode_schedule(lengths, layouts, ps, 16, config=cfg, headroom_pages=rng.integers(0, 20, 9))
    # at the lengths it was scheduled for, the schedule meets exactly its scheduled loads
    assert np.array_equal(realized_loads(built.schedule, built.capacity, layouts, ps), built.loads)
    # at the real lengths, every token is counted once (no window), however far the schedule reaches past it
    real = realized_loads(built.schedule, lengths, layouts, ps)
    per_token = np.array([sum(unit_costs(lay, cfg)) for lay in layouts])
    assert np.array_equal(real.sum(axis=1), lengths.sum() * per_token + cfg.item_overhead * built.num_items)
    assert np.all(real <= built.loads) and 0 < load_balance(real) <= 1


def test_schedule_cache_reuses_until_a_sequence_outgrows_its_pages():
    layouts = random_layouts(np.random.default_rng(), 2)
    cache = ScheduleCache(layouts, 16, 32, config=config(headroom_tokens=16), ahead=False)
    lengths = np.array([5, 16, 17, 40])
    first = cache(lengths)
    for step in range(1, 30):
        schedule = cache(lengths + step)
        assert cache.built.covers(lengths + step)
        if step < 17:  # every sequence keeps at least one spare page for 16 steps
            assert schedule is first
    assert 1 < cache.rebuilds <= 3
    cache(np.array([5, 16, 17]))  # the batch changed
    assert cache.built.capacity.shape == (3,)


def test_schedule_cache_headroom_is_capped_at_the_length():
    layouts = random_layouts(np.random.default_rng(), 1)
    cache = ScheduleCache(layouts, 16, 8, config=config(headroom_tokens=100), ahead=False)
    lengths = np.array([0, 1, 16, 17, 99, 100, 101, 1000])
    room = np.array([0, 1, 1, 2, 7, 7, 7, 7]) * 16  # min(100, length) rounded up to pages
    assert np.array_equal(cache.build(lengths).capacity, -(-lengths // 16) * 16 + room)


def test_schedule_cache_builds_ahead():
    """Growing sequences (with padding rows that stay at length 1 and empty rows): every schedule after the first
    is built ahead for the lengths it meets, and each one taken covers every step it serves."""
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 2)
    batch = 12
    lengths = np.concatenate([rng.integers(1, 300, batch - 3), [1, 1, 0]])
    grows = np.arange(batch) < batch - 3
    cache = ScheduleCache(layouts, 16, 16, config=config(headroom_tokens=int(rng.integers(16, 100))))
    for step in range(300):
        schedule = cache(lengths + step * grows)
        assert cache.built.covers(lengths + step * grows) and schedule is cache.built.schedule
        assert np.array_equal(cache.built.capacity[-3:], [32, 32, 0])  # scheduled as they are: no growth expected
    assert cache.rebuilds >= 3 and cache.built_ahead == cache.rebuilds - 1  # a schedule lasts < 128 steps
    taken = cache.built_ahead
    cache(np.full(batch, 5000))  # outgrew everything: the schedule built ahead (if any) does not cover it
    assert cache.built_ahead == taken and cache.built.covers(np.full(batch, 5000))


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 40),
    st.sampled_from([8, 40, 264]),
    st.sampled_from(["auto", "lpt"]),
    st.integers(1, 2),
    st.booleans(),
)
def test_one_compiled_shape_holds_every_schedule_of_the_batch(seed, max_batch, programs, order, per_program, invariant):
    """Requests arrive, grow and finish at random in ``max_batch`` slots (empty slots at length 1, as the engine
    runs them): every schedule the cache hands out has the shape ``compiled_shape`` gave it, so the jitted step
    never compiles again."""
    rng = np.random.default_rng(seed)
    layouts = random_layouts(rng, 2, heads=int(rng.choice([2, 8])), window=rng.choice([None, 300]))
    cfg = config(order=order, items_per_program=per_program, min_chunk_tokens=int(rng.choice([16, 256])))
    ps, pages_per_seq = 16, int(rng.integers(4, 600))
    splits = 1 << (pages_per_seq - 1).bit_length() if invariant else 0
    classes = None if invariant or rng.random() < 0.5 else random_classes(rng, layouts, cfg)  # a class at a time
    most = max(len(set(c)) for c in classes) if classes else 1
    shape = compiled_shape(layouts, max_batch, programs, config=cfg, splits=splits, classes=most)
    cache = ScheduleCache(
        layouts,
        ps,
        programs,
        config=cfg,
        ahead=False,
        chunk_pages=int(invariant),
        splits=splits,
        shape=shape,
        classes=classes,
    )
    lengths = np.ones(max_batch, np.int64)
    for _ in range(40):
        event = rng.integers(0, 3, max_batch)  # 0: admit a prompt (empty slots), 1: grow, 2: finish
        admit = (event == 0) & (lengths == 1)
        lengths = np.where(admit, rng.integers(1, pages_per_seq * ps, max_batch), lengths)
        lengths = np.where((event == 2) & (rng.random(max_batch) < 0.2), 1, lengths + (lengths > 1))
        lengths = np.minimum(lengths, pages_per_seq * ps)
        schedule = cache(lengths)
        assert schedule.shape == shape and cache.reshaped == 0


def test_a_schedule_wider_than_the_shape_widens_it_for_good():
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 2)
    cache = ScheduleCache(layouts, 16, 8, ahead=False, shape=ScheduleShape(1, 1, 1))
    wide = cache(rng.integers(1000, 4000, 16)).shape
    assert cache.reshaped == 1 and wide == cache.shape and wide != (1, 1, 1)
    cache.built = None
    assert cache(np.full(16, 1)).shape == wide and cache.reshaped == 1


def test_static_schedule_covers_the_whole_table():
    lay = random_layouts(np.random.default_rng(), 1)[0]
    s = static_decode_schedule(3, 10, lay, 16, 8)  # one layer, as layer 0 of a one-layer schedule
    assert s.items.shape[0] == 1 and s.index.tolist() == [0]
    items = [tuple(s.items[0, p, i]) for p in range(8) for i in range(s.counts[0, p])]
    units = len(head_runs(lay, s.config))
    assert sum(it[END_PAGE] - it[FIRST_PAGE] for it in items) == 3 * 10 * units
    assert {(it[SEQ], it[UNIT]) for it in items} == {(b, u) for b in range(3) for u in range(units)}
    assert all(it[SLOT] >= -1 for it in items)


def test_a_layer_index_outside_the_schedule_is_refused():
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 3)
    s = build_decode_schedule(rng.integers(1, 200, 4), layouts, 16, 8).schedule
    assert s.layer(-1).index.tolist() == [2] and s.layer(1).index.tolist() == [1]
    for i in (3, -4):
        with pytest.raises(IndexError, match="of a schedule of 3 layers"):
            s.layer(i)
    assert s.layer(np.int64(2)).index.tolist() == [2]
    with pytest.raises(TypeError):
        s.layer(1.5)


def test_the_order_does_not_change_what_the_kernel_compiles_for():
    """Schedules of any order (and other schedule-only fields) carry one run config, so a step taking them as an
    argument compiles once even when "auto" switches between LPT and stream."""
    rng = np.random.default_rng()
    layouts = random_layouts(rng, 2)
    lengths = rng.integers(1, 3000, 9)
    configs = {
        build_decode_schedule(
            lengths, layouts, 16, 8, config=dataclasses.replace(DECODE, order=order, min_chunk_tokens=chunk)
        ).schedule.config
        for order in ("auto", "lpt", "stream", "naive")
        for chunk in (32, 256)
    }
    assert configs == {DECODE}
