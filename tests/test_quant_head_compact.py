"""Continual eviction on quantized per-head pages, by whole groups: ``ops.quant_head_paging.compact_groups`` against
each head's slots read before and after (``quant_head_paging.read``), on pools of random bytes, and
``eviction.continual.compress_groups``' choice (the host's count, the recent groups, the best scored others)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import fresh_seed

from kvjax.eviction import Eviction, metrics
from kvjax.eviction.continual import compress_groups, halved
from kvjax.layout import HeadLayout
from kvjax.ops import quant_head_paging as qhp

LAYOUTS = (HeadLayout(8, 4, 64, (16, 64, 16, 48), (32, 16, 32, 64)), HeadLayout(8, 4, 64, (32, 64, 64, 16), (48,) * 4))
GROUP, BITS, PAGES = 8, 4, 5
READ = jax.jit(qhp.read, static_argnums=(4, 5, 6, 7, 8, 9))
COMPACT = jax.jit(qhp.compact_groups, static_argnums=(4, 5, 6, 7, 8))


def _state(rng, b, at_least: int = 0, fix=None):
    """(pool, tails, tables [B, L, Hkv, PAGES], stored [B, L, Hkv], page_bytes): every head's full groups random
    values on shuffled pages of one pool of random bytes, its partial group in its layer's tail; each head stores
    ``at_least`` slots, ``fix`` {(row, layer, head): slots} exactly."""
    page_bytes = qhp.pool_page_bytes(LAYOUTS, GROUP, BITS)
    n_heads = b * len(LAYOUTS) * 4
    pool = rng.integers(0, 256, (1 + n_heads * PAGES, page_bytes)).astype(np.uint8)
    tables = (1 + rng.permutation(n_heads * PAGES)).reshape(b, len(LAYOUTS), 4, PAGES).astype(np.int32)
    stored = np.zeros((b, len(LAYOUTS), 4), np.int64)
    for layer, lay in enumerate(LAYOUTS):
        for h, (kw, vw) in enumerate(zip(lay.k_widths, lay.v_widths)):
            fmt = qhp.head_format(kw, vw, GROUP, BITS)
            per = qhp.groups_per_page(page_bytes, kw, vw, GROUP, BITS)
            stored[:, layer, h] = rng.integers(at_least, per * PAGES * GROUP, b)
            for (row, lr, hd), n in (fix or {}).items():
                if (lr, hd) == (layer, h):
                    stored[row, layer, h] = n
            k = rng.normal(size=(b, per * PAGES, GROUP, kw)).astype(np.float32)
            v = rng.normal(size=(b, per * PAGES, GROUP, vw)).astype(np.float32)
            encoded = np.asarray(fmt.encode(jnp.asarray(k), jnp.asarray(v)))  # [B, groups, bytes]
            for row in range(b):
                for grp in range(stored[row, layer, h] // GROUP):
                    page, nth = tables[row, layer, h, grp // per], grp % per
                    pool[page, nth * fmt.page_bytes : (nth + 1) * fmt.page_bytes] = encoded[row, grp]
    tails = [jnp.asarray(rng.normal(size=(b, GROUP, lay.k_cols + lay.v_cols)), jnp.float32) for lay in LAYOUTS]
    return jnp.asarray(pool), tails, tables, stored, page_bytes


def _slots(pool, tails, tables, stored, page_bytes, layer, h):
    lay = LAYOUTS[layer]
    tokens = max(int(stored.max()), 1)
    table, count = jnp.asarray(tables[:, layer]), jnp.asarray(stored[:, layer], jnp.int32)
    k, v = READ(pool, tails[layer], table, count, h, lay, page_bytes, GROUP, BITS, tokens)
    return np.asarray(k), np.asarray(v)


def test_each_head_keeps_its_marked_groups_in_order_and_its_partial_group():
    """Random marks (none, all, some); the survivors' slots read back equal the marked groups' in order, then the
    partial group's, and each head's count is its kept groups' slots plus the partial group's. A layer left out keeps
    its bytes. A stale table entry past a head's filled pages, naming a page another head moves, is never written."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b = 3
    pool, tails, tables, stored, page_bytes = _state(rng, b)
    stored[0, 0] = [0, GROUP - 3, 3 * GROUP, 2 * GROUP + 5]  # nothing, a partial group only, whole groups, both
    s = int(stored.max()) // GROUP + 2
    keep = rng.random((b, len(LAYOUTS), 4, s)) < 0.5
    keep[1, 0, 1] = True  # every group
    keep[2, 0, 2] = False  # none
    keep[:, 1] = True  # the layer left out: every group, as the caller marks it
    # a stale entry: row 1 of head 3 (layer 0), past its one filled page, names row 0's first page, whose groups move
    # (the second kept, the first not): the scatter must not write that page back from row 1's copy
    stored[1, 0, 3] = GROUP + 2
    keep[0, 0, 3, :2] = [False, True]
    tables[1, 0, 3, 1:] = tables[0, 0, 3, 0]
    before = {
        (layer, h): _slots(pool, tails, tables, stored, page_bytes, layer, h) for layer in (0, 1) for h in range(4)
    }
    new_pool, after = COMPACT(
        pool, jnp.asarray(tables), jnp.asarray(keep), jnp.asarray(stored), LAYOUTS, page_bytes, GROUP, BITS, (0,)
    )
    after = np.asarray(after)
    for layer in (0, 1):
        for h in range(4):
            k_after, v_after = _slots(new_pool, tails, tables, after, page_bytes, layer, h)
            k0, v0 = before[(layer, h)]
            for row in range(b):
                full = int(stored[row, layer, h]) // GROUP
                kept = [g for g in range(full) if keep[row, layer, h, g]]
                slots = [g * GROUP + r for g in kept for r in range(GROUP)]
                slots += list(range(full * GROUP, int(stored[row, layer, h])))  # the partial group, in the tail
                assert after[row, layer, h] == len(slots), f"seed {seed}"
                np.testing.assert_array_equal(k_after[row, : len(slots)], k0[row, slots], err_msg=f"seed {seed}")
                np.testing.assert_array_equal(v_after[row, : len(slots)], v0[row, slots], err_msg=f"seed {seed}")


def test_keeping_every_group_changes_no_byte():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    pool, _, tables, stored, page_bytes = _state(rng, 2)
    keep = jnp.ones((2, len(LAYOUTS), 4, int(stored.max()) // GROUP + 1), bool)
    got, after = COMPACT(pool, jnp.asarray(tables), keep, jnp.asarray(stored), LAYOUTS, page_bytes, GROUP, BITS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pool), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(after), stored)


def test_halved_on_groups_keeps_whole_groups_and_the_partial_one():
    """``halved(group=)``: whole groups plus the partial group, at least the plain target, at most what is stored."""
    spec = Eviction("snapkv", ratio=2, page_size=GROUP)
    stored = np.arange(0, 300)
    plain, got = halved(spec, stored), halved(spec, stored, group=GROUP)
    assert ((got - stored % GROUP) % GROUP == 0).all() and (got >= plain).all() and (got <= stored).all()
    assert (got - plain < GROUP).all()
    np.testing.assert_array_equal(halved(spec, stored[None], windows=(64,), group=GROUP)[0], stored)


def test_compress_groups_keeps_the_hosts_count_its_recent_groups_and_the_best_scored_others():
    """Each head of a cut layer keeps exactly ``halved``'s count, in whole groups: its groups reaching the last
    ``recent`` slots (with its partial group) and then its others by their best slot's window score (keys read
    as attention reads them): no dropped group outscores a kept one. A layer left uncut keeps every slot."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, w = 2, 4
    spec = Eviction("kvcompress", ratio=2, window=w, page_size=GROUP)
    # at least the window (its rows are the last W queries' own slots); a partial group of one, whose recent slots
    # reach back into the last full group
    pool, tails, tables, stored, page_bytes = _state(rng, b, spec.recent, {(0, 0, 0): 3 * GROUP + 1})
    tokens = PAGES * qhp.groups_per_page(page_bytes, 16, 32, GROUP, BITS) * GROUP
    queries = [jnp.asarray(rng.normal(size=(b, w, lay.q_cols)), jnp.float32) for lay in LAYOUTS]
    target = halved(spec, stored, windows=(None, 64), group=GROUP)
    st = jnp.asarray(stored, jnp.int32)
    _, kept, keep = compress_groups(
        spec, queries, pool, tails, jnp.asarray(tables), st, jnp.asarray(target), LAYOUTS, page_bytes, GROUP, BITS,
        tokens, windows=(None, 64),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kept), target, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(kept)[:, 1], stored[:, 1])
    keep = np.asarray(keep)
    lay = LAYOUTS[0]
    keys = jnp.concatenate([READ(pool, tails[0], jnp.asarray(tables[:, 0]), st[:, 0], h, lay, page_bytes, GROUP, BITS,
                                 tokens)[0] for h in range(4)], -1)  # fmt: skip
    scores = np.asarray(metrics.window_scores(spec.method, queries[0], keys, st[:, 0], lay, pool=spec.pool))
    for row in range(b):
        for h in range(4):
            n = int(stored[row, 0, h])
            full, partial = n // GROUP, n % GROUP
            protect = -(-max(spec.recent - partial, 0) // GROUP)
            by_group = scores[row, h, : full * GROUP].reshape(full, GROUP).max(-1)
            kept_groups = np.flatnonzero(keep[row, 0, h, :full])
            assert set(range(max(full - protect, 0), full)) <= set(kept_groups), f"seed {seed}"
            assert not keep[row, 0, h, full:].any()
            free = [g for g in range(max(full - protect, 0)) if g not in kept_groups]
            chosen = [g for g in kept_groups if g < full - protect]
            if free and chosen:
                assert by_group[chosen].min() >= by_group[free].max(), f"seed {seed}: row {row} head {h}"
