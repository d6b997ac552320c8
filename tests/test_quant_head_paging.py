"""``ops.quant_head_paging``: eviction's per-head pages holding quantized groups, a partial group exact in a tail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import quant_head_paging as qhp
from kvjax.runtime.head_pages import HeadPages

LAYOUT = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))  # widths differ by head, two heads share a pair
GROUP = 4
WRITE = jax.jit(qhp.write_decode, static_argnums=(7, 8, 9, 10))  # one compile a test, not an eager op a step
READ = jax.jit(qhp.read, static_argnums=(4, 5, 6, 7, 8, 9))


def _expected(tokens_k, tokens_v, kw, vw, bits):
    """What a head that stored these slots (in order) reads: full groups round-tripped through its format, the
    partial one exact."""
    fmt = qhp.head_format(kw, vw, GROUP, bits)
    n = len(tokens_k)
    k, v = np.array(tokens_k, np.float32).reshape(n, kw), np.array(tokens_v, np.float32).reshape(n, vw)
    full = n // GROUP * GROUP
    if full:
        kq, vq = fmt.decode(
            fmt.encode(jnp.asarray(k[:full]).reshape(-1, GROUP, kw), jnp.asarray(v[:full]).reshape(-1, GROUP, vw))
        )
        k[:full], v[:full] = np.asarray(kq).reshape(full, kw), np.asarray(vq).reshape(full, vw)
    return k, v


def _pool(bits, slots, layers=1):
    page_bytes = qhp.pool_page_bytes([LAYOUT], GROUP, bits)
    per = np.stack([qhp.layer_tokens_per_page(LAYOUT, page_bytes, GROUP, bits)] * layers)
    pages = HeadPages(400, per, max_pages=32)
    return page_bytes, pages


def _step(pool, tail, table, stored, k, v, active, page_bytes, bits):
    """One ``write_decode`` of rows' K [B, k_cols] and V [B, v_cols] at ``stored`` [B, Hkv] (NumPy)."""
    args = (jnp.asarray(stored, jnp.int32), jnp.asarray(k), jnp.asarray(v), jnp.asarray(active))
    return WRITE(pool, tail, table, *args, LAYOUT, page_bytes, GROUP, bits)


def _record(heads, k, v):
    """Append a row's packed K and V to each head's (keys, values) history."""
    ko, vo = HeadLayout.offsets(LAYOUT.k_widths), HeadLayout.offsets(LAYOUT.v_widths)
    for h, (kw, vw) in enumerate(zip(LAYOUT.k_widths, LAYOUT.v_widths)):
        heads[h][0].append(k[ko[h] : ko[h] + kw])
        heads[h][1].append(v[vo[h] : vo[h] + vw])


def _check_reads(got, row, stored, heads, bits, where):
    """Row ``row`` of ``_read_all``'s reads holds, for each head, ``_expected`` of its (keys, values) history."""
    for h, (kw, vw) in enumerate(zip(LAYOUT.k_widths, LAYOUT.v_widths)):
        n = int(stored[h])
        want_k, want_v = _expected(*heads[h], kw, vw, bits)
        for part, want in ((0, want_k), (1, want_v)):
            got_h = np.asarray(got[h][part][row, :n])
            np.testing.assert_allclose(got_h, want, rtol=1e-6, atol=1e-6, err_msg=f"{where}, head {h}")


def _read_all(pool, tail, table, stored, bits, page_bytes, tokens):
    return [READ(pool, tail, table, stored, h, LAYOUT, page_bytes, GROUP, bits, tokens) for h in range(4)]


@pytest.mark.parametrize("bits", [4, 2])
def test_tokens_written_one_at_a_time_read_back_as_quantized_groups_and_an_exact_tail(bits):
    """``write_decode`` over many steps, some rows inactive some steps (so rows hold different counts): each
    head reads its full groups as its format's round trip of exactly its tokens and its partial group exactly; the
    narrow heads hold more slots a page; no head's bytes disturb another's."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page_bytes, pages = _pool(bits, 3)
    per = qhp.layer_tokens_per_page(LAYOUT, page_bytes, GROUP, bits)
    assert per[0] > per[3] and (per % GROUP == 0).all()
    b, steps = 3, 23
    pool = jnp.asarray(rng.integers(0, 256, (400, page_bytes)), jnp.uint8)  # never zero: stale bytes everywhere
    tail = jnp.asarray(rng.normal(size=(b, GROUP, LAYOUT.k_cols + LAYOUT.v_cols)), jnp.float32)
    stored = np.zeros((b, 4), np.int64)
    history = [[([], []) for _ in range(4)] for _ in range(b)]
    for owner in range(b):
        assert pages.grow(owner, 60) is not None
    table = jnp.asarray(np.stack([pages.table(owner)[0] for owner in range(b)]))
    for _ in range(steps):
        active = rng.random(b) < 0.8
        k = rng.normal(size=(b, LAYOUT.k_cols)).astype(np.float32) * 2
        v = rng.normal(size=(b, LAYOUT.v_cols)).astype(np.float32)
        pool, tail = _step(pool, tail, table, stored, k, v, active, page_bytes, bits)
        for row in np.flatnonzero(active):
            _record(history[row], k[row], v[row])
        stored += active[:, None]
    tokens = int(stored.max())
    got = _read_all(pool, tail, table, jnp.asarray(stored, jnp.int32), bits, page_bytes, tokens)
    for row in range(b):
        _check_reads(got, row, stored[row], history[row], bits, f"seed {seed}, row {row}")
        for h in range(4):
            n, where = int(stored[row, h]), f"seed {seed}, row {row}, head {h}"
            full = n // GROUP * GROUP
            assert np.abs(np.asarray(got[h][0][row, :full]) - np.stack(history[row][h][0])[:full]).max() > 0, where


@pytest.mark.parametrize("bits", [4, 2])
def test_admitted_survivors_read_as_their_groups_and_decode_continues_their_partial_group(bits):
    """``admit``: each head's survivors of a prompt in per-sequence pages land in its slots in order, full groups
    quantized, the partial group exact in the tail row given; decode then continues that group and quantizes it
    when full, as if the survivors had been written one at a time."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    page_bytes, pages = _pool(bits, 2)
    b, seq_page, s = 2, 8, 21
    n_pages = -(-s // seq_page)
    k_pages = [jnp.asarray(rng.normal(size=(1 + b * n_pages, seq_page, LAYOUT.k_cols)), jnp.float32)]
    v_pages = [jnp.asarray(rng.normal(size=(1 + b * n_pages, seq_page, LAYOUT.v_cols)), jnp.float32)]
    seq_table = jnp.asarray(1 + np.arange(b * n_pages).reshape(b, n_pages), jnp.int32)
    keep = rng.random((b, 1, 4, s)) < 0.6
    keep[:, :, :, -1] = True
    keep[0, 0, 2] = False  # a head keeping nothing
    kept = keep.sum(-1)
    for owner in range(b):
        assert pages.grow(owner, (kept[owner] + 6)) is not None
    tables = jnp.asarray(np.stack([pages.table(owner) for owner in range(b)]))  # [B, L, Hkv, pages]
    tails = (jnp.asarray(rng.normal(size=(4, GROUP, LAYOUT.k_cols + LAYOUT.v_cols)), jnp.float32),)
    tail_rows = jnp.asarray([3, 1], jnp.int32)  # the cache slots the two prompts go to
    pool = jnp.asarray(rng.integers(0, 256, (400, page_bytes)), jnp.uint8)
    pool, tails, got_kept = qhp.admit(
        pool,
        tails,
        tables,
        tail_rows,
        k_pages,
        v_pages,
        seq_table,
        jnp.asarray(keep),
        [LAYOUT],
        page_bytes,
        GROUP,
        bits,
    )
    np.testing.assert_array_equal(got_kept, kept)
    ks = np.asarray(k_pages[0])[np.asarray(seq_table)].reshape(b, -1, LAYOUT.k_cols)[:, :s]
    vs = np.asarray(v_pages[0])[np.asarray(seq_table)].reshape(b, -1, LAYOUT.v_cols)[:, :s]
    ko, vo = HeadLayout.offsets(LAYOUT.k_widths), HeadLayout.offsets(LAYOUT.v_widths)
    history = [
        [
            (list(ks[row, keep[row, 0, h], ko[h] : ko[h] + kw]), list(vs[row, keep[row, 0, h], vo[h] : vo[h] + vw]))
            for h, (kw, vw) in enumerate(zip(LAYOUT.k_widths, LAYOUT.v_widths))
        ]
        for row in range(b)
    ]
    # decode rows are cache slots: slot 3 holds prompt 0, slot 1 prompt 1 (rows 0 and 2 idle)
    slot_of = {3: 0, 1: 1}
    table = jnp.zeros((4, 4, tables.shape[-1]), jnp.int32).at[jnp.asarray([3, 1])].set(tables[:, 0])
    stored = np.zeros((4, 4), np.int64)
    stored[[3, 1]] = kept[:, 0]
    active = np.array([False, True, False, True])
    tail = tails[0]
    for _ in range(6):
        k = rng.normal(size=(4, LAYOUT.k_cols)).astype(np.float32)
        v = rng.normal(size=(4, LAYOUT.v_cols)).astype(np.float32)
        pool, tail = _step(pool, tail, table, stored, k, v, active, page_bytes, bits)
        for slot, row in slot_of.items():
            _record(history[row], k[slot], v[slot])
        stored += active[:, None]
    got = _read_all(pool, tail, table, jnp.asarray(stored, jnp.int32), bits, page_bytes, int(stored.max()))
    for slot, row in slot_of.items():
        _check_reads(got, slot, stored[slot], history[row], bits, f"seed {seed}, prompt {row}")


def test_decode_attention_is_softmax_attention_over_what_each_head_reads():
    """``decode_attention``: each query row's softmax over its head's stored slots as ``read`` dequantizes them
    (float64 brute force), a window's first slot honoured, a head storing nothing giving zeros; the pool's stale
    bytes elsewhere (random, some reading as NaN scales) never reach a result."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    bits, s = 4, 30
    page_bytes, pages = _pool(bits, 2)
    lengths = rng.integers(1, s, (2, 4))
    lengths[1, 1] = 0
    for owner in range(2):
        assert pages.grow(owner, lengths[owner][None]) is not None
    tables = jnp.asarray(np.stack([pages.table(owner) for owner in range(2)]))
    k_pages = [jnp.asarray(rng.normal(size=(9, 8, LAYOUT.k_cols)), jnp.float32)]
    v_pages = [jnp.asarray(rng.normal(size=(9, 8, LAYOUT.v_cols)), jnp.float32)]
    seq_table = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    keep = jnp.asarray(np.arange(s)[None, None, None, :] < lengths[:, None, :, None])
    tails = (jnp.asarray(rng.normal(size=(2, GROUP, LAYOUT.k_cols + LAYOUT.v_cols)), jnp.float32),)
    pool = jnp.asarray(rng.integers(0, 256, (400, page_bytes)), jnp.uint8)
    pool, (tail,), _ = qhp.admit(
        pool, tails, tables, jnp.arange(2), k_pages, v_pages, seq_table, keep, [LAYOUT], page_bytes, GROUP, bits
    )
    table, stored = tables[:, 0], jnp.asarray(lengths, jnp.int32)
    first = jnp.asarray(np.minimum(rng.integers(0, 6, (2, 4)), np.maximum(lengths - 1, 0)), jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, LAYOUT.q_cols)), jnp.float32)
    out = np.asarray(qhp.decode_attention(q, pool, tail, table, stored, LAYOUT, page_bytes, GROUP, bits, s, first))
    assert np.isfinite(out).all(), f"seed {seed}"
    reads = _read_all(pool, tail, table, stored, bits, page_bytes, s)
    g = LAYOUT.group_size
    for b in range(2):
        for h, (kw, vw) in enumerate(zip(LAYOUT.k_widths, LAYOUT.v_widths)):
            lo, n = int(first[b, h]), int(lengths[b, h])
            keys, values = (np.asarray(x[b], np.float64) for x in reads[h])
            assert not keys[n:].any() and not values[n:].any()
            qo, oo = HeadLayout.offsets(LAYOUT.k_widths, g)[h], HeadLayout.offsets(LAYOUT.v_widths, g)[h]
            for j in range(g):
                got = out[b, oo + j * vw : oo + (j + 1) * vw]
                if n == 0:
                    assert not got.any()
                    continue
                logits = keys[lo:n] @ np.asarray(q[b, qo + j * kw : qo + (j + 1) * kw], np.float64) / 8.0
                p = np.exp(logits - logits.max())
                want = (p / p.sum()) @ values[lo:n]
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


def test_a_page_too_small_for_a_group_is_refused():
    with pytest.raises(ValueError, match="holds no group"):
        qhp.groups_per_page(16, 64, 64, GROUP, 4)


@pytest.mark.parametrize("bits", [4, 2])
def test_each_heads_group_is_its_bytes_of_the_layers_page(bits):
    """``_head_sources``: one ``PageFormat`` encode of the layer's group, gathered, gives each head's group byte for
    byte as ``head_format``'s encode of that head alone (alignment padding zero): the decode write and admission
    encode every head at once on it."""
    from kvjax.ops.quant import PageFormat

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for layout in (LAYOUT, HeadLayout(12, 3, 128, (128, 32, 80), (16, 112, 48))):
        k = jnp.asarray(rng.normal(size=(3, GROUP, layout.k_cols)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(3, GROUP, layout.v_cols)), jnp.bfloat16)
        src = qhp._head_sources(tuple(layout.k_widths), tuple(layout.v_widths), GROUP, bits)
        encoded = np.asarray(PageFormat.for_layout(layout, GROUP, bits).encode(k, v))
        ko, vo = HeadLayout.offsets(layout.k_widths), HeadLayout.offsets(layout.v_widths)
        for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
            fmt = qhp.head_format(kw, vw, GROUP, bits)
            want = np.asarray(fmt.encode(k[..., ko[h] : ko[h] + kw], v[..., vo[h] : vo[h] + vw]))
            got = np.where(src[h] >= 0, encoded[:, np.maximum(src[h], 0)], 0)[:, : fmt.page_bytes]
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}, head {h}")
            assert (src[h, fmt.page_bytes :] == -1).all()
