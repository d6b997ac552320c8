import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.layout import HeadLayout
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.paging import NULL_PAGE, write_pages
from kvjax.ops.prefill.reference import causal_attention
from kvjax.runtime.cache import PagedKVCache, block_table, bytes_per_token
from kvjax.runtime.pages import CacheFullError, PageAllocator


def test_allocator_hands_out_distinct_pages_and_errors_when_full():
    alloc = PageAllocator(6)
    a, b = alloc.allocate(2), alloc.allocate(3)
    assert NULL_PAGE not in a + b and len(set(a + b)) == 5
    with pytest.raises(CacheFullError, match="KV cache is full"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.free_pages == 2 and alloc.allocate(0) == []
    with pytest.raises(ValueError, match="already free"):
        alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free([NULL_PAGE])


def test_block_table_rejects_overlong_sequences():
    assert block_table([[3, 4], []], 3).tolist() == [[3, 4, 0], [0, 0, 0]]
    with pytest.raises(ValueError):
        block_table([[1, 2, 3, 4]], 3)


def test_cache_bytes_follow_head_widths():
    layouts = (HeadLayout(4, 2, 16, (16, 32 // 2), (16, 16)), HeadLayout(4, 2, 32, (16, 32), (32, 16)))
    cache = PagedKVCache.create(layouts, num_pages=3, page_size=8, dtype=jnp.bfloat16)
    assert [k.shape[-1] for k in cache.k] == [32, 48] and [v.shape[-1] for v in cache.v] == [32, 48]
    assert bytes_per_token(layouts, jnp.bfloat16) == (32 + 32 + 48 + 48) * 2


def test_layout_rejects_widths_larger_than_head():
    with pytest.raises(ValueError, match="head_dim"):
        HeadLayout(4, 2, 16, (16, 32), (16, 16))


@pytest.mark.parametrize("window", [None, 3])
def test_paged_decode_matches_dense_causal_attention(window):
    """Write random K/V through scattered pages; paged decode at each position equals dense causal attention."""
    rng = np.random.default_rng(7)
    layout = HeadLayout(
        num_heads=6, num_kv_heads=2, head_dim=32, k_widths=(32, 16), v_widths=(16, 32), sliding_window=window
    )
    b, t, page = 2, 11, 4
    q = jnp.asarray(rng.normal(size=(b, t, layout.q_cols)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, layout.k_cols)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, layout.v_cols)), jnp.float32)
    dense = causal_attention(q, k, v, layout)
    alloc = PageAllocator(16)
    alloc.allocate(2)  # so sequences do not start at page 1
    table = jnp.asarray(block_table([alloc.allocate(3), alloc.allocate(3)], 4))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    kp = write_pages(jnp.zeros((16, page, layout.k_cols)), table, pos, k, pos >= 0)
    vp = write_pages(jnp.zeros((16, page, layout.v_cols)), table, pos, v, pos >= 0)
    for i in range(t):
        lengths = jnp.full((b,), i + 1)
        out = paged_decode_attention(q[:, i], kp, vp, table, lengths, layout)
        np.testing.assert_allclose(out, dense[:, i], rtol=1e-5, atol=1e-5)


def test_invalid_writes_and_writes_to_the_null_page_are_dropped():
    rng = np.random.default_rng()
    pages = jnp.asarray(rng.standard_normal((4, 2, 4)), jnp.float32)
    table = jnp.asarray([[1, 2], [0, 0], [3, 0]])  # row 1 is padding: its table is all null pages
    pos = jnp.asarray([[0, 1, 2], [0, 1, 0], [0, 1, 0]])
    values = jnp.asarray(rng.standard_normal((3, 3, 4)), jnp.float32)
    valid = jnp.asarray([[True, True, False], [True, True, True], [True, True, False]])
    out = np.asarray(write_pages(pages, table, pos, values, valid))
    want = np.array(pages)
    want[1] = values[0, :2]
    want[3] = values[2, :2]
    np.testing.assert_array_equal(out, want)  # page 0 and page 2 (an invalid position) untouched
