"""The per-head kernels' merge (``ops.decode.item_merge``) in interpret mode against ``head_kernel.merge_at`` and
``packed_out``, the XLA merge it replaces; its refusals; its lowering to one Triton module for every layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops.decode.head_kernel import live_work, merge_at, packed_out, work_items
from kvjax.ops.decode.item_merge import merge_heads

LAYOUT = HeadLayout(12, 3, 64, (16, 64, 48), (48, 16, 32))  # G 4, V widths 48, 16, 32: each narrower than the items


def _items(rng, items: int, g: int, width: int, heads_of_item, layout: HeadLayout):
    """Random partials; each item's columns past its head's V width NaN (unwritten: what a GPU buffer may hold)."""
    acc = rng.normal(size=(items, g, width)).astype(np.float32)
    for i, head in enumerate(heads_of_item):
        acc[i, :, layout.v_widths[head] :] = np.nan
    m = rng.normal(size=(items, g)).astype(np.float32) * 4
    l = rng.uniform(0.5, 2, size=(items, g)).astype(np.float32)
    l[rng.random(l.shape) < 0.1] = 0.0  # a split that saw nothing: its weight is none
    return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l)


def test_the_merge_kernel_equals_the_xla_merge_for_one_list():
    """One work list (``head_kernel``'s live launch): heads that store nothing give zeros and MASK, the rest equal the
    butterfly then ``packed_out``, never touching a column past their own V width; at every split count."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, heads, g, width = 5, LAYOUT.num_kv_heads, LAYOUT.group_size, 48
    stored = rng.integers(0, 3, (b, heads)).astype(np.int32)  # about a third store nothing
    for splits in (None, 1, 4, 16):
        work = live_work(jnp.asarray(stored), splits)
        s, live = int(work[1]), int(work[0])
        items = work_items(b * heads) if splits is None else b * heads * splits
        rows = np.asarray(work[2 : 2 + b * heads])
        acc, m, l = _items(
            rng, items, g, width, [int(rows[min(i // s, live - 1)]) % heads for i in range(items)], LAYOUT
        )
        first = work[2 + b * heads :]
        want, want_lse = merge_at(acc, m, l, first, s if splits else work[1], fixed=splits is not None, with_lse=True)
        want = packed_out(want.reshape(b, heads, g, width), LAYOUT, jnp.float32)
        got, lse = merge_heads(acc, m, l, first, work[1], LAYOUT, jnp.float32, with_lse=True, interpret=True)
        msg = f"seed {seed}, splits {splits}"
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=msg)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-6, err_msg=msg)
        dead = (stored == 0).reshape(-1)
        assert np.isfinite(np.asarray(got)).all() and (np.asarray(lse)[dead] < -1e30).all(), msg


def test_the_merge_kernel_reads_each_heads_own_split_count():
    """Launches of their own splits in one buffer (``quant_head_kernel``'s): a count a head, each head's items where
    its launch put them; bf16 out rounds the float32 result once."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    b, heads, g, width = 3, LAYOUT.num_kv_heads, LAYOUT.group_size, 64
    counts = np.array([16, 2, 8])  # head h's launch: splits counts[h], its items from a multiple of 16
    starts = np.cumsum([0, *[work_items(b) for _ in range(heads)]])
    first = np.full((b, heads), -1, np.int64)
    heads_of_item = np.zeros(starts[-1], np.int64)
    for h in range(heads):
        heads_of_item[starts[h] : starts[h + 1]] = h
        for seq in range(b):
            if rng.random() < 0.8:
                first[seq, h] = starts[h] + seq * counts[h]
    acc, m, l = _items(rng, int(starts[-1]), g, width, heads_of_item, LAYOUT)
    first = jnp.asarray(first.reshape(-1), jnp.int32)
    per_item = jnp.asarray(counts[heads_of_item], jnp.int32)
    want = merge_at(acc, m, l, first, per_item, fixed=False)
    want = packed_out(want.reshape(b, heads, g, width), LAYOUT, jnp.float32)
    per_head = jnp.asarray(np.tile(counts, b), jnp.int32)
    got = merge_heads(acc, m, l, first, per_head, LAYOUT, jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
    half = merge_heads(acc, m, l, first, per_head, LAYOUT, jnp.bfloat16, interpret=True)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half), np.asarray(want.astype(jnp.bfloat16)), err_msg=f"seed {seed}")


def test_the_merge_kernel_refuses_items_that_do_not_fit_the_layout():
    acc, m, l = jnp.ones((32, 4, 32)), jnp.ones((32, 4)), jnp.ones((32, 4))
    first = jnp.zeros((6,), jnp.int32)
    with pytest.raises(ValueError, match="widest V head has 48"):
        merge_heads(acc, m, l, first, 1, LAYOUT, jnp.float32, interpret=True)
    acc = jnp.ones((32, 4, 48))
    with pytest.raises(ValueError, match="first"):
        merge_heads(acc, m, l, first[:5], 1, LAYOUT, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="m and l"):
        merge_heads(acc, m[:, :2], l, first, 1, LAYOUT, jnp.float32, interpret=True)


def test_the_merge_kernel_lowers_to_one_triton_module_for_every_layer():
    """Two layers of other widths (the model's widest V head the same) lower, for an H100 (no GPU here), to one
    module: the widths, offsets and output columns are inputs, so XLA compiles the merge once for the model."""
    from kvjax.ops.lowering import triton_modules

    other = HeadLayout(12, 3, 64, (32, 32, 16), (16, 48, 48))
    modules = set()
    for lay in (LAYOUT, other):
        args = (
            jax.ShapeDtypeStruct((64, 4, 48), jnp.float32),
            jax.ShapeDtypeStruct((64, 4), jnp.float32),
            jax.ShapeDtypeStruct((64, 4), jnp.float32),
            jax.ShapeDtypeStruct((6,), jnp.int32),
            jax.ShapeDtypeStruct((6,), jnp.int32),
        )

        def run(acc, m, l, first, splits, lay=lay):
            return merge_heads(acc, m, l, first, splits, lay, jnp.bfloat16)

        (module,) = triton_modules(run, args)
        assert "@kvjax_head_merge" in module
        modules.add(module)
    assert len(modules) == 1


@pytest.mark.gpu
def test_on_the_gpu_the_merge_kernel_equals_the_xla_merge():
    """The Triton lowering on the GPU, at the engine's shape (B32, 8 KV heads of G 4, items 128 columns wide, the
    launches' counts 16/8/2/1): unwritten columns NaN, a tenth of the heads storing nothing, bf16 out."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(32, 8, 128, (64,) * 8, (48, 96, 128, 16, 64, 32, 112, 80))
    b, heads, g, width = 32, 8, 4, 128
    counts = np.array([16, 16, 8, 8, 2, 2, 1, 1])
    starts = np.cumsum([0, *[work_items(b) for _ in range(heads)]])
    first = np.where(rng.random((b, heads)) < 0.9, starts[:-1] + np.arange(b)[:, None] * counts, -1)
    heads_of_item = np.repeat(np.arange(heads), np.diff(starts))
    acc, m, l = _items(rng, int(starts[-1]), g, width, heads_of_item, layout)
    first = jnp.asarray(first.reshape(-1), jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = merge_at(acc, m, l, first, jnp.asarray(counts[heads_of_item], jnp.int32), fixed=False)
        want = packed_out(want.reshape(b, heads, g, width), layout, jnp.float32)
    got = merge_heads(acc, m, l, first, jnp.asarray(np.tile(counts, b), jnp.int32), layout, jnp.bfloat16)
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 1e-2 and np.isfinite(np.asarray(got.astype(jnp.float32))).all(), f"seed {seed}: error {err}"
