"""Quantized pages (``kvjax.ops.quant``): packing is lossless, round trips stay within ``bound``, keys get a range
per column over the page and values per token and head, and ``page_bytes`` counts exactly the arrays' bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.ops import quant

widths_st = st.lists(st.sampled_from([16, 32, 48, 64, 128]), min_size=1, max_size=4)


@given(st.sampled_from(quant.BITS), widths_st, st.integers(1, 33), st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_packing_in_planes_is_lossless_and_puts_each_plane_in_its_bits(bits, widths, rows, seed):
    rng = np.random.default_rng(seed)
    w = widths[0]
    codes = rng.integers(0, 1 << bits, (rows, w)).astype(np.uint8)
    packed = quant.pack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (rows, w * bits // 8)
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), codes)
    n, mask = 8 // bits, (1 << bits) - 1
    for i in range(n):  # plane i: columns [i w/n, (i+1) w/n) in bits [i b, (i+1) b)
        got = (np.asarray(packed) >> (bits * i)) & mask
        np.testing.assert_array_equal(got, codes[:, i * w // n : (i + 1) * w // n])


@given(
    st.sampled_from(quant.BITS),
    widths_st,
    st.sampled_from([1, 2, 16, 32]),
    st.floats(1e-3, 1e3),
    st.floats(-50, 50),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=30, deadline=None)
def test_page_round_trips_stay_within_the_bound(bits, widths, tokens, spread, offset, seed):
    """Random pages of every scale and offset, heads of mixed widths, some columns and rows constant."""
    rng = np.random.default_rng(seed)
    cols = sum(widths)
    x = offset + spread * rng.standard_normal((tokens, cols)) * rng.uniform(0.01, 3, cols)  # outlier channels
    x[:, rng.integers(0, cols)] = offset  # a constant column
    x[rng.integers(0, tokens)] = offset + spread  # a constant row
    x = jnp.asarray(x, jnp.float32)
    packed, scale, zero = quant.quantize_keys(x, widths, bits)
    assert packed.shape == (tokens, cols * bits // 8) and scale.shape == zero.shape == (cols,)
    back = quant.dequantize_keys(packed, scale, zero, widths, bits)
    assert bool(jnp.all(jnp.abs(back - x) <= quant.bound(x, bits, axis=0))), seed
    packed, scale, zero = quant.quantize_values(x, widths, bits)
    assert scale.shape == zero.shape == (tokens, len(widths))
    back = quant.dequantize_values(packed, scale, zero, widths, bits)
    heads = np.concatenate([[0], np.cumsum(widths)])
    for a, b in zip(heads[:-1], heads[1:]):
        assert bool(jnp.all(jnp.abs(back[:, a:b] - x[:, a:b]) <= quant.bound(x[:, a:b], bits, axis=-1))), seed


@given(
    st.sampled_from(quant.BITS),
    st.lists(st.tuples(st.sampled_from([16, 32, 48, 128]), st.sampled_from([16, 32, 48, 128])), min_size=1, max_size=4),
    st.sampled_from([8, 16, 32]),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=6, deadline=None)
def test_page_encoding_is_each_pages_quantization(bits, heads, page, seed):
    """``PageFormat.encode`` stores what ``quantize_keys`` and ``quantize_values`` give each page on its own: the
    same codes, scales and zeros, byte for byte."""
    rng = np.random.default_rng(seed)
    kw, vw = (tuple(w) for w in zip(*heads))
    fmt = quant.PageFormat(kw, vw, page, bits)
    k = jnp.asarray(rng.standard_normal((2, page, fmt.k_cols)) * rng.uniform(0.1, 4, fmt.k_cols), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, page, fmt.v_cols)), jnp.bfloat16)
    k = k.at[0, :, 0].set(1.5)  # a constant column: a zero scale
    parts = jax.jit(lambda k, v: fmt.parts(fmt.encode(k, v)))(k, v)
    kp, ks, kz = jax.jit(jax.vmap(lambda x: quant.quantize_keys(x, kw, bits)))(k)
    vp, vs, vz = jax.jit(jax.vmap(lambda x: quant.quantize_values(x, vw, bits)))(v)
    for got, want in ((parts["k_codes"], kp), (parts["k_scale"], ks), (parts["k_zero"], kz)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(parts["v_scale"]), np.asarray(vs))
    np.testing.assert_array_equal(np.asarray(parts["v_zero"]), np.asarray(vz))
    np.testing.assert_array_equal(np.asarray(parts["v_codes"]), np.asarray(vp), err_msg=f"seed {seed}")


@pytest.mark.parametrize("bits", quant.BITS)
def test_values_code_as_each_heads_own_quantization(bits):
    """``quantize_values`` (every head at once, scales gathered) rounds each code as ``quantize`` on that head alone
    (scales broadcast): GEAR and ZipCache quantize heads one at a time, so their references depend on it."""
    seed = fresh_seed()
    widths = (16, 24, 8)
    v = jnp.asarray(np.random.default_rng(seed).standard_normal((64, 32, sum(widths))) * 3, jnp.bfloat16)
    packed, _, _ = jax.jit(lambda v: quant.quantize_values(v, widths, bits))(v)
    edges = np.cumsum((0, *widths))
    codes = [jax.jit(lambda x: quant.quantize(x, bits, axis=-1)[0])(v[..., a:b]) for a, b in zip(edges, edges[1:])]
    want = quant._packed(jnp.concatenate(codes, -1), widths, bits)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(want), err_msg=f"{seed=}")


def test_keys_are_ranged_per_column_and_values_per_token_and_head():
    """A key column 1000x larger than the others does not coarsen them; nor does one value head another."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    x[:, 5] *= 1000.0
    packed, scale, zero = quant.quantize_keys(jnp.asarray(x), [16, 16], 4)
    err = np.abs(np.asarray(quant.dequantize_keys(packed, scale, zero, [16, 16], 4)) - x)
    assert err[:, np.arange(32) != 5].max() < 0.5 and err[:, 5].max() > 10, seed
    y = x.copy()
    y[:, :16] = rng.standard_normal((32, 16)) * 1000
    y[:, 16:] = rng.standard_normal((32, 16))
    packed, scale, zero = quant.quantize_values(jnp.asarray(y), [16, 16], 4)
    err = np.abs(np.asarray(quant.dequantize_values(packed, scale, zero, [16, 16], 4)) - y)
    assert err[:, 16:].max() < 0.5, seed


@pytest.mark.parametrize("bits", quant.BITS)
def test_page_bytes_counts_every_array(bits):
    k_widths, v_widths, page = [16, 48, 64], [32, 32, 16], 32
    x = jnp.asarray(np.random.default_rng(fresh_seed()).standard_normal((page, 128)), jnp.float32)
    kp, ks, kz = quant.quantize_keys(x, k_widths, bits)
    vp, vs, vz = quant.quantize_values(x[:, :80], v_widths, bits)
    counted = quant.page_bytes(k_widths, v_widths, page, bits)
    assert counted == {
        "k_codes": kp.nbytes,
        "v_codes": vp.nbytes,
        "k_scales": ks.nbytes + kz.nbytes,
        "v_scales": vs.nbytes + vz.nbytes,
    }
    full = page * (128 + 80) * 2  # the same page in bf16
    assert sum(counted.values()) < full * (bits / 16 + 0.1)


@pytest.mark.parametrize("bad", [3, 8, 0, True, 4.0, "4", None])
def test_other_bit_widths_are_one_line_errors(bad):
    with pytest.raises(ValueError, match="quantization bits must be one of 4, 2"):
        quant.check_bits(bad)
    with pytest.raises(ValueError, match="does not split into 2 planes"):
        quant.pack(jnp.zeros((1, 3), jnp.uint8), 4)


@given(
    st.sampled_from(quant.BITS), widths_st, st.sampled_from([1, 16, 32]), st.integers(1, 8), st.integers(0, 2**32 - 1)
)
@settings(max_examples=15, deadline=None)
def test_scores_and_outputs_from_codes_equal_those_of_the_rebuilt_page(bits, widths, tokens, rows, seed):
    """The kernel's arithmetic (scale folded into q or into p, zero as one dot) against dequantize-then-multiply,
    head by head of a page of mixed widths."""
    rng = np.random.default_rng(seed)
    cols = sum(widths)
    k = jnp.asarray(rng.standard_normal((tokens, cols)) * rng.uniform(0.1, 5, cols) + rng.normal(0, 3, cols))
    v = jnp.asarray(rng.standard_normal((tokens, cols)) * 2 + 1)
    kp, ks, kz = quant.quantize_keys(k, widths, bits)
    vp, vs, vz = quant.quantize_values(v, widths, bits)
    k_back = quant.dequantize_keys(kp, ks, kz, widths, bits)
    v_back = quant.dequantize_values(vp, vs, vz, widths, bits)
    heads = np.concatenate([[0], np.cumsum(widths)])
    for h, (a, b) in enumerate(zip(heads[:-1], heads[1:])):
        n = 8 // bits
        q = jnp.asarray(rng.standard_normal((rows, b - a)), jnp.float32)
        scores = quant.head_scores(q, kp[:, a // n : b // n], ks[a:b], kz[a:b], bits)
        np.testing.assert_allclose(
            scores, q @ k_back[:, a:b].T, rtol=1e-4, atol=1e-3 * (1 + float(jnp.abs(scores).max()))
        )
        p = jnp.asarray(rng.dirichlet(np.ones(tokens), rows), jnp.float32)
        out = quant.head_values(p, vp[:, a // n : b // n], vs[:, h], vz[:, h], bits)
        np.testing.assert_allclose(out, p @ v_back[:, a:b], rtol=1e-4, atol=1e-4)
