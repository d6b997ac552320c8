"""Per-head pages on the device side (``kvjax.ops.head_paging``), in jnp: tokens written per head read back exactly,
decode attention over heads of different stored counts equals attention over each head's own tokens, and the
compaction moves of an eviction leave each head its survivors, in order."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import head_paging
from kvjax.ops.grouped import attend_groups
from kvjax.ops.pallas_util import merge_splits
from kvjax.runtime.head_pages import HeadPages

LAYOUT = HeadLayout(6, 3, 16, (16, 8, 12), (16, 4, 8))
PAGE_ELEMS = 4 * 32  # 4 full-width tokens, 10 of the (8, 4) head, 6 of the (12, 8) one


def _stored_case(rng, batch: int, lengths):
    """HeadPages for one layer, each sequence grown to ``lengths`` [B, Hkv] tokens a head, and the tokens' K/V."""
    per = head_paging.layer_tokens_per_page(LAYOUT, PAGE_ELEMS)[None]
    pages = HeadPages(200, per, max_pages=16)
    pool = jnp.asarray(rng.normal(size=(200, PAGE_ELEMS)), jnp.float32)  # never zero: stale pages hold noise
    k = rng.normal(size=(batch, lengths.max(), LAYOUT.k_cols)).astype(np.float32)
    v = rng.normal(size=(batch, lengths.max(), LAYOUT.v_cols)).astype(np.float32)
    for b in range(batch):
        assert pages.grow(b, lengths[b][None]) is not None
        table = jnp.asarray(pages.table(b)[0][None])
        slots = jnp.broadcast_to(jnp.arange(lengths.max()), (1, 3, lengths.max()))
        # each head writes its own first lengths[b, h] tokens; the rest of the rows are invalid for it
        for h in range(3):
            valid = jnp.arange(lengths.max())[None] < lengths[b, h]
            one = np.zeros_like(k[b : b + 1]), np.zeros_like(v[b : b + 1])
            ko, vo = HeadLayout.offsets(LAYOUT.k_widths)[h], HeadLayout.offsets(LAYOUT.v_widths)[h]
            one[0][..., ko : ko + LAYOUT.k_widths[h]] = k[b : b + 1, :, ko : ko + LAYOUT.k_widths[h]]
            one[1][..., vo : vo + LAYOUT.v_widths[h]] = v[b : b + 1, :, vo : vo + LAYOUT.v_widths[h]]
            only = jnp.asarray(np.eye(3, dtype=bool)[h])[None, :, None]
            table_h = jnp.where(only, table, 0)  # the other heads' rows go to the null page: dropped
            pool = head_paging.write(pool, table_h, slots, *map(jnp.asarray, one), valid, LAYOUT, PAGE_ELEMS)
    return pages, pool, k, v


def _written(seed: int):
    """A two-sequence case of random lengths a head: (lengths, its pool, tables, K, V)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, (2, 3))
    pages, pool, k, v = _stored_case(rng, 2, lengths)
    return rng, lengths, pool, jnp.asarray(np.stack([pages.table(b)[0] for b in range(2)])), k, v


def test_written_tokens_read_back_per_head():
    seed = fresh_seed()
    _, lengths, pool, tables, k, v = _written(seed)
    for h in range(3):
        got_k, got_v = head_paging.read(pool, tables, h, LAYOUT, PAGE_ELEMS, int(lengths.max()))
        ko, vo = HeadLayout.offsets(LAYOUT.k_widths)[h], HeadLayout.offsets(LAYOUT.v_widths)[h]
        for b in range(2):
            n = lengths[b, h]
            np.testing.assert_array_equal(got_k[b, :n], k[b, :n, ko : ko + LAYOUT.k_widths[h]], f"seed {seed}")
            np.testing.assert_array_equal(got_v[b, :n], v[b, :n, vo : vo + LAYOUT.v_widths[h]], f"seed {seed}")


def test_decode_attention_reads_each_heads_own_tokens():
    seed = fresh_seed()
    rng, lengths, pool, tables, k, v = _written(seed)
    q = rng.normal(size=(2, LAYOUT.q_cols)).astype(np.float32)
    got = head_paging.decode_attention(jnp.asarray(q), pool, tables, jnp.asarray(lengths), LAYOUT, PAGE_ELEMS, 40)
    mask = np.arange(k.shape[1])[None, None, None, :] < lengths[:, :, None, None]  # [B, Hkv, 1, S]
    want = attend_groups(jnp.asarray(q[:, None]), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), LAYOUT)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize("trial", range(3))
def test_compaction_moves_leave_each_head_its_survivors_in_order(trial):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, (1, 3))
    pages, pool, k, v = _stored_case(rng, 1, lengths)
    keep = rng.random((1, 3, 40)) < 0.4
    source, destination = pages.evict(0, keep)
    pool = head_paging.move(pool, source, destination, [LAYOUT], PAGE_ELEMS)
    pages.check()
    table = jnp.asarray(pages.table(0)[0][None])
    for h in range(3):
        survivors = np.flatnonzero(keep[0, h, : lengths[0, h]])
        assert pages.stored(0)[0, h] == len(survivors)
        got_k, got_v = head_paging.read(pool, table, h, LAYOUT, PAGE_ELEMS, max(len(survivors), 1))
        ko, vo = HeadLayout.offsets(LAYOUT.k_widths)[h], HeadLayout.offsets(LAYOUT.v_widths)[h]
        want_k = k[0, survivors, ko : ko + LAYOUT.k_widths[h]]
        want_v = v[0, survivors, vo : vo + LAYOUT.v_widths[h]]
        np.testing.assert_array_equal(got_k[0, : len(survivors)], want_k, f"seed {seed}")
        np.testing.assert_array_equal(got_v[0, : len(survivors)], want_v, f"seed {seed}")


TWO_LAYERS = (LAYOUT, HeadLayout(6, 3, 16, (8, 16, 16), (4, 16, 8)))  # (8, 4) and (16, 16) in both layers


def _heads(pool, pages: HeadPages, owner: int, tokens: int):
    """Each (layer, head) of ``owner``: (K rows, V rows) of its stored slots, as NumPy."""
    table, stored = pages.table(owner), pages.stored(owner)
    out = {}
    for layer, lay in enumerate(TWO_LAYERS):
        for h in range(lay.num_kv_heads):
            k, v = head_paging.read(pool, jnp.asarray(table[layer][None]), h, lay, PAGE_ELEMS, tokens)
            n = stored[layer, h]
            out[layer, h] = np.asarray(k[0, :n]), np.asarray(v[0, :n])
    return out


def _kernel_compact(*args, **kwargs):
    """``ops.head_compact.compact`` in interpret mode, 16 survivors a step (so a head takes several)."""
    from kvjax.ops import head_compact

    return head_compact.compact(*args, **kwargs, interpret=True, chunk=16)


COMPACTIONS = {"jnp": head_paging.compact, "kernel": _kernel_compact}


@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize("backend", list(COMPACTIONS))
def test_device_compaction_equals_the_host_moves(trial, backend):
    """``compact`` (one jitted call, the pool donated) leaves every head of every owner the rows the host's moves
    leave, and the kept counts ``shrink`` takes; two layers, several width pairs, a batch of two owners. The kernel
    also leaves every row it does not move as it was (pages no head fills, slots past the survivors, page tails)."""
    import jax

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    per = np.stack([head_paging.layer_tokens_per_page(lay, PAGE_ELEMS) for lay in TWO_LAYERS])
    host, device = HeadPages(400, per, max_pages=16), HeadPages(400, per, max_pages=16)
    for pages in (host, device):
        for owner in (0, 1):
            assert pages.grow(owner, int(rng.integers(1, 60))) is not None
        rng = np.random.default_rng(seed)  # both managers grow the same
    pool = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(400, PAGE_ELEMS)), jnp.float32)
    keep = rng.random((2, 2, 3, 70)) < rng.random((2, 2, 3, 1))  # some heads keep most, some almost nothing
    want = pool
    for owner in (0, 1):
        source, destination = host.evict(owner, keep[owner])
        want = head_paging.move(want, source, destination, TWO_LAYERS, PAGE_ELEMS)
    tables = jnp.asarray(np.stack([device.table(o) for o in (0, 1)]))
    stored = jnp.asarray(np.stack([device.stored(o) for o in (0, 1)]))
    run = jax.jit(COMPACTIONS[backend], static_argnums=(4, 5), donate_argnums=0)
    got, kept = run(jnp.array(pool), tables, jnp.asarray(keep), stored, TWO_LAYERS, PAGE_ELEMS)
    if backend == "kernel":  # survivors only: every element it wrote is a survivor's, the rest as before
        moved = np.asarray(got) != np.asarray(pool)
        assert moved.sum() <= sum(np.asarray(kept).ravel()) * 2 * 16, f"seed {seed}"
        owned = {int(p) for o in (0, 1) for p in np.asarray(device.table(o)).ravel() if p}
        assert not moved[[p for p in range(400) if p not in owned]].any(), f"seed {seed}"
    for owner in (0, 1):
        device.shrink(owner, np.asarray(kept[owner]))
        np.testing.assert_array_equal(device.table(owner), host.table(owner), f"seed {seed}")
        np.testing.assert_array_equal(device.stored(owner), host.stored(owner), f"seed {seed}")
        got_heads, want_heads = _heads(got, device, owner, 64), _heads(want, host, owner, 64)
        for key, (k, v) in want_heads.items():
            np.testing.assert_array_equal(got_heads[key][0], k, f"seed {seed}, head {key}")
            np.testing.assert_array_equal(got_heads[key][1], v, f"seed {seed}, head {key}")
    device.check()


@pytest.mark.parametrize("backend", list(COMPACTIONS))
def test_compaction_ignores_table_entries_past_a_heads_pages(backend):
    """A device table may still name a page its head gave back and another head of the same width then took (an
    eviction's shrink, then growth). ``compact`` writes every page it reads, so such a stale entry would write the
    page twice in one scatter, after the owner's compacted rows; it reads and writes only the pages each head's
    stored slots fill, and the owner keeps its selection."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 16, (16, 16), (16, 16))  # one width pair: both heads in one scatter, head 1 last
    per = head_paging.layer_tokens_per_page(layout, PAGE_ELEMS)[None]  # 4 tokens a page
    pages = HeadPages(40, per, max_pages=8)
    assert pages.grow(0, np.array([[12, 8]])) is not None  # head 0: 3 pages, head 1: 2
    pool = jnp.asarray(rng.normal(size=(40, PAGE_ELEMS)), jnp.float32)
    table = pages.table(0)
    stale = table.copy()
    stale[0, 1, 2] = table[0, 0, 0]  # head 1's entry past its pages names head 0's first page
    keep = np.zeros((1, 1, 2, 12), bool)
    keep[0, 0, 0, [1, 5, 6, 9]] = True  # head 0 keeps 4 of 12, all moved to its first page
    keep[0, 0, 1, :8] = True
    stored = jnp.asarray(pages.stored(0)[None], jnp.int32)
    want = {h: head_paging.read(pool, jnp.asarray(table[None, 0]), h, layout, PAGE_ELEMS, 12) for h in (0, 1)}
    got, kept = COMPACTIONS[backend](pool, jnp.asarray(stale[None]), jnp.asarray(keep), stored, (layout,), PAGE_ELEMS)
    np.testing.assert_array_equal(kept, [[[4, 8]]])
    for h, rows in ((0, [1, 5, 6, 9]), (1, list(range(8)))):
        k, v = head_paging.read(got, jnp.asarray(table[None, 0]), h, layout, PAGE_ELEMS, len(rows))
        np.testing.assert_array_equal(k[0], want[h][0][0, rows], f"seed {seed}, head {h}")
        np.testing.assert_array_equal(v[0], want[h][1][0, rows], f"seed {seed}, head {h}")


def test_pages_changing_hands_keep_every_heads_tokens_fuzz():
    """A fuzz over owners that grow (writing fresh rows), evict (``compact`` then ``shrink``) and finish at random:
    after every step pages add up, and every head of every owner reads back exactly the rows a plain list model of
    it holds, whoever held its pages before."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    per = np.stack([head_paging.layer_tokens_per_page(lay, PAGE_ELEMS) for lay in TWO_LAYERS])
    pages = HeadPages(120, per, max_pages=12)
    pool = jnp.asarray(rng.normal(size=(120, PAGE_ELEMS)), jnp.float32)
    model: dict[int, dict] = {}  # owner -> (layer, head) -> (list of K rows, list of V rows)
    next_owner = 0
    for step in range(40):
        action = rng.choice(["grow", "grow", "evict", "free"]) if model else "grow"
        if action == "grow":
            owner = int(rng.choice(list(model))) if model and rng.random() < 0.6 else next_owner
            next_owner += owner == next_owner
            n = int(rng.integers(1, 20))
            before = pages.stored(owner)
            if pages.grow(owner, n) is None:
                continue
            table = pages.table(owner)
            heads = model.setdefault(owner, {})
            for layer, lay in enumerate(TWO_LAYERS):
                k = rng.normal(size=(1, n, lay.k_cols)).astype(np.float32)
                v = rng.normal(size=(1, n, lay.v_cols)).astype(np.float32)
                slots = jnp.asarray(before[layer][None, :, None] + np.arange(n))
                valid = jnp.ones((1, n), bool)
                pool = head_paging.write(
                    pool, jnp.asarray(table[layer][None]), slots, jnp.asarray(k), jnp.asarray(v), valid, lay, PAGE_ELEMS
                )
                for h in range(lay.num_kv_heads):
                    ko, vo = HeadLayout.offsets(lay.k_widths)[h], HeadLayout.offsets(lay.v_widths)[h]
                    rows = heads.setdefault((layer, h), ([], []))
                    rows[0].extend(k[0, :, ko : ko + lay.k_widths[h]])
                    rows[1].extend(v[0, :, vo : vo + lay.v_widths[h]])
        elif action == "evict":
            owner = int(rng.choice(list(model)))
            stored = pages.stored(owner)
            keep = rng.random((1, 2, 3, 200)) < rng.random()
            pool, kept = head_paging.compact(
                pool,
                jnp.asarray(pages.table(owner)[None]),
                jnp.asarray(keep),
                jnp.asarray(stored[None]),
                TWO_LAYERS,
                PAGE_ELEMS,
            )
            pages.shrink(owner, np.asarray(kept[0]))
            for (layer, h), (k_rows, v_rows) in model[owner].items():
                survivors = np.flatnonzero(keep[0, layer, h, : stored[layer, h]])
                k_rows[:], v_rows[:] = [k_rows[i] for i in survivors], [v_rows[i] for i in survivors]
        else:
            owner = int(rng.choice(list(model)))
            pages.free(owner)
            del model[owner]
        pages.check()
        for owner, heads in model.items():
            got = _heads(pool, pages, owner, 12 * 10)
            for key, (k_rows, v_rows) in heads.items():
                context = f"seed {seed}, step {step}, owner {owner}, head {key}"
                np.testing.assert_array_equal(got[key][0], np.reshape(k_rows, got[key][0].shape), context)
                np.testing.assert_array_equal(got[key][1], np.reshape(v_rows, got[key][1].shape), context)


@pytest.mark.parametrize("trial", range(3))
def test_admitting_prompts_from_sequence_pages_keeps_each_heads_survivors_in_order(trial):
    """``admit`` copies, for a batch of prompts of different lengths in the engine's per-sequence pages (pages
    shuffled), exactly the tokens each head keeps into its per-head pages, in position order, and nothing past them:
    the slots after a head's survivors in its last page keep what they held."""
    import jax

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page_size, seq_pages = 8, 6
    lengths = rng.integers(1, page_size * seq_pages + 1, 2)
    order = rng.permutation(np.arange(1, 2 * seq_pages + 1))
    seq_table = jnp.asarray(order.reshape(2, seq_pages), jnp.int32)
    k_pages = tuple(jnp.asarray(rng.normal(size=(13, page_size, lay.k_cols)), jnp.float32) for lay in TWO_LAYERS)
    v_pages = tuple(jnp.asarray(rng.normal(size=(13, page_size, lay.v_cols)), jnp.float32) for lay in TWO_LAYERS)
    s = page_size * seq_pages
    keep = (rng.random((2, 2, 3, s)) < rng.random((2, 2, 3, 1))) & (np.arange(s) < lengths[:, None, None, None])
    per = np.stack([head_paging.layer_tokens_per_page(lay, PAGE_ELEMS) for lay in TWO_LAYERS])
    pages = HeadPages(200, per, max_pages=16)
    for b in range(2):
        assert pages.grow(b, keep[b].sum(-1)) is not None
    pool = jnp.asarray(rng.normal(size=(200, PAGE_ELEMS)), jnp.float32)
    tables = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))
    run = jax.jit(head_paging.admit, static_argnums=(6, 7), donate_argnums=0)
    got_pool, kept = run(
        jnp.array(pool), tables, k_pages, v_pages, seq_table, jnp.asarray(keep), TWO_LAYERS, PAGE_ELEMS
    )
    np.testing.assert_array_equal(kept, keep.sum(-1), f"seed {seed}")
    for b in range(2):
        got = _heads(got_pool, pages, b, 160)
        for layer, lay in enumerate(TWO_LAYERS):
            k_seq = np.asarray(k_pages[layer])[order[b * seq_pages : (b + 1) * seq_pages]].reshape(s, -1)
            v_seq = np.asarray(v_pages[layer])[order[b * seq_pages : (b + 1) * seq_pages]].reshape(s, -1)
            for h in range(3):
                ko, vo = HeadLayout.offsets(lay.k_widths)[h], HeadLayout.offsets(lay.v_widths)[h]
                rows = np.flatnonzero(keep[b, layer, h])
                context = f"seed {seed}, sequence {b}, layer {layer}, head {h}"
                np.testing.assert_array_equal(got[layer, h][0], k_seq[rows, ko : ko + lay.k_widths[h]], context)
                np.testing.assert_array_equal(got[layer, h][1], v_seq[rows, vo : vo + lay.v_widths[h]], context)
        # what lies past each head's survivors in its pages is untouched
        table, stored = pages.table(b), pages.stored(b)
        for layer, lay in enumerate(TWO_LAYERS):
            for h, (kw, vw) in enumerate(zip(lay.k_widths, lay.v_widths)):
                p = head_paging.tokens_per_page(PAGE_ELEMS, kw, vw)
                n = stored[layer, h]
                if n % p:
                    last = table[layer, h, n // p]
                    tail = slice((n % p) * kw, p * kw)  # the K rows after the survivors in the last page
                    np.testing.assert_array_equal(np.asarray(got_pool)[last, tail], np.asarray(pool)[last, tail])


def test_a_page_too_small_for_a_head_is_refused():
    with pytest.raises(ValueError, match="holds no token"):
        head_paging.tokens_per_page(16, 12, 8)


@pytest.mark.parametrize(
    "dtype, splits, step", [(np.float32, None, 4), ("bfloat16", None, 1), (np.float32, 3, 2), (np.float32, 16, 7)]
)
@pytest.mark.parametrize("one_launch, schedule", [(False, "slots"), (True, "slots"), (True, "live")])
def test_the_per_head_decode_kernel_matches_the_reference_in_interpret_mode(dtype, splits, step, one_launch, schedule):
    """Any split of a head's pages (some splits with none), any number of pages a step (one, or several with the
    last step's short), a launch per width pair or one for all, merges to the same output."""
    from kvjax.ops.decode.head_kernel import head_paged_decode

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))  # pairs (16, 32) twice: one kernel
    page_elems = 8 * 2 * 64  # 8 full-width tokens; 21 of a (16, 32) head, 16 of (48, 16)
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    pages = HeadPages(300, per, max_pages=12)
    lengths = rng.integers(0, 60, (3, 4))
    lengths[0, 1] = 0  # a head that evicted everything
    for b in range(3):
        assert pages.grow(b, lengths[b][None]) is not None
    pool = jnp.asarray(rng.normal(size=(300, page_elems)), dtype)
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(3)]))
    q = jnp.asarray(rng.normal(size=(3, layout.q_cols)), dtype)
    stored = jnp.asarray(lengths, jnp.int32)
    got = head_paged_decode(
        q,
        pool,
        tables,
        stored,
        layout,
        page_elems,
        splits=splits,
        pages_per_step=step,
        one_launch=one_launch,
        schedule=schedule,
        interpret=True,
    )
    want = head_paging.decode_attention(
        q.astype(jnp.float32), pool.astype(jnp.float32), tables, stored, layout, page_elems, 60
    )
    want = jnp.where(jnp.isnan(want), 0.0, want)  # a head storing nothing: the kernel gives zeros
    tol = 1e-5 if dtype == np.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol, err_msg=f"seed {seed}")


@pytest.mark.parametrize("one_launch, schedule", [(False, "slots"), (True, "slots"), (True, "live")])
def test_the_per_head_decode_kernel_skips_the_slots_a_window_has_passed(one_launch, schedule):
    """A sliding-window layer's heads start at their own first seen slot (``first``): whole pages before it skipped,
    the rest of its page masked, equal to the reference at any start (0, inside the first page, pages in)."""
    from kvjax.ops.decode.head_kernel import head_paged_decode

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64), sliding_window=24)
    page_elems = 8 * 2 * 64
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    pages = HeadPages(300, per, max_pages=12)
    lengths = rng.integers(1, 60, (3, 4))
    for b in range(3):
        assert pages.grow(b, lengths[b][None]) is not None
    first = np.minimum(rng.integers(0, 40, (3, 4)), lengths - 1)
    first[0] = 0
    pool = jnp.asarray(rng.normal(size=(300, page_elems)), np.float32)
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(3)]))
    q = jnp.asarray(rng.normal(size=(3, layout.q_cols)), np.float32)
    stored, first = jnp.asarray(lengths, jnp.int32), jnp.asarray(first, jnp.int32)
    kw = dict(first=first, one_launch=one_launch, schedule=schedule, interpret=True)
    got = head_paged_decode(q, pool, tables, stored, layout, page_elems, **kw)
    want = head_paging.decode_attention(q, pool, tables, stored, layout, page_elems, 60, first=first)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="for sliding-window layers only"):
        plain = dataclasses.replace(layout, sliding_window=None)
        head_paged_decode(q, pool, tables, stored, plain, page_elems, first=first, interpret=True)


@pytest.mark.parametrize(
    "schedule, splits, interpret",
    [
        ("slots", None, True),
        ("slots", 3, True),
        ("live", None, True),
        ("live", 2, True),
        pytest.param("live", None, False, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("window", [None, 24])
def test_the_per_head_decode_kernels_weights_equal_the_softmax_on_each_slot(schedule, splits, interpret, window):
    """``weights=True``: each query row's softmax weight on each slot of its head, from the kernel's own scores and
    the splits' merged denominators (any split of a head's pages, the live schedule's items, a window's first slot,
    a head storing nothing), equal to the reference; slots past a head's count weigh 0 and every row sums to 1."""
    from kvjax.ops.decode.head_kernel import head_paged_decode

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64), sliding_window=window)
    page_elems = 8 * 2 * 64
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    pages = HeadPages(300, per, max_pages=12)
    lengths = rng.integers(1, 60, (3, 4))
    lengths[1, 2] = 0  # a head that evicted everything
    for b in range(3):
        assert pages.grow(b, lengths[b][None]) is not None
    first = None
    if window:
        first = jnp.asarray(np.minimum(rng.integers(0, 40, (3, 4)), np.maximum(lengths - 1, 0)), jnp.int32)
    pool = jnp.asarray(rng.normal(size=(300, page_elems)), np.float32)
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(3)]))
    q = jnp.asarray(rng.normal(size=(3, layout.q_cols)) * 2, np.float32)
    stored = jnp.asarray(lengths, jnp.int32)
    kw = dict(first=first, splits=splits, schedule=schedule, interpret=interpret)
    out, got = head_paged_decode(q, pool, tables, stored, layout, page_elems, weights=True, **kw)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(head_paged_decode(q, pool, tables, stored, layout, page_elems, **kw)), rtol=1e-6
    )
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 dot is TF32
        want = head_paging.decode_weights(q, pool, tables, stored, layout, page_elems, 60, first=first)
    got = np.asarray(got)
    assert got.shape[:3] == (3, 4, layout.group_size) and got.shape[3] >= 60
    np.testing.assert_allclose(got[..., :60], want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    assert not got[..., 60:].any()
    sums = got.sum(axis=-1)
    np.testing.assert_allclose(sums[lengths > 0], 1.0, rtol=1e-5)
    assert not sums[lengths == 0].any()
    _, fewer = head_paged_decode(q, pool, tables, stored, layout, page_elems, weights=True, slots=60, **kw)
    np.testing.assert_array_equal(fewer, got[..., :60], f"seed {seed}")  # the slots a head can store
    # ``sums``: the weights summed over each group (squared first where asked) added on the active rows, in place of
    # the weights; sums longer than the slots the tables address keep their tail
    active = jnp.asarray([True, False, True])
    base = jnp.asarray(rng.uniform(size=(3, 4, got.shape[3] + 5)), jnp.float32)
    for square in (False, True):
        added, sums = head_paged_decode(
            q, pool, tables, stored, layout, page_elems, sums=base, square=square, active=active, **kw
        )
        np.testing.assert_array_equal(added, out)
        share = (got * got if square else got).sum(axis=2) * np.asarray(active)[:, None, None]
        want = np.asarray(base).copy()
        want[..., : got.shape[3]] += share
        np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}, {square}")


@pytest.mark.parametrize("trial", range(4))
def test_where_a_window_starts_in_a_heads_slots_is_counted_from_what_it_kept(trial):
    """``window_before`` then ``window_first``: a head that kept some of its prompt's last W positions and then
    decoded d tokens sees, from its first seen slot on, exactly the stored positions a query at n - 1 + d sees (the
    last W), for every d, any prompt length (shorter than W too) and any selection inside the window."""
    rng = np.random.default_rng(fresh_seed() + trial)
    w, s = int(rng.integers(2, 12)), 40
    n = int(rng.integers(1, s))
    keep = np.zeros((1, 2, 3, s), bool)
    inside = np.arange(s) >= n - w
    keep[..., :n] = (rng.random((1, 2, 3, n)) < 0.6) & inside[:n]
    keep[..., n - 1] = True  # the newest prompt token is always kept (protected)
    before = head_paging.window_before(jnp.asarray(keep), jnp.asarray([n]), (w, None), w)
    assert not np.asarray(before[:, 1]).any()
    for d in range(1, 3 * w):
        kept = [np.flatnonzero(keep[0, 0, h]).tolist() for h in range(3)]
        positions = [k + list(range(n, n + d)) for k in kept]  # each head's slots, in order
        stored = jnp.asarray([[len(p) for p in positions]], jnp.int32)
        first = np.asarray(head_paging.window_first(before[:, 0], stored, w))[0]
        query = n - 1 + d
        for h, p in enumerate(positions):
            seen = [i for i, pos in enumerate(p) if query - pos < w]
            assert seen == list(range(first[h], len(p))), (n, w, d, h)


def test_the_per_head_decode_kernel_lowers_for_sm90():
    """Lowered to Triton IR for an H100 (no GPU here: what XLA would compile): a kernel a width pair, or one kernel
    with a branch per pair (the default)."""
    from kvjax.ops.decode.head_kernel import head_paged_decode
    from kvjax.ops.lowering import triton_modules
    from kvjax.ops.pallas_util import width_pairs

    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))
    page_elems = 8 * 2 * 64
    q = jnp.ones((2, layout.q_cols), jnp.bfloat16)
    pool = jnp.ones((16, page_elems), jnp.bfloat16)
    tables = jnp.ones((2, 4, 4), jnp.int32)
    stored = jnp.full((2, 4), 5, jnp.int32)

    def run(q, pool, tables, stored):
        return head_paged_decode(q, pool, tables, stored, layout, page_elems, one_launch=False)

    modules = triton_modules(run, (q, pool, tables, stored))
    assert len(modules) == 3 and all("tt.dot" in m for m in modules)
    assert any("@kvjax_head_decode_k16_v32" in m for m in modules)

    def one(q, pool, tables, stored):
        return head_paged_decode(q, pool, tables, stored, layout, page_elems)

    (module,) = triton_modules(one, (q, pool, tables, stored))  # every pair in one kernel, a branch each
    assert "@kvjax_head_decode_all" in module and module.count("tt.dot") >= 6

    def weighed(q, pool, tables, stored):
        return head_paged_decode(q, pool, tables, stored, layout, page_elems, schedule="live", weights=True)

    def live(q, pool, tables, stored):
        return head_paged_decode(q, pool, tables, stored, layout, page_elems, schedule="live")

    module, merged = triton_modules(weighed, (q, pool, tables, stored))
    plain, merged_plain = triton_modules(live, (q, pool, tables, stored))
    assert "@kvjax_head_decode_live" in module  # a branch a pair, each storing its scores beside the softmax
    assert "@kvjax_head_merge" in merged and "@kvjax_head_merge" in merged_plain  # the items merged by a kernel
    assert module.count("tt.store") == plain.count("tt.store") + len(width_pairs(layout))
    with pytest.raises(ValueError, match="one launch only"):
        head_paged_decode(q, pool, tables, stored, layout, page_elems, one_launch=False, weights=True)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_decode_over_head_pages_writes_each_heads_next_slot_and_attends_its_own_tokens(backend):
    """``attention.decode_heads``: the new token lands at each KV head's own next slot (heads store different counts,
    one none), the output is softmax attention over each head's stored tokens and the new one (float64 brute force),
    and an inactive row writes nothing and keeps its counts; the kernel in interpret mode gives the same. The
    weights (``weights=True``, the full-history eviction sums' decode share) are that softmax on each slot."""
    from kvjax.ops.attention import decode_heads

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))
    page_elems = 8 * 2 * 64
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    pages = HeadPages(300, per, max_pages=8)
    lengths = rng.integers(0, 40, (3, 4))
    lengths[0, 2] = 0
    for b in range(3):
        assert pages.grow(b, lengths[b][None]) is not None and pages.grow(b, 1) is not None
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(3)]))
    pool = jnp.asarray(rng.normal(size=(300, page_elems)), jnp.float32)
    q = rng.normal(size=(3, layout.q_cols)).astype(np.float32)
    k = rng.normal(size=(3, layout.k_cols)).astype(np.float32)
    v = rng.normal(size=(3, layout.v_cols)).astype(np.float32)
    active = jnp.asarray([True, False, True])
    stored = jnp.asarray(lengths, jnp.int32)
    inputs = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layout, pool, tables, stored, page_elems)
    out, got_pool, after, _, weights = decode_heads(*inputs, backend=backend, active=active, weights=True)
    np.testing.assert_array_equal(after, lengths + np.array([[1], [0], [1]]))
    weights = np.asarray(weights)
    scale = 1 / np.sqrt(layout.head_dim)
    for b in (0, 2):
        for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
            n = lengths[b, h] + 1
            keys, values = (
                np.asarray(x[b], np.float64) for x in head_paging.read(got_pool, tables, h, layout, page_elems, 64)
            )
            ko, vo = HeadLayout.offsets(layout.k_widths)[h], HeadLayout.offsets(layout.v_widths)[h]
            np.testing.assert_array_equal(keys[n - 1], k[b, ko : ko + kw], f"seed {seed}")
            np.testing.assert_array_equal(values[n - 1], v[b, vo : vo + vw], f"seed {seed}")
            qo = HeadLayout.offsets(layout.k_widths, 2)[h]
            for j in range(2):
                logits = keys[:n] @ q[b, qo + j * kw : qo + (j + 1) * kw] * scale
                p = np.exp(logits - logits.max())
                want = (p / p.sum()) @ values[:n]
                np.testing.assert_allclose(weights[b, h, j, :n], p / p.sum(), rtol=2e-4, atol=1e-6)
                assert not weights[b, h, j, n:].any()
                oo = HeadLayout.offsets(layout.v_widths, 2)[h] + j * vw
                np.testing.assert_allclose(out[b, oo : oo + vw], want, rtol=2e-4, atol=2e-5, err_msg=f"seed {seed}")
    untouched = np.asarray(tables[1]).ravel()
    untouched = untouched[untouched != 0]
    np.testing.assert_array_equal(np.asarray(got_pool)[untouched], np.asarray(pool)[untouched])
    base = jnp.asarray(rng.uniform(size=(3, 4, weights.shape[-1])), jnp.float32)
    for square in (False, True):  # ``sums``: the active rows' weights summed over the group (squared) added
        got = decode_heads(*inputs, backend=backend, active=active, sums=base, square=square)
        share = (weights * weights if square else weights).sum(axis=2) * np.asarray(active)[:, None, None]
        np.testing.assert_allclose(got[4], np.asarray(base) + share, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")


@pytest.mark.gpu
def test_a_pool_past_two_billion_elements_is_written_and_read_at_its_far_pages():
    """A per-head pool of more than 2**31 elements (a B32 x 8K engine's is 17 GB): tokens written to its last pages
    by ``decode_heads`` are attended by the kernel as by the reference (a flat int32 element index overflowed there)."""
    from kvjax.ops.attention import decode_heads

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))
    page_elems = 16 * 2 * 64
    num_pages = 2**31 // page_elems + 64
    pool = jnp.zeros((num_pages, page_elems), jnp.bfloat16)
    far = num_pages - 1 - np.arange(2 * 4 * 4).reshape(2, 4, 4)  # every head's pages among the last
    tables, stored = jnp.asarray(far, jnp.int32), jnp.zeros((2, 4), jnp.int32)
    outs = {}
    for _ in range(20):
        q, k, v = (
            jnp.asarray(rng.normal(size=(2, n)), jnp.bfloat16) for n in (layout.q_cols, layout.k_cols, layout.v_cols)
        )
        for backend in ("reference", "pallas"):
            out, new_pool, after, _ = decode_heads(q, k, v, layout, pool, tables, stored, page_elems, backend=backend)
            outs[backend] = np.asarray(out, np.float32)
        pool, stored = new_pool, after
        np.testing.assert_allclose(outs["pallas"], outs["reference"], rtol=3e-2, atol=3e-2, err_msg=f"seed {seed}")
    assert float(jnp.abs(pool[int(far[0, 0, 0])]).sum()) > 0  # the farthest page was written


def test_a_step_reads_fewer_pages_of_a_wide_head_than_shared_memory_would_overflow():
    """Four pages of 16 full-width bf16 tokens stay the step (the measured best); a head of widths (96, 128), 18
    tokens a page, reads 3 (4 would round to 128 rows and ask for 256 KiB); narrow heads keep 4; never below 1."""
    from kvjax.ops.decode.head_kernel import pages_a_step

    assert pages_a_step(16, 128, 128, 4, 2, 2) == 4
    assert pages_a_step(18, 96, 128, 4, 2, 2) == 3
    assert pages_a_step(64, 16, 16, 4, 2, 2) == 4
    assert pages_a_step(512, 128, 128, 4, 4, 3) == 1


def test_the_one_launch_gives_its_programs_to_the_heads_that_store_tokens():
    """``live_work``: the splits come from the live heads, not the slots (2 live sequences of 64 get 16 splits a
    head, 32 full ones 2, 64 full ones 1), the live heads listed in order; ``merge_items`` groups items as
    ``merge_splits`` does at every power-of-two split count."""
    from kvjax.ops.decode.head_kernel import live_work, merge_items, work_items

    stored = np.zeros((64, 8), np.int32)
    stored[[5, 40]] = 100
    work = np.asarray(live_work(jnp.asarray(stored)))
    assert work[0] == 16 and work[1] == 16 and list(work[2:18]) == [*range(40, 48), *range(320, 328)]
    for slots, splits in ((32, 2), (64, 1), (1, 16)):
        full = np.asarray(live_work(jnp.ones((slots, 8), jnp.int32)))
        assert full[:2].tolist() == [slots * 8, splits] and full[0] * full[1] <= work_items(slots * 8)
    assert np.asarray(live_work(jnp.zeros((4, 8), jnp.int32)))[:2].tolist() == [0, 16]
    first = work[2 + 64 * 8 :]  # each head's first item: the live heads' in order, 16 apart; -1 elsewhere
    assert first[40:48].tolist() == list(range(0, 128, 16)) and first[320:328].tolist() == list(range(128, 256, 16))
    assert (np.delete(first, [*range(40, 48), *range(320, 328)]) == -1).all()
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    items = work_items(8)
    acc = jnp.asarray(rng.normal(size=(items, 3, 5)), jnp.float32)
    m = jnp.asarray(rng.normal(size=(items, 3)), jnp.float32)
    l = jnp.asarray(rng.uniform(0.5, 2, size=(items, 3)), jnp.float32)
    for s in (1, 2, 4, 8, 16):
        got = np.asarray(merge_items(acc, m, l, jnp.int32(s)))
        n = items // s
        want = merge_splits(acc.reshape(n, s, 3, 5), m.reshape(n, s, 3), l.reshape(n, s, 3))
        np.testing.assert_allclose(got[::s], want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}, {s} splits")
    # one count an item: launches of their own splits in one buffer (quant_head_kernel), each from a multiple of 16
    parts = [(16, 2), (32, 8), (16 * (items // 16 - 4), 16), (16, 1)]
    counts = jnp.asarray(np.concatenate([np.full(n, s) for n, s in parts]), jnp.int32)
    got = np.asarray(merge_items(acc, m, l, counts))
    at = 0
    for n, s in parts:
        rows = slice(at, at + n)
        want = merge_splits(acc[rows].reshape(-1, s, 3, 5), m[rows].reshape(-1, s, 3), l[rows].reshape(-1, s, 3))
        np.testing.assert_allclose(got[rows][::s], want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}, {s} splits")
        at += n


def test_a_lightly_loaded_one_launch_reads_only_the_live_heads_in_interpret_mode():
    """Two of nine slots store tokens (the rest nothing): under either schedule (the live one's splits from the live
    heads' count) every row matches the reference, the empty slots zeros."""
    from kvjax.ops.decode.head_kernel import head_paged_decode, live_work

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 16))
    page_elems = 8 * 2 * 32
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    pages = HeadPages(300, per, max_pages=16)
    lengths = np.zeros((9, 2), np.int64)
    lengths[[2, 7]] = rng.integers(1, 120, (2, 2))
    for b in range(9):
        assert pages.grow(b, lengths[b][None]) is not None
    pool = jnp.asarray(rng.normal(size=(300, page_elems)), jnp.float32)
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(9)]))
    q = jnp.asarray(rng.normal(size=(9, layout.q_cols)), jnp.float32)
    stored = jnp.asarray(lengths, jnp.int32)
    want = head_paging.decode_attention(q, pool, tables, stored, layout, page_elems, 120)
    want = jnp.where(jnp.isnan(want), 0.0, want)  # a head storing nothing: the kernel gives zeros
    for schedule in ("slots", "live"):
        got = head_paged_decode(
            q, pool, tables, stored, layout, page_elems, pages_per_step=2, schedule=schedule, interpret=True
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
        assert not np.asarray(got)[[0, 1, 3]].any()
    # the engine's work list, built once a step from its live slots: a slot that stores tokens but is not live
    # (slot 7 here) is skipped and gives zeros
    active = jnp.zeros((9, 1), jnp.int32).at[2].set(1)
    work = live_work(jnp.broadcast_to(active, (9, 2)))
    got = head_paged_decode(
        q, pool, tables, stored, layout, page_elems, pages_per_step=2, schedule="live", work=work, interpret=True
    )
    np.testing.assert_allclose(np.asarray(got)[2], np.asarray(want)[2], rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    assert not np.asarray(got)[[0, 1, 3, 7]].any()
    with pytest.raises(ValueError, match="schedule must be"):
        head_paged_decode(q, pool, tables, stored, layout, page_elems, schedule="live", one_launch=False)
    with pytest.raises(ValueError, match="work must be"):
        head_paged_decode(q, pool, tables, stored, layout, page_elems, schedule="live", work=work[:-1])


def test_the_live_merge_ignores_what_a_narrow_head_left_unwritten():
    """A narrow head's item stores only its own columns; the rest hold whatever the output buffer held (NaN on a GPU,
    zeros in interpret mode). The merge must not mix them into a wider head's output through its zero weights."""
    from kvjax.ops.decode.head_kernel import _merge_live, live_work, work_items

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 32, (16, 32), (16, 32))
    stored = jnp.asarray(rng.integers(1, 50, (40, 2)), jnp.int32)  # 80 live heads: 4 splits, 4 heads an item row
    work = live_work(stored)
    items, g, width = work_items(80), 2, 32
    acc = rng.normal(size=(items, g, width)).astype(np.float32)
    m = rng.normal(size=(items, g)).astype(np.float32)
    l = rng.uniform(0.5, 2, size=(items, g)).astype(np.float32)
    s, live = int(work[1]), int(work[0])
    for i in range(items):  # each item's head: the live rows in order, idle items the first
        head = int(work[2 + (i // s if i // s < live else 0)])
        acc[i, :, layout.v_widths[head % 2] :] = np.nan
    got = np.asarray(_merge_live(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), work, None))
    assert s == 4
    for head in range(80):
        vw = layout.v_widths[head % 2]
        assert np.isfinite(got[head, :, :vw]).all(), f"seed {seed}: head {head}"
        rows = slice(head * s, head * s + s)
        want = merge_splits(
            jnp.asarray(acc[None, rows, :, :vw]), jnp.asarray(m[None, rows]), jnp.asarray(l[None, rows])
        )
        np.testing.assert_allclose(got[head, :, :vw], np.asarray(want)[0], rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")


def test_the_compaction_kernel_lowers_to_triton_for_an_h100():
    """Lowered to Triton IR for sm_90 (no GPU here: what XLA would compile): a kernel a width pair, each with the
    barrier between its loads and its stores."""
    from kvjax.ops import head_compact
    from kvjax.ops.lowering import triton_modules

    layouts = (HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64)),)
    pool = jnp.ones((32, 8 * 2 * 64), jnp.bfloat16)
    tables = jnp.ones((2, 1, 4, 4), jnp.int32)
    keep = jnp.ones((2, 1, 4, 40), bool)
    stored = jnp.full((2, 1, 4), 30, jnp.int32)
    modules = triton_modules(lambda *a: head_compact.compact(*a, layouts, 8 * 2 * 64)[0], (pool, tables, keep, stored))
    assert len(modules) == 3 and all("@kvjax_head_compact" in m and "gpu.barrier" in m for m in modules)
