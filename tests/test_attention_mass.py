"""ops.attention_mass (the full-history eviction metrics' kernel) against the jnp form of eviction.metrics.scores."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eviction import metrics
from kvjax.layout import HeadLayout
from kvjax.ops.attention_mass import attention_mass

GPU = jax.default_backend() == "gpu"


def case(seed, layout, batch, length, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, length, layout.q_cols)) * 1.5, dtype)
    k = jnp.asarray(rng.standard_normal((batch, length, layout.k_cols)), dtype)
    return q, k


@pytest.mark.parametrize("length", [1, 16, 77])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("method", metrics.ON_KERNEL)
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_the_interpreted_kernel_equals_the_jnp_sums(length, window, method, blocks):
    # heads of three widths (one not a multiple of 16), a group of 3, blocks that do not divide the prompt
    layout = HeadLayout(9, 3, 64, (48, 24, 48), (32, 64, 16), window)
    seed = int(np.random.default_rng().integers(1 << 30))
    q, k = case(seed, layout, 2, length, jnp.float32)
    block_q, block_k = blocks  # rows and keys a step: unmasked steps left of and below the diagonal, masked on it
    gumbel = (seed, 3, 0.7) if method == "keyformer" else None  # a seed, a layer and a temperature
    got = attention_mass(
        q,
        k,
        layout,
        squared=method == "kvcompress-full",
        gumbel=gumbel,
        interpret=True,
        block_q=block_q,
        block_k=block_k,
    )
    want = metrics.scores(method, q, k, layout, kernel=False, seed=seed, layer=3, tau=0.7)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6, err_msg=f"seed {seed}")


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("method", metrics.ON_KERNEL)
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_a_chunk_through_the_kernel_equals_its_jnp_share(window, method, blocks):
    """The engine's form: each row's chunk of queries from its own position, keys past the chunk holding anything
    finite (large here), rows past its length padding; the kernel equals ``metrics.chunk_mass``'s jnp sums."""
    layout = HeadLayout(9, 3, 64, (48, 24, 48), (32, 64, 16), window)
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    t, s = 37, 112  # chunk rows (padded) and key slots (the rows' pages)
    starts = np.array([0, 19, 64, 5])
    lengths = np.array([37, 30, 37, 1])  # a whole chunk, a part, one from position 64, one row
    q = jnp.asarray(rng.standard_normal((4, t, layout.q_cols)) * 1.5, jnp.float32)
    k = rng.standard_normal((4, s, layout.k_cols))
    for b in range(4):
        k[b, starts[b] + lengths[b] :] *= 1e3  # what no real row may see
    k = jnp.asarray(k, jnp.float32)
    block_q, block_k = blocks
    got = attention_mass(
        q,
        k,
        layout,
        starts=jnp.asarray(starts, jnp.int32),
        lengths=jnp.asarray(lengths, jnp.int32),
        squared=method == "kvcompress-full",
        gumbel=(seed, 11, 1.5) if method == "keyformer" else None,
        interpret=True,
        block_q=block_q,
        block_k=block_k,
    )
    want = metrics.chunk_mass(method, q, k, starts, lengths, layout, kernel=False, seed=seed, layer=11, tau=1.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6, err_msg=f"seed {seed}")
    for b in range(4):  # nothing reaches past a chunk's last real row
        assert not np.asarray(got)[b, :, starts[b] + lengths[b] :].any()


@pytest.mark.parametrize("method", ["h2o", "kvcompress-full"])
@pytest.mark.parametrize(
    "layout",
    [HeadLayout(8, 2, 64, (48, 16), (16, 64)), HeadLayout(3, 3, 32, (32, 16, 32), (16, 32, 16), sliding_window=10)],
    ids=["group-2", "window-10"],
)
def test_the_prefill_kernels_denominators_stand_in_for_the_first_pass(layout, method):
    """The engine's reuse: a chunk after a prefix through the prefill kernel with ``lse=True`` gives each row's log2
    softmax denominator over every key it sees (brute force), and the mass kernel given them equals its own two
    passes and ``metrics.chunk_mass``'s jnp sums. Keyformer's noisy softmax refuses them."""
    from kvjax.ops.grouped import head_logits, visible
    from kvjax.ops.paging import write_pages
    from kvjax.ops.prefill.kernel import prefill_attention

    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    b, s, t, page = 2, 80, 40, 16
    starts, lengths = np.array([0, 29]), np.array([37, 40])
    whole = [jnp.asarray(rng.standard_normal((b, s, c)) * 1.5, jnp.float32) for c in (layout.q_cols, layout.k_cols)]
    v_all = jnp.asarray(rng.standard_normal((b, s, layout.v_cols)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, b * s // page + 1)).reshape(b, -1), jnp.int32)
    pages = [jnp.asarray(rng.standard_normal((b * s // page + 1, page, c)), jnp.float32) for c in (layout.k_cols,
             layout.v_cols)]  # fmt: skip
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    before = jnp.asarray(positions < starts[:, None])  # the prefix, written by earlier chunks
    kp, vp = (write_pages(p, table, positions, x, before) for p, x in zip(pages, (whole[1], v_all)))
    rows = jnp.asarray(np.clip(starts[:, None] + np.arange(t), 0, s - 1))
    q, k, v = (jnp.take_along_axis(x, rows[..., None], axis=1) for x in (*whole, v_all))
    starts_j, lengths_j = jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    _, kp, _, lse = prefill_attention(q, k, v, layout, lengths_j, kp, vp, table, starts_j, interpret=True, lse=True)
    keys = kp[table].reshape(b, s, layout.k_cols)
    for g in range(layout.num_kv_heads):  # brute-force denominators of every real row
        logits = np.asarray(head_logits(q, keys, layout, g), np.float64)  # [B, group, T, S]
        seen = np.asarray(visible(starts[:, None, None] + np.arange(t)[None, :, None], np.arange(s)[None, None, :],
                                  layout.sliding_window))  # fmt: skip
        want = np.log2(np.where(seen[:, None], np.exp(logits), 0.0).sum(-1))  # [B, group, T]
        got = np.asarray(lse)[:, :, g * layout.group_size : (g + 1) * layout.group_size].transpose(0, 2, 1)
        for r in range(b):
            np.testing.assert_allclose(got[r, :, : lengths[r]], want[r, :, : lengths[r]], atol=2e-5, err_msg=f"{seed}")
    squared = method == "kvcompress-full"
    kw = dict(starts=starts_j, lengths=lengths_j, squared=squared, interpret=True, block_q=16, block_k=16)
    reused = attention_mass(q, keys, layout, lse=lse, **kw)
    np.testing.assert_allclose(np.asarray(reused), np.asarray(attention_mass(q, keys, layout, **kw)), rtol=2e-5,
                               atol=2e-6, err_msg=f"seed {seed}")  # fmt: skip
    want = metrics.chunk_mass(method, q, keys, starts, lengths, layout, kernel=False)
    np.testing.assert_allclose(np.asarray(reused), np.asarray(want), rtol=2e-5, atol=2e-6, err_msg=f"seed {seed}")
    with pytest.raises(ValueError, match="noisy scores"):
        attention_mass(q, keys, layout, lse=lse, gumbel=(1, 2, 0.5), **kw)


def test_a_whole_prompt_needs_one_length():
    layout = HeadLayout(4, 2, 32, (32, 16), (32, 32))
    q, k = case(1, layout, 1, 20, jnp.float32)
    with pytest.raises(ValueError, match="one length"):
        attention_mass(q, k[:, :10], layout, interpret=True)


def test_each_query_row_gives_its_whole_softmax():
    """Plain mass summed over a head's keys is the rows times the group: every row's weights sum to 1."""
    layout = HeadLayout(4, 2, 32, (32, 16), (32, 32), 9)
    q, k = case(int(np.random.default_rng().integers(1 << 30)), layout, 3, 50, jnp.float32)
    got = attention_mass(q, k, layout, interpret=True, block_q=16, block_k=16)
    np.testing.assert_allclose(np.asarray(got).sum(axis=-1), 50 * 2, rtol=1e-5)
    assert (np.asarray(attention_mass(q, k, layout, squared=True, interpret=True, block_q=16, block_k=16)) <= got).all()


def test_scores_take_the_kernel_where_asked():
    layout = HeadLayout(4, 2, 32, (16, 32), (32, 32))
    q, k = case(int(np.random.default_rng().integers(1 << 30)), layout, 1, 40, jnp.float32)
    for method in metrics.ON_KERNEL:
        got = metrics.scores(method, q, k, layout, kernel=True)
        want = metrics.scores(method, q, k, layout, kernel=False)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("window", [None, 300])
def test_the_kernel_on_the_gpu(dtype, window):
    layout = dataclasses.replace(
        HeadLayout(32, 8, 128, (64, 32, 48, 128, 16, 80, 64, 96), (64,) * 8), sliding_window=window
    )
    q, k = case(int(np.random.default_rng().integers(1 << 30)), layout, 2, 1000, dtype)
    for method in metrics.ON_KERNEL:
        got = np.asarray(metrics.scores(method, q, k, layout, kernel=True))
        with jax.default_matmul_precision("highest"):  # the GPU's default float32 dot is TF32: 1e-3 relative
            want = np.asarray(
                metrics.scores(method, q.astype(jnp.float32), k.astype(jnp.float32), layout, kernel=False)
            )
        tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), method


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("method", metrics.ON_KERNEL)
def test_a_chunk_through_the_kernel_on_the_gpu(method):
    """The engine's form on the GPU: 2,048-row chunks of 8 KV heads at ZACK-like widths, rows at different starts."""
    layout = HeadLayout(32, 8, 128, (64, 32, 48, 128, 16, 80, 64, 96), (64,) * 8)
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 512, layout.q_cols)) * 1.5, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 1536, layout.k_cols)), jnp.bfloat16)
    starts, lengths = np.array([0, 1024]), np.array([512, 300])
    kw = dict(tau=0.8, seed=seed, layer=5)
    got = np.asarray(metrics.chunk_mass(method, q, k, starts, lengths, layout, kernel=True, **kw))
    with jax.default_matmul_precision("highest"):
        q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
        want = np.asarray(metrics.chunk_mass(method, q32, k32, starts, lengths, layout, kernel=False, **kw))
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max(), f"{method}, seed {seed}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_the_prefill_kernels_denominators_on_the_gpu():
    """The engine's reuse on the GPU in bfloat16: a 512-row chunk after 1,024 keys at ZACK-like widths through the
    prefill kernel with ``lse=True``, then the mass pass alone, against both of the mass kernel's own passes."""
    from kvjax.ops.prefill.kernel import prefill_attention

    layout = HeadLayout(32, 8, 128, (64, 32, 48, 128, 16, 80, 64, 96), (64,) * 8)
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    b, s, t, page = 2, 1536, 512, 16
    starts, lengths = jnp.asarray([0, 1024], jnp.int32), jnp.asarray([512, 300], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, layout.q_cols)) * 1.5, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, t, layout.k_cols)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, t, layout.v_cols)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(np.arange(1, b * s // page + 1)).reshape(b, -1), jnp.int32)
    kp = jnp.asarray(rng.standard_normal((b * s // page + 1, page, layout.k_cols)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((b * s // page + 1, page, layout.v_cols)), jnp.bfloat16)
    _, kp, _, lse = prefill_attention(q, k, v, layout, lengths, kp, vp, table, starts, lse=True)
    keys = kp[table].reshape(b, s, layout.k_cols)
    for squared in (False, True):
        kw = dict(starts=starts, lengths=lengths, squared=squared)
        got = np.asarray(attention_mass(q, keys, layout, lse=lse, **kw))
        want = np.asarray(attention_mass(q, keys, layout, **kw))
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max(), f"squared {squared}, seed {seed}"


def test_both_passes_lower_to_triton_for_an_h100():
    """Lowered to Triton IR for sm_90 (no GPU here: what XLA would compile): two kernels a power-of-two tile of the
    K widths (16; 48 and 64 share 64), each with its products on the tensor cores."""
    from kvjax.ops.lowering import triton_modules

    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64), 100)
    q = jnp.ones((1, 200, layout.q_cols), jnp.bfloat16)
    k = jnp.ones((1, 200, layout.k_cols), jnp.bfloat16)
    modules = triton_modules(lambda q, k: attention_mass(q, k, layout, squared=True), (q, k))
    assert len(modules) == 4 and all("tt.dot" in m for m in modules)
    assert sum("@kvjax_attention_lse" in m for m in modules) == 2


def test_prefill_with_denominators_and_the_mass_pass_alone_lower_to_triton_for_an_h100():
    """The engine's reuse lowered for sm_90: the prefill kernel with its extra store, and the mass kernel's second
    pass alone (no ``kvjax_attention_lse``)."""
    from kvjax.ops.lowering import triton_modules
    from kvjax.ops.prefill.kernel import prefill_attention

    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))
    q = jnp.ones((1, 128, layout.q_cols), jnp.bfloat16)
    k = jnp.ones((1, 128, layout.k_cols), jnp.bfloat16)

    def both(q, k):
        _, lse = prefill_attention(q, k, k[..., : layout.v_cols], layout, lse=True)
        return attention_mass(q, k, layout, lse=lse)

    modules = triton_modules(both, (q, k))
    assert sum("@kvjax_prefill_attention" in m for m in modules) == 1
    assert sum("@kvjax_attention_mass" in m for m in modules) == 2 and not any("attention_lse" in m for m in modules)


def test_keyformers_chunk_lowers_to_triton_for_an_h100():
    """The chunk form with Keyformer's noise (integer hashing, logical shifts, two logs a score) lowers too."""
    from kvjax.ops.lowering import triton_modules

    layout = HeadLayout(8, 4, 64, (16, 48, 16, 64), (32, 16, 32, 64))
    q = jnp.ones((2, 64, layout.q_cols), jnp.bfloat16)
    k = jnp.ones((2, 200, layout.k_cols), jnp.bfloat16)
    starts, lengths = jnp.array([0, 100], jnp.int32), jnp.array([64, 30], jnp.int32)

    def run(q, k):
        return attention_mass(q, k, layout, starts=starts, lengths=lengths, gumbel=(5, 3, 1.0))

    modules = triton_modules(run, (q, k))
    assert len(modules) == 4 and all("tt.dot" in m for m in modules)
    assert all("arith.shrui" in m and "tt.extern_elementwise" in m for m in modules)  # the logs: libdevice
