"""Continual eviction on the device (``kvjax.eviction.continual``): per-head observation-window scores equal brute
force over each head's own slots, each head keeps exactly the host's count (its recent slots and its best scored
others, the reference selection), survivors are compacted in order, and the host gives back exactly the pages past
them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed
from test_head_paging import LAYOUT, PAGE_ELEMS, _stored_case

from kvjax.eviction import Eviction, metrics
from kvjax.eviction.continual import compress, halved, keep_counts
from kvjax.eviction.select import compacted
from kvjax.layout import HeadLayout
from kvjax.ops import head_paging

W = 4


def _brute_keep(method, q, k, n, target, protect, pool_width, h):
    """The slots head ``h`` keeps of its ``n`` slots (sorted), by brute force: squared (KV-Compress) or plain
    (SnapKV) softmax of the last W queries, each over the slots up to its own, summed over the window and the
    group, max-pooled, the last ``protect`` always kept, the rest by score, ties to the earlier slot."""
    g, kw = LAYOUT.group_size, LAYOUT.k_widths[h]
    qo, ko = HeadLayout.offsets(LAYOUT.k_widths, g)[h], HeadLayout.offsets(LAYOUT.k_widths)[h]
    qh = q[:, qo : qo + g * kw].reshape(W, g, kw).astype(np.float64)
    keys = k[:n, ko : ko + kw].astype(np.float64)
    total = np.zeros(n)
    for j in range(W):
        row = n - W + j
        if row < 0:
            continue
        logits = qh[j] @ keys[: row + 1].T / np.sqrt(LAYOUT.head_dim)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        total[: row + 1] += (p * p if method == "kvcompress" else p).sum(0)
    half = pool_width // 2
    pooled = np.array([total[max(0, i - half) : i + (pool_width - 1) // 2 + 1].max() for i in range(n)])
    guard = set(range(max(n - protect, 0), n))
    others = sorted((i for i in range(n) if i not in guard), key=lambda i: (-pooled[i], i))
    room = max(min(target, n) - len(guard), 0)
    return sorted(guard | set(others[:room]))


def test_halved_keeps_half_the_recent_slots_at_least_and_never_more_than_stored():
    spec = Eviction("kvcompress", ratio=4)
    stored = np.arange(0, 200)
    got = halved(spec, stored)
    assert (got <= stored).all() and (got >= np.minimum(stored, spec.recent)).all()
    big = stored >= 2 * spec.recent
    np.testing.assert_array_equal(got[big], -(-stored[big] // 2))


@pytest.mark.parametrize("method", metrics.WINDOWED)
def test_window_scores_with_a_count_a_head_equal_each_heads_own_call(method):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, W, LAYOUT.q_cols)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 30, LAYOUT.k_cols)), jnp.float32)
    lengths = rng.integers(1, 31, (2, LAYOUT.num_kv_heads))
    got = metrics.window_scores(method, q, k, lengths, LAYOUT)
    for g in range(LAYOUT.num_kv_heads):
        want = metrics.window_scores(method, q, k, lengths[:, g], LAYOUT)[:, g]
        np.testing.assert_allclose(got[:, g], want, rtol=1e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize("method", metrics.WINDOWED)
@pytest.mark.parametrize("trial", range(3))
def test_each_head_keeps_the_reference_selection_compacted_in_order(method, trial):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = Eviction(method, ratio=2, window=W, page_size=6)
    lengths = rng.integers(1, 60, (2, LAYOUT.num_kv_heads))
    pages, pool, k, v = _stored_case(rng, 2, lengths)
    tables = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))  # [B, L=1, Hkv, pages]
    q = rng.normal(size=(2, W, LAYOUT.q_cols)).astype(np.float32)
    target = halved(spec, lengths)[:, None]
    tokens = int(lengths.max())
    run = jax.jit(compress, static_argnums=(0, 6, 7, 8), donate_argnums=2)
    pool, kept, _ = run(spec, [jnp.asarray(q)], pool, tables, jnp.asarray(lengths[:, None], jnp.int32),
                        jnp.asarray(target), (LAYOUT,), PAGE_ELEMS, tokens)  # fmt: skip
    np.testing.assert_array_equal(kept, target, f"seed {seed}")
    for b in range(2):
        pages.shrink(b, np.asarray(kept[b]))
    pages.check()
    for h in range(LAYOUT.num_kv_heads):
        got_k, got_v = head_paging.read(pool, tables[:, 0], h, LAYOUT, PAGE_ELEMS, tokens)
        ko, vo = HeadLayout.offsets(LAYOUT.k_widths)[h], HeadLayout.offsets(LAYOUT.v_widths)[h]
        kw, vw = LAYOUT.k_widths[h], LAYOUT.v_widths[h]
        for b in range(2):
            want = _brute_keep(method, q[b], k[b], lengths[b, h], target[b, 0, h], spec.recent, spec.pool, h)
            n = len(want)
            assert n == kept[b, 0, h], f"seed {seed}"
            np.testing.assert_array_equal(got_k[b, :n], k[b, want, ko : ko + kw], f"seed {seed}, head {h}")
            np.testing.assert_array_equal(got_v[b, :n], v[b, want, vo : vo + vw], f"seed {seed}, head {h}")


def test_a_target_at_or_past_what_a_head_stores_keeps_every_slot_in_place():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = Eviction("kvcompress", ratio=2, window=W, page_size=6)
    lengths = rng.integers(1, 40, (2, LAYOUT.num_kv_heads))
    pages, pool, k, v = _stored_case(rng, 2, lengths)
    tables = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))
    q = jnp.asarray(rng.normal(size=(2, W, LAYOUT.q_cols)), jnp.float32)
    stored = jnp.asarray(lengths[:, None], jnp.int32)
    before = np.asarray(pool)
    after, kept, keep = compress(spec, [q], pool, tables, stored, stored + 5, (LAYOUT,), PAGE_ELEMS, 40)
    np.testing.assert_array_equal(kept, stored, f"seed {seed}")
    np.testing.assert_array_equal(after, before, f"seed {seed}")
    assert int(keep.sum()) == int(lengths.sum())


def test_the_selection_keeps_the_recent_slots_whatever_they_score():
    scores = jnp.array([[9.0, 8.0, 7.0, 0.0, 0.0, -1.0]])
    keep = keep_counts(scores, jnp.array([6]), jnp.array([3]), protect=2)
    np.testing.assert_array_equal(keep, [[True, False, False, False, True, True]])
    keep = keep_counts(scores, jnp.array([4]), jnp.array([1]), protect=2)  # a target under the protected slots
    np.testing.assert_array_equal(keep, [[False, False, True, True, False, False]])


def test_the_decoded_methods_need_their_sums():
    """H2O, KV-Compress's full form and Keyformer rank each slot's sum, so a cut without them is a one-line error."""
    assert set(metrics.WINDOWED + metrics.DECODED) == set(metrics.METHODS)  # every method can cut mid-decode
    for method in metrics.DECODED:
        with pytest.raises(ValueError, match="give the sums"):
            compress(Eviction(method, budget=8), [], None, None, None, None, (LAYOUT,), PAGE_ELEMS, 8)


@pytest.mark.parametrize("method", metrics.DECODED)
def test_a_full_history_cut_keeps_the_highest_sums_and_compacts_them_in_order(method):
    """With ``sums`` each head keeps its last ``Eviction.recent`` slots and its highest sums up to the host's count,
    its K and V compacted in order; ``select.compacted`` moves the sums with them. The queries are never read."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = Eviction(method, budget=8, page_size=6)
    lengths = rng.integers(1, 40, (2, LAYOUT.num_kv_heads))
    pages, pool, k, v = _stored_case(rng, 2, lengths)
    tables = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))
    stored = lengths[:, None]
    sums = np.where(np.arange(40) < stored[..., None], rng.random((2, 1, LAYOUT.num_kv_heads, 40)), 0.0)
    target = halved(spec, stored)
    after, kept, keep = compress(spec, None, pool, tables, jnp.asarray(stored), jnp.asarray(target), (LAYOUT,),
                                 PAGE_ELEMS, 40, sums=jnp.asarray(sums, jnp.float32))  # fmt: skip
    np.testing.assert_array_equal(kept, target, f"seed {seed}")
    moved = np.asarray(compacted(jnp.asarray(sums), keep, 40))
    for b, h in np.ndindex(2, LAYOUT.num_kv_heads):
        n, want = int(lengths[b, h]), int(target[b, 0, h])
        guard = set(range(max(n - spec.recent, 0), n))
        rest = sorted(set(range(n)) - guard, key=lambda i: (-sums[b, 0, h, i], i))
        chosen = sorted(guard | set(rest[: max(want - len(guard), 0)]))
        np.testing.assert_array_equal(np.flatnonzero(keep[b, 0, h]), chosen, f"seed {seed}, row {b}, head {h}")
        np.testing.assert_allclose(moved[b, 0, h, :want], sums[b, 0, h, chosen], rtol=1e-6)
        assert not moved[b, 0, h, want:].any()
        got_k, _ = head_paging.read(after, tables[:, 0], h, LAYOUT, PAGE_ELEMS, want)
        ko, kw = HeadLayout.offsets(LAYOUT.k_widths)[h], LAYOUT.k_widths[h]
        np.testing.assert_array_equal(got_k[b], k[b, chosen, ko : ko + kw], f"seed {seed}, row {b}, head {h}")


def test_compacted_puts_the_kept_values_first_in_order_and_drops_what_overflows():
    values = jnp.array([[5.0, 6.0, 7.0, 8.0, 9.0]])
    keep = jnp.array([[False, True, False, True, True]])
    np.testing.assert_array_equal(compacted(values, keep, 5), [[6.0, 8.0, 9.0, 0.0, 0.0]])
    np.testing.assert_array_equal(compacted(values, keep, 2), [[6.0, 8.0]])
    np.testing.assert_array_equal(compacted(values, ~keep | True, 3), [[5.0, 6.0, 7.0]])


def test_a_sliding_window_layer_is_never_cut_read_or_moved():
    """``halved`` keeps every slot of a windowed layer, and ``compress`` neither reads nor writes its heads' pages:
    here layer 1 (windowed) names the very pages layer 0 holds, as a local head's stale entries may name pages its
    window gave back, and layer 0 is cut exactly as it is alone."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    spec = Eviction("kvcompress", ratio=2, window=W, page_size=6)
    lengths = rng.integers(W, 50, (2, LAYOUT.num_kv_heads))
    pages, pool, _, _ = _stored_case(rng, 2, lengths)
    table = jnp.asarray(np.stack([pages.table(b) for b in range(2)]))  # [B, 1, Hkv, pages]
    q = jnp.asarray(rng.normal(size=(2, W, LAYOUT.q_cols)), jnp.float32)
    stored = np.stack([lengths, lengths], 1)  # [B, L=2, Hkv]
    target = halved(spec, stored, windows=[None, 8])
    np.testing.assert_array_equal(target[:, 1], lengths)
    alone = compress(spec, [q], pool, table, jnp.asarray(lengths[:, None]), jnp.asarray(target[:, :1]), (LAYOUT,),
                     PAGE_ELEMS, 50)  # fmt: skip
    both = compress(spec, [q, q], pool, jnp.concatenate([table, table], 1), jnp.asarray(stored), jnp.asarray(target),
                    (LAYOUT, LAYOUT), PAGE_ELEMS, 50, windows=(None, 8))  # fmt: skip
    np.testing.assert_array_equal(both[0], alone[0], f"seed {seed}")
    np.testing.assert_array_equal(both[1], np.stack([np.asarray(alone[1])[:, 0], lengths], 1), f"seed {seed}")
