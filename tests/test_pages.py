"""The page manager on its own (``kvjax.runtime.pages``): a fuzz of grow, release and free over random owners and
pools, against a model that tracks what each owner should hold; all-or-nothing growth; refusals; stats."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.ops.paging import NULL_PAGE
from kvjax.runtime.cache import window_span
from kvjax.runtime.pages import PageManager


@pytest.mark.parametrize("seed", range(8))
def test_random_grow_release_and_free_keep_every_pool_whole(seed):
    """Owners grow by random steps, pass their windows and finish at random; after every operation each pool's
    owned + free pages are the pool, none owned twice, and each owner holds exactly its positions' pages with the
    passed window pages given back. A refused grow changes nothing (the owner is then preempted, as the scheduler
    would)."""
    rng = np.random.default_rng(seed)
    page_size, chunk_tokens = int(rng.choice([1, 2, 4])), int(rng.integers(1, 9))
    windows = {int(w): int(rng.integers(4, 20)) for w in rng.choice(np.arange(2, 16), int(rng.integers(0, 3)), False)}
    manager = PageManager(int(rng.integers(8, 24)), page_size, chunk_tokens, windows=windows)
    reached: dict[int, int] = {}
    refused = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.92:
            owner = int(rng.integers(0, 6))
            start = reached.get(owner, 0)
            manager.release_passed(owner, start)
            before = [a.free_pages for a in manager.allocators], manager.table(owner)
            want = start + int(rng.integers(1, chunk_tokens + 1))
            possible = manager.can_grow(owner, want)
            grown = manager.grow(owner, want)
            assert grown == possible
            if grown:
                reached[owner] = want
            else:  # the scheduler would preempt someone: here the owner itself
                refused += 1
                assert ([a.free_pages for a in manager.allocators], manager.table(owner)) == before
                manager.free(owner)
                reached.pop(owner, None)
        elif reached:
            owner = int(rng.choice(list(reached)))
            manager.free(owner)
            del reached[owner]
            assert not manager.holds(owner) and manager.table(owner) == ((),) * len(manager.windows)
        manager.check(reached)
    for owner in list(reached):
        manager.free(owner)
    manager.check({})
    assert [a.free_pages for a in manager.allocators] == [a.num_pages - 1 for a in manager.allocators]
    assert refused > 0  # the pools were small enough to refuse


def test_a_window_pool_gives_back_only_what_no_later_query_sees():
    manager = PageManager(20, 4, 4, windows={8: 6})
    assert manager.grow(7, 16)
    assert manager.table(7) == ((1, 2, 3, 4), (1, 2, 3, 4))
    manager.release_passed(7, 16)  # a query at 16 sees 9..16: pages 0 and 1 (positions 0-7) are done
    assert manager.table(7)[1] == (NULL_PAGE, NULL_PAGE, 3, 4)
    assert manager.stats() == {"free_pages": 15, "total_pages": 19, "window_pages": {"8": [3, 5]}}
    manager.free(7)
    assert manager.stats() == {"free_pages": 19, "total_pages": 19, "window_pages": {"8": [5, 5]}}
    manager.free(7)  # holding nothing: nothing to do


def test_refusals_name_the_pool_and_the_count():
    manager = PageManager(10, 4, 8, windows={16: 3}, max_pages_per_seq=6)
    assert manager.capacity == 24
    assert manager.refusal(25, "20 prompt tokens + 6 new - 1") == (
        "needs 25 cache positions (20 prompt tokens + 6 new - 1), more than the 24 one sequence can hold"
    )
    span = min(6, window_span(16, 4, 8, 6))
    assert manager.refusal(23) == f"needs {span} pages at once in the 16-token window's pool, which holds 2"
    assert manager.refusal(4) is None
    assert PageManager(10, 4, 8).refusal(36) is None and PageManager(10, 4, 8).refusal(37) is not None
