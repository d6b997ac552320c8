"""The Pallas prefill kernel against the jnp reference, and its cache writes against ``write_pages``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.cache import NULL_PAGE, write_pages
from kvjax.layout import HeadLayout
from kvjax.pallas.prefill import keys_per_step, prefill_attention, prefill_attention_reference, work_items


def prompts(rng, layout, batch, t, dtype, page_size=16):
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    pps = -(-t // page_size)
    num_pages = batch * pps + 1
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages)).reshape(batch, pps).astype(np.int32))
    return (arr(batch, t, layout.q_cols), arr(batch, t, layout.k_cols), arr(batch, t, layout.v_cols), table,
            arr(num_pages, page_size, layout.k_cols), arr(num_pages, page_size, layout.v_cols))


def rel_err(out, ref, rows=None):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if rows is not None:
        out, ref = out[rows], ref[rows]
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def reference(q, k, v, layout):
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        return prefill_attention_reference(f32(q), f32(k), f32(v), layout)


CASES = {
    # name: (layout, batch, T, lengths, dtype, knobs)
    "odd widths ragged f32 balanced": (HeadLayout(8, 2, 64, (48, 16), (16, 64)), 2, 48, [48, 21], jnp.float32,
                                       dict(block_q=16, block_k=16, max_block_q=32, max_segments=1)),
    "exact pieces 112/80 f32": (HeadLayout(4, 2, 128, (112, 80), (96, 48)), 1, 48, [45], jnp.float32,
                                dict(block_q=16, block_k=16, max_block_q=32)),
    "bf16 unbalanced": (HeadLayout(8, 2, 64, (32, 64), (64, 32)), 1, 64, [64], jnp.bfloat16,
                        dict(block_q=32, block_k=16, balanced=False)),
    "G1 sliding window f32": (HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 16), sliding_window=10), 1, 40, [40],
                              jnp.float32, dict(block_q=16, block_k=16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_matches_reference_and_writes_pages(name):
    layout, batch, t, lengths, dtype, knobs = CASES[name]
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, batch, t, dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    out, kp2, vp2 = prefill_attention(q, k, v, layout, lens, kp, vp, table, interpret=True, **knobs)
    live = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    assert rel_err(out, reference(q, k, v, layout), live) < (1e-4 if dtype == jnp.float32 else 1e-2)
    positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
    for got, pages, new in ((kp2, kp, k), (vp2, vp, v)):
        want = write_pages(pages, table, positions, new, jnp.asarray(live))
        # the reference dumps padding rows on the null page; the kernel skips them
        assert np.array_equal(np.asarray(got)[NULL_PAGE + 1:], np.asarray(want)[NULL_PAGE + 1:])


def test_balanced_items_are_taller_for_narrow_heads_and_longest_first():
    layout = HeadLayout(8, 2, 128, (128, 32), (128, 32))
    items = work_items(layout, 1, 1024, 64, True, 256, 3)
    rows = {h: np.diff(np.unique(items[items[:, 1] == h, 2]))[0] for h in (0, 4)}
    assert rows[0] == 64 and rows[4] == 256  # head 0 is in the wide group, head 4 in the narrow one
    cost = [(256 if h >= 4 else 64) * (q0 + (256 if h >= 4 else 64)) * (64 if h >= 4 else 256) for _, h, q0 in items]
    assert cost == sorted(cost, reverse=True)
    plain = work_items(layout, 1, 1024, 64, False, 256, 3)
    assert len(plain) == 8 * 1024 // 64 and (plain[:, 2] % 64 == 0).all()


def test_keys_per_step_fit_shared_memory():
    """128-key steps for classes up to 176 loaded columns (measured to compile on the H100), fewer past that."""
    assert keys_per_step(128, 128, 176, 2, 3) == 128 and keys_per_step(128, 64, 96, 2, 3) == 64
    assert keys_per_step(128, 128, 256, 2, 3) == 64 and keys_per_step(128, 128, 256, 2, 4) == 32
    assert keys_per_step(32, 64, 256, 4, 2) == 32


def test_attention_seam():
    layout = HeadLayout(4, 2, 32, (32, 16), (16, 32))
    q, k, v, table, kp, vp = prompts(np.random.default_rng(), layout, 1, 32, jnp.float32)
    lens = jnp.asarray([32], jnp.int32)
    out, kp2, vp2 = jax.jit(lambda *a: attention.prefill(*a, backend="interpret"), static_argnums=3)(
        q, k, v, layout, kp, vp, table, lens)
    assert rel_err(out, reference(q, k, v, layout)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prefill_on_gpu(dtype):
    layout = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
    rng = np.random.default_rng()
    q, k, v, table, kp, vp = prompts(rng, layout, 2, 1000, dtype, 32)
    out, _, _ = prefill_attention(q, k, v, layout, jnp.asarray([1000, 1000], jnp.int32), kp, vp, table)
    assert rel_err(out, reference(q, k, v, layout)) < (1e-4 if dtype == jnp.float32 else 1e-2)
