"""Per-head paging's host side (``kvjax.runtime.head_pages``): a fuzz of growth, eviction with compaction and
release over random owners, heads of different tokens per page, one pool or one a device (tensor parallelism), and
pools simulated token by token: after every operation the pages add up, and each head's slots hold exactly its
surviving tokens, in order."""

import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.ops.paging import NULL_PAGE
from kvjax.runtime.head_pages import HeadPages


class Pool:
    """What the device pools would hold: token ids per (device, page, token in page); -1 empty."""

    def __init__(self, pages: HeadPages, per_page_max: int):
        self.data = np.full((pages.devices, pages.num_pages, per_page_max), -1, np.int64)

    def write(self, pages: HeadPages, owner: int, before: np.ndarray, ids) -> None:
        table = pages.table(owner)
        for (layer, head), start in np.ndenumerate(before):
            per, device = pages.per_page[layer, head], pages.device_of[head]
            for i, token in enumerate(ids[layer][head]):
                slot = start + i
                self.data[device, table[layer, head, slot // per], slot % per] = token

    def read(self, pages: HeadPages, owner: int, layer: int, head: int) -> list[int]:
        table, per, device = pages.table(owner), pages.per_page[layer, head], pages.device_of[head]
        held = range(pages.stored(owner)[layer, head])
        return [int(self.data[device, table[layer, head, s // per], s % per]) for s in held]

    def move(self, pages: HeadPages, source: np.ndarray, destination: np.ndarray) -> None:
        device = pages.device_of[source[:, 1]]  # a head's moves stay in its device's pool
        self.data[device, destination[:, 2], destination[:, 3]] = self.data[device, source[:, 2], source[:, 3]]


def _grow(pages, pool, want, owner, n, next_id) -> int | None:
    """Grow ``owner`` by ``n`` tokens a head, writing fresh ids; the next free id, or None if refused."""
    layers, heads = pages.shape
    before, free_before = pages.stored(owner), pages.free_per_device
    fits = pages.fits(owner, n)
    if pages.grow(owner, n) is None:
        too_long = (-(-(before + n) // pages.per_page) > pages.max_pages).any()
        assert (
            (not fits or too_long)
            and (pages.free_per_device == free_before).all()
            and (pages.stored(owner) == before).all()
        )
        return None
    ids = [
        [list(range(next_id + (i * heads + h) * n, next_id + (i * heads + h + 1) * n)) for h in range(heads)]
        for i in range(layers)
    ]
    pool.write(pages, owner, before, ids)
    held = want.setdefault(owner, [[[] for _ in range(heads)] for _ in range(layers)])
    for i in range(layers):
        for h in range(heads):
            held[i][h] += ids[i][h]
    return next_id + layers * heads * n


def _evict(pages, pool, want, owner, rng) -> int:
    """Evict a random share of ``owner``'s tokens per head; the tokens moved."""
    layers, heads = pages.shape
    keep = rng.random((layers, heads, int(pages.stored(owner).max()) + 2)) < rng.random()
    free_before = pages.free_per_device
    source, destination = pages.evict(owner, keep)
    pool.move(pages, source, destination)
    gained = np.zeros(pages.devices, np.int64)
    for i in range(layers):
        for h in range(heads):
            survivors = [t for j, t in enumerate(want[owner][i][h]) if keep[i, h, j]]
            per = pages.per_page[i, h]
            gained[pages.device_of[h]] += -(-len(want[owner][i][h]) // per) - -(-len(survivors) // per)
            want[owner][i][h] = survivors
    assert (pages.free_per_device == free_before + gained).all()
    return len(source)


@pytest.mark.parametrize("trial", range(6))
def test_grow_evict_and_free_keep_every_heads_tokens_and_the_pool_whole(trial):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layers, heads = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    devices = int(rng.choice([d for d in (1, 2, 3, 4) if heads % d == 0]))  # a pool a device, each its run of heads
    per_page = rng.choice([1, 2, 3, 4, 8], (layers, heads))
    per_page.flat[rng.integers(per_page.size)] = rng.choice([2, 3, 4, 8])  # a page of one token never moves a token
    size = 1 + layers * heads // devices * int(rng.integers(2, 5))
    pages = HeadPages(size, per_page, max_pages=int(rng.integers(4, 12)), devices=devices)
    pool = Pool(pages, int(per_page.max()))
    want: dict[int, list[list[list[int]]]] = {}  # owner -> per layer, head: its tokens in order
    next_id, refused, moves = 0, 0, 0
    for _ in range(300):
        op, owner = rng.random(), int(rng.integers(0, 5))
        if op < 0.55:
            grown = _grow(pages, pool, want, owner, int(rng.integers(1, 7)), next_id)
            refused += grown is None
            next_id = next_id if grown is None else grown
        elif op < 0.85 and owner in want:
            moves += _evict(pages, pool, want, owner, rng)
        elif owner in want:
            pages.free(owner)
            del want[owner]
            assert (pages.table(owner) == NULL_PAGE).all() and not pages.stored(owner).any()
        pages.check()
        for o, held in want.items():
            for i in range(layers):
                for h in range(heads):
                    assert pool.read(pages, o, i, h) == held[i][h], f"seed {seed}: owner {o}, head ({i}, {h})"
    assert refused and moves, f"seed {seed}: the fuzz never filled the pool or never moved a token"


def test_a_head_of_a_narrow_width_fills_pages_of_more_tokens():
    pages = HeadPages(10, [[16, 64]], max_pages=4)
    assert pages.need(0, 64) == 4 + 1
    filled = pages.grow(0, 64)
    assert filled.tolist() == [[0, 0, i, page] for i, page in enumerate(pages.table(0)[0, 0, :4])] + [
        [0, 1, 0, pages.table(0)[0, 1, 0]]
    ]
    assert (pages.table(0) != NULL_PAGE).sum(-1).tolist() == [[4, 1]] and pages.free_pages == 4
    assert pages.grow(0, 1) is None  # the wide head would need a fifth page: more than max_pages
    source, destination = pages.evict(0, np.ones((1, 2, 64), bool) & (np.arange(64) >= 32))
    assert pages.stored(0).tolist() == [[32, 32]] and pages.free_pages == 6
    assert len(source) == len(destination) == 64  # both heads' survivors moved to their front


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="per_page"):
        HeadPages(8, [[0, 4]], 2)
    with pytest.raises(ValueError, match="at least 2 pages"):
        HeadPages(1, [[4]], 2)


def test_growing_many_at_once_is_growing_each_in_turn():
    """A decode step's one batched grow hands out the same pages to the same heads as growing each sequence in turn,
    and refuses, changing nothing, when the pool cannot hold all of it."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    per_page = rng.choice([1, 2, 4, 8], (3, 2))
    one, many = HeadPages(4000, per_page, 256), HeadPages(4000, per_page, 256)
    for owner in range(5):
        n = rng.integers(1, 30, (3, 2))
        assert one.grow(owner, n) is not None and many.grow(owner, n) is not None
    for _ in range(20):
        owners = sorted(rng.choice(5, int(rng.integers(1, 6)), replace=False).tolist())
        n = int(rng.integers(1, 5))
        filled = many.grow_many(owners, n)
        singles = [one.grow(owner, n) for owner in owners]
        assert filled is not None and all(s is not None for s in singles), f"seed {seed}"
        assert filled[:, 1:].tolist() == np.concatenate(singles).tolist(), f"seed {seed}"
        assert filled[:, 0].tolist() == [i for i, s in enumerate(singles) for _ in range(len(s))]
        for owner in range(5):
            assert (one.table(owner) == many.table(owner)).all() and (one.stored(owner) == many.stored(owner)).all()
    free = many.free_pages
    assert many.grow_many([0, 1], free * 8 + 1) is None and many.free_pages == free


def test_shrinking_to_what_the_device_kept_gives_back_the_pages_past_it():
    pages = HeadPages(20, [[4, 8]], max_pages=8)
    assert pages.grow(0, 20) is not None  # 5 pages and 3 pages
    freed = pages.shrink(0, np.array([[9, 8]]))
    assert len(freed) == 2 + 2 and pages.stored(0).tolist() == [[9, 8]] and pages.free_pages == 19 - 4
    pages.check()
    for bad in ([[10, 8]], [[-1, 0]], [[1, 2, 3]]):
        with pytest.raises(ValueError, match="kept must be"):
            pages.shrink(0, np.array(bad))


def test_device_tables_follow_the_filled_entries_across_growth_eviction_and_reuse():
    """``HeadKVCache.with_entries`` applied to ``grow_many``'s rows each step keeps every slot's device tables equal
    to ``HeadPages.table`` on the pages each head's stored count needs, across shrinks, frees (``freed``) and slots
    taken again by new owners."""
    from kvjax.runtime.cache import HeadKVCache

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    per = rng.choice([4, 6, 16], (2, 3))
    pages = HeadPages(300, per, max_pages=20)
    cache = HeadKVCache.create(300, 8, slots=4, layers=2, heads=3, max_pages=20, dtype=np.float32)
    owner_of: dict[int, int] = {}  # slot -> owner
    next_owner = 0
    for step in range(30):
        free = [s for s in range(4) if s not in owner_of]
        if free and rng.random() < 0.3:
            owner_of[free[0]] = next_owner
            next_owner += 1
        slots = sorted(owner_of)
        if not slots:
            continue
        new = rng.integers(1, 6, (len(slots), 2, 3))
        entries = pages.grow_many([owner_of[s] for s in slots], new)
        if entries is not None:
            cache = cache.with_entries(slots, entries)
        if rng.random() < 0.3:  # an eviction: shrink one owner's heads
            s = int(rng.choice(slots))
            stored = pages.stored(owner_of[s])
            pages.shrink(owner_of[s], rng.integers(0, stored + 1))
        if rng.random() < 0.2:
            s = int(rng.choice(slots))
            pages.free(owner_of.pop(s))
            cache = cache.freed(s)
        pages.check()
        tables = np.asarray(cache.tables)
        for s, owner in owner_of.items():
            need = -(-pages.stored(owner) // per)  # [layers, heads]
            mine = np.arange(20) < need[..., None]
            np.testing.assert_array_equal(tables[s][mine], pages.table(owner)[mine], f"seed {seed}, step {step}")
        for s in set(range(4)) - set(owner_of):
            assert (tables[s] == NULL_PAGE).all(), f"seed {seed}: a free slot keeps tables"


def test_a_sliding_window_head_gives_back_the_pages_its_window_passed():
    """Layer 0 has a window of 6, layer 1 none; pages of 4 tokens. Nothing goes back before the prompt's eviction is
    heard, nor while the window still reaches into the kept prompt (the device alone knows where); after that a page
    goes back as soon as the next query's window starts past its last slot, and growth goes on past it."""
    pages = HeadPages(40, [[4], [4]], max_pages=10, windows=[6, None])
    pages.grow(0, 10)  # a 10-token prompt: every head takes its pages
    assert not len(pages.release_passed([0]))  # not evicted yet
    pages.evicted(0, 10, np.array([[5], [7]]))  # layer 0 kept 5 (all in its last 6 positions), layer 1 kept 7
    assert pages.stored(0).tolist() == [[5], [7]]
    released = 0
    for decoded in range(1, 20):  # the step appending decoded token number `decoded` releases, then grows
        freed = pages.release_passed([0])
        first = 5 + decoded - 6 if decoded >= 6 else 0  # its window's first slot (head_paging.window_first)
        assert len(freed) == first // 4 - released
        released = first // 4
        table, held = pages.table(0), -(-(pages.stored(0)[:, 0]) // 4)
        assert (table[0, 0, :released] == NULL_PAGE).all() and (table[0, 0, released : held[0]] != NULL_PAGE).all()
        assert (table[1, 0, : held[1]] != NULL_PAGE).all()  # the whole-context layer keeps every page
        assert pages.grow(0, 1) is not None
        pages.check()
    free = pages.free_pages
    pages.free(0)
    assert pages.free_pages == 39 and free < 39
    pages.check()
    with pytest.raises(ValueError, match="windows"):
        HeadPages(8, [[4]], 2, windows=[0])
    with pytest.raises(ValueError, match="windows"):
        HeadPages(8, [[4]], 2, windows=[4, 4])


def test_each_device_numbers_its_own_pages_and_one_full_device_refuses_the_growth():
    pages = HeadPages(6, [[1, 1, 4, 4]], max_pages=8, devices=2)  # heads 0-1 on device 0, 2-3 on device 1
    first = pages.grow(0, 1)
    assert sorted(first[:, 3].tolist()) == [1, 1, 2, 2]  # both devices hand out their pages 1 and 2
    assert pages.free_per_device.tolist() == [3, 3] and pages.free_pages == 3
    assert pages.fits(0, 1) and not pages.fits(0, 2)  # 4 pages on device 0, none on device 1: 6 free, but not there
    assert pages.need(0, 2) == 4 and pages.grow(0, 2) is None and pages.free_per_device.tolist() == [3, 3]
    pages.free(0)
    assert pages.free_per_device.tolist() == [5, 5]
    pages.check()
    with pytest.raises(ValueError, match="cannot be split evenly"):
        HeadPages(4, [[4, 4, 1]], max_pages=8, devices=2)
