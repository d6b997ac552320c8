"""The Pallas prefill kernel against the jnp reference, and its cache writes against ``write_pages``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.layout import HeadLayout
from kvjax.ops import attention
from kvjax.ops.paging import NULL_PAGE, write_pages
from kvjax.ops.prefill.config import PrefillConfig
from kvjax.ops.prefill.kernel import prefill_attention
from kvjax.ops.prefill.op import PrefillOp
from kvjax.ops.prefill.reference import causal_attention, chunk_attention
from kvjax.ops.prefill.work import (
    KV_TILE_BYTES,
    block_rows,
    class_of,
    keys_per_step,
    num_items,
    tile_classes,
    tile_for,
    work_items,
)


def prompts(rng, layout, batch, t, dtype, page_size=16):
    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    pps = -(-t // page_size)
    num_pages = batch * pps + 1
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(batch, pps).astype(np.int32))
    return (
        arr(batch, t, layout.q_cols),
        arr(batch, t, layout.k_cols),
        arr(batch, t, layout.v_cols),
        table,
        arr(num_pages, page_size, layout.k_cols),
        arr(num_pages, page_size, layout.v_cols),
    )


def kernel_args(layout, knobs):
    """(config, shared) of a case's knobs: ``shared_with`` names another layer that shares the kernel."""
    knobs = dict(knobs)
    other = knobs.pop("shared_with", None)
    return PrefillConfig(**knobs), None if other is None else (other, layout)


def rel_err(out, ref, rows=None):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if rows is not None:
        out, ref = out[rows], ref[rows]
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def reference(q, k, v, layout):
    def f32(x):
        return x.astype(jnp.float32)

    with jax.default_matmul_precision("highest"):
        return causal_attention(f32(q), f32(k), f32(v), layout)


CASES = {
    # name: (layout, batch, T, lengths, dtype, knobs)
    "odd widths ragged f32 balanced": (
        HeadLayout(8, 2, 64, (48, 16), (16, 64)),
        2,
        48,
        [48, 21],
        jnp.float32,
        dict(block_q=16, block_k=16, max_block_q=32, tile_widths=(64,)),
    ),
    "every power-of-two tile 112/80 f32": (
        HeadLayout(4, 2, 128, (112, 80), (96, 48)),
        1,
        48,
        [45],
        jnp.float32,
        dict(block_q=16, block_k=16, max_block_q=32, tile_widths=(16, 32, 64, 128)),
    ),
    # one kernel for this layer and a wider one: classes of both, and the wider layer's item count (padding items)
    "shared with another layer bf16": (
        HeadLayout(8, 2, 64, (16, 48), (64, 32)),
        2,
        64,
        [64, 37],
        jnp.bfloat16,
        dict(block_q=32, block_k=16, tile_widths=(32, 64), shared_with=HeadLayout(8, 2, 64, (64, 64), (16, 64))),
    ),
    "bf16 unbalanced": (
        HeadLayout(8, 2, 64, (32, 64), (64, 32)),
        1,
        64,
        [64],
        jnp.bfloat16,
        dict(block_q=32, block_k=16, balanced=False),
    ),
    "G1 sliding window f32": (
        HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 16), sliding_window=10),
        1,
        40,
        [40],
        jnp.float32,
        dict(block_q=16, block_k=16),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_matches_reference_and_writes_pages(name):
    layout, batch, t, lengths, dtype, knobs = CASES[name]
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, batch, t, dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    config, shared = kernel_args(layout, knobs)
    out, kp2, vp2 = prefill_attention(
        q, k, v, layout, lens, kp, vp, table, config=config, interpret=True, shared=shared
    )
    live = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel_err(out, reference(q, k, v, layout), live) < (1e-4 if dtype == jnp.float32 else 1e-2)
    positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
    for got, pages, new in ((kp2, kp, k), (vp2, vp, v)):
        want = write_pages(pages, table, positions, new, jnp.asarray(live))
        # the reference dumps padding rows on the null page; the kernel skips them
        assert np.array_equal(np.asarray(got)[NULL_PAGE + 1 :], np.asarray(want)[NULL_PAGE + 1 :])


@pytest.mark.parametrize("balanced", [True, False])
def test_items_cover_every_row_once_narrow_heads_taller_longest_first(balanced):
    """Every (prompt, query head, row) lies in exactly one item, padding items start past the chunk; balanced, a
    narrower class never gets shorter blocks than a wider one and items run costliest first."""
    rng = np.random.default_rng()
    widths = tuple(int(w) for w in rng.choice(np.arange(16, 129, 16), 3))
    layout = HeadLayout(6, 3, 128, widths, widths[::-1])
    tile_widths = (32, 64, 128)
    classes = tile_classes([layout], tile_widths)
    heads_class = class_of(layout, classes, tile_widths)
    batch, t = 2, int(rng.integers(100, 700))
    count = num_items(layout, classes, tile_widths, batch, t, 64, balanced, 256)
    items = work_items(layout, classes, heads_class, batch, t, 64, balanced, 256, count=count + 5)
    rows_of = {h: block_rows(classes[heads_class[h // 2]], 64, t, balanced, 256) for h in range(6)}
    assert len(items) == count + 5 and (items[count:, 2] == t).all()
    covered = np.zeros((batch, 6, t), int)
    for b, h, q0 in items[:count]:
        covered[b, h, q0 : q0 + rows_of[h]] += 1
    assert (covered == 1).all()
    if balanced:
        cols = {h: classes[heads_class[h // 2]].cols for h in range(6)}
        assert all(rows_of[a] >= rows_of[b] for a in range(6) for b in range(6) if cols[a] <= cols[b])
        cost = [rows_of[h] * min(q0 + rows_of[h], t) * cols[h] for _, h, q0 in items[:count]]
        assert cost == sorted(cost, reverse=True)
    else:
        assert set(rows_of.values()) == {64}


def test_tile_classes_hold_every_head_and_mask_only_where_needed():
    """A head's class is the narrowest allowed tile pair that holds it; a class masks K (V) only if some head in
    it is narrower than its tile."""
    rng = np.random.default_rng()
    tile_widths = (32, 128)
    layouts = [
        HeadLayout(8, 4, 128, *(tuple(int(w) for w in rng.choice(np.arange(16, 129, 16), 4)) for _ in "kv"))
        for _ in range(3)
    ]
    classes = tile_classes(layouts, tile_widths)
    assert len({(c.k_tile, c.v_tile) for c in classes}) == len(classes)
    for lay in layouts:
        for (kw, vw), c in zip(zip(lay.k_widths, lay.v_widths), class_of(lay, classes, tile_widths)):
            cls = classes[c]
            assert cls.k_tile == (32 if kw <= 32 else 128) and cls.v_tile == (32 if vw <= 32 else 128)
            assert (kw < cls.k_tile) <= cls.k_masked and (vw < cls.v_tile) <= cls.v_masked
    for cls in classes:
        widths = [
            (kw, vw)
            for lay in layouts
            for kw, vw in zip(lay.k_widths, lay.v_widths)
            if (tile_for(kw, tile_widths), tile_for(vw, tile_widths)) == (cls.k_tile, cls.v_tile)
        ]
        assert cls.k_masked == any(kw < cls.k_tile for kw, _ in widths)
        assert cls.v_masked == any(vw < cls.v_tile for _, vw in widths)


def test_a_layout_outside_the_shared_ones_is_refused():
    """A layer whose layout is not among those sharing the kernel has no class table: a clear error."""
    layout, other = HeadLayout(4, 2, 32, (32, 16), (16, 32)), HeadLayout(4, 2, 32, (32, 32), (32, 32))
    q, k, v, table, kp, vp = prompts(np.random.default_rng(), layout, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match="one of the shared layouts"):
        prefill_attention(q, k, v, layout, None, kp, vp, table, interpret=True, shared=(other,))


def test_keys_per_step_fit_shared_memory():
    """Keys per step: a power of two, at most block_k and the query rows, and their K/V tiles fit the budget (or
    the step is down to 16 keys)."""
    for block_k in (16, 32, 64, 128):
        for rows in (16, 64, 128, 256):
            for cols in range(32, 513, 32):
                for itemsize, stages in ((2, 3), (2, 4), (4, 2)):
                    keys = keys_per_step(block_k, rows, cols, itemsize, stages)
                    assert keys & (keys - 1) == 0 and keys <= min(block_k, rows)
                    assert keys == 16 or (stages - 1) * keys * cols * itemsize <= KV_TILE_BYTES
                    assert keys == min(block_k, rows) or 2 * keys * (stages - 1) * cols * itemsize > KV_TILE_BYTES


def test_attention_seam():
    layout = HeadLayout(4, 2, 32, (32, 16), (16, 32))
    q, k, v, table, kp, vp = prompts(np.random.default_rng(), layout, 1, 32, jnp.float32)
    lens = jnp.asarray([32], jnp.int32)
    op = PrefillOp(interpret=True)
    out, kp2, vp2 = jax.jit(lambda *a: attention.prefill(*a, op=op), static_argnums=3)(
        q, k, v, layout, kp, vp, table, lens
    )
    assert rel_err(out, reference(q, k, v, layout)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prefill_on_gpu(dtype):
    layout = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, 2, 1000, dtype, 32)
    out, _, _ = prefill_attention(q, k, v, layout, jnp.asarray([1000, 1000], jnp.int32), kp, vp, table)
    assert rel_err(out, reference(q, k, v, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunks_after_a_cached_prefix_match_the_reference(name):
    """A chunk starting past position 0 reads its earlier keys from the pages: kernel == chunk reference, and a
    prompt run in chunks equals the prompt run whole."""
    layout, batch, t, lengths, dtype, knobs = CASES[name]
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, batch, t, dtype)
    config, shared = kernel_args(layout, knobs)
    cut = int(rng.integers(1, min(lengths)))
    lens = jnp.asarray(lengths, jnp.int32)
    starts = jnp.full((batch,), cut, jnp.int32)
    _, kp1, vp1 = prefill_attention(
        q, k, v, layout, jnp.full((batch,), cut), kp, vp, table, config=config, interpret=True, shared=shared
    )

    def tail(x):
        return jnp.pad(x[:, cut:], ((0, 0), (0, cut), (0, 0)))

    out, kp2, vp2 = prefill_attention(
        tail(q),
        tail(k),
        tail(v),
        layout,
        lens - cut,
        kp1,
        vp1,
        table,
        starts,
        config=config,
        interpret=True,
        shared=shared,
    )
    with jax.default_matmul_precision("highest"):
        ref = chunk_attention(
            tail(q).astype(jnp.float32), layout, kp2.astype(jnp.float32), vp2.astype(jnp.float32), table, starts
        )
    live = np.arange(t)[None, :] < (np.asarray(lengths) - cut)[:, None]
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    assert rel_err(out, ref, live) < tol
    whole = reference(q, k, v, layout)[:, cut:]
    assert rel_err(out[:, : t - cut], whole, live[:, : t - cut]) < tol
    _, kp3, vp3 = prefill_attention(q, k, v, layout, lens, kp, vp, table, config=config, interpret=True, shared=shared)
    assert np.array_equal(np.asarray(kp2)[1:], np.asarray(kp3)[1:]) and np.array_equal(
        np.asarray(vp2)[1:], np.asarray(vp3)[1:]
    )


@pytest.mark.gpu
def test_chunk_after_a_prefix_on_gpu():
    layout = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, 2, 1000, jnp.bfloat16, 32)
    cut = 600
    _, kp1, vp1 = prefill_attention(q, k, v, layout, jnp.asarray([cut, cut], jnp.int32), kp, vp, table)
    out, _, _ = prefill_attention(
        q[:, cut:],
        k[:, cut:],
        v[:, cut:],
        layout,
        jnp.asarray([400, 400], jnp.int32),
        kp1,
        vp1,
        table,
        jnp.asarray([cut, cut], jnp.int32),
    )
    assert rel_err(out, reference(q, k, v, layout)[:, cut:]) < 1e-2
