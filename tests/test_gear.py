"""GEAR pages (``kvjax.ops.gear``): without outliers or low-rank part the round trip is KIVI's
(``quant.simulate``) exactly; outliers are the entries farthest from their quantization group's mean, restored
exactly (float16); the error is no larger than KIVI's and does not grow with the rank; ``page_bytes`` counts the
arrays a page stores; bad specs are one-line ValueErrors; the low-rank decode identity holds.

Configurations share shapes and specs so each test module compiles few programs (the suite runs on a shared CPU)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import gear, quant

MIXED = HeadLayout(4, 2, 64, (32, 16), (16, 48))  # mixed head widths, K and V unlike
SMOLLM2 = HeadLayout(9, 3, 64, (64,) * 3, (64,) * 3)
B, T = 2, 75  # T: not a multiple of 16 or 32
simulate = jax.jit(quant.simulate, static_argnums=2)


def _never_zero(rng, shape):
    x = rng.standard_normal(shape)
    return x + 0.05 * np.sign(x)


def _planted(seed, layout=MIXED, page=32, outliers_per_block=2):
    """K, V [B, T, cols] float32: per head a rank-2 signal over noise, with a channel offset (keys' outlier channels),
    and a few large entries in every page of every head."""
    rng = np.random.default_rng(seed)
    out = []
    for widths in (layout.k_widths, layout.v_widths):
        cols = []
        for w in widths:
            x = 3 * _never_zero(rng, (B, T, 2)) @ _never_zero(rng, (2, w)) / np.sqrt(w) + _never_zero(rng, (B, T, w))
            x += rng.uniform(-4, 4, w)
            for b in range(B):
                for start in range(0, T, page):
                    n = min(page, T - start)
                    rows = start + rng.integers(0, n, outliers_per_block)
                    x[b, rows, rng.integers(0, w, outliers_per_block)] += rng.choice([-1, 1], outliers_per_block) * 25
            cols.append(x)
        out.append(jnp.asarray(np.concatenate(cols, -1), jnp.float32))
    return out


def _page_errors(x_hat, x, page):
    """Frobenius error of each full page (over the batch and every column)."""
    full = x.shape[1] // page * page
    d = (np.asarray(x_hat, np.float64) - np.asarray(x, np.float64))[:, :full]
    return np.sqrt((d.reshape(d.shape[0], -1, page, d.shape[-1]) ** 2).sum(axis=(0, 2, 3)))


@pytest.mark.parametrize("bits, page, dtype", [(4, 16, jnp.bfloat16), (2, 32, jnp.float32)])
def test_without_outliers_or_low_rank_the_round_trip_is_kivis(bits, page, dtype):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = jnp.asarray(_never_zero(rng, (B, T, MIXED.k_cols)) + rng.uniform(-3, 3, MIXED.k_cols), dtype)
    v = jnp.asarray(_never_zero(rng, (B, T, MIXED.v_cols)), dtype)
    spec = gear.GearSpec(bits, 2, 0.0, page)
    k_hat, v_hat = gear.round_trip(k, v, MIXED, spec, low_rank=False)
    k_ref, v_ref = simulate(k, v, quant.PageFormat.for_layout(MIXED, page, bits))
    assert k_hat.dtype == dtype and v_hat.dtype == dtype and k_hat.shape == k.shape and v_hat.shape == v.shape
    np.testing.assert_array_equal(np.asarray(k_hat, np.float32), np.asarray(k_ref, np.float32), err_msg=f"{seed=}")
    np.testing.assert_array_equal(np.asarray(v_hat, np.float32), np.asarray(v_ref, np.float32), err_msg=f"{seed=}")


def test_error_is_no_larger_than_kivis_and_does_not_grow_with_the_rank():
    seed = fresh_seed()
    k, v = _planted(seed)
    kivi = simulate(k, v, quant.PageFormat.for_layout(MIXED, 32, 2))
    errors = []
    for rank in (1, 2, 4):
        got = gear.round_trip(k, v, MIXED, gear.GearSpec(2, rank, 0.03, 32))
        errors.append([_page_errors(g, x, 32) for g, x in zip(got, (k, v))])
    for side, name in enumerate("KV"):
        base = _page_errors(kivi[side], (k, v)[side], 32)
        by_rank = np.stack([e[side] for e in errors])  # [ranks, pages]
        assert np.all(by_rank[0] < base), (seed, name, base, by_rank)
        assert np.all(np.diff(by_rank, axis=0) <= 1e-4 * base), (seed, name, by_rank)
        assert np.all(by_rank[-1] < 0.8 * base), (seed, name, base, by_rank)  # the planted outliers and structure


def _deviation(block, keys):
    """Distance of each entry of a head's page block [P, w] from its quantization group's mean."""
    return np.abs(block - block.mean(axis=0 if keys else 1, keepdims=True))


def test_outliers_are_the_entries_farthest_from_their_group_mean_and_come_back_exactly():
    seed = fresh_seed()
    k, v = _planted(seed)
    spec = gear.GearSpec(2, 2, 0.03, 32)
    k_hat, v_hat = gear.round_trip(k, v, MIXED, spec)
    for side, (x, x_hat, widths) in enumerate(((k, k_hat, MIXED.k_widths), (v, v_hat, MIXED.v_widths))):
        name, keys = "kv"[side], side == 0
        starts = HeadLayout.offsets(widths)
        for b in range(B):
            for page in range(T // 32):
                rows = slice(page * 32, (page + 1) * 32)
                parts = gear.page_parts(k[b, rows], v[b, rows], MIXED, spec)
                values, index = parts[f"{name}_outliers"], parts[f"{name}_outlier_index"]
                groups = sorted(set(widths))
                assert len(values) == len(index) == len(groups), seed
                for w, vals, idx in zip(groups, values, index):
                    heads = [h for h, hw in enumerate(widths) if hw == w]
                    n = math.floor(0.03 * 32 * w)
                    assert idx.shape == vals.shape == (len(heads), n) and vals.dtype == jnp.float16, seed
                    for i, h in enumerate(heads):
                        block = np.asarray(x[b, rows, starts[h] : starts[h] + w])
                        pos = np.asarray(idx[i]).astype(np.int64)
                        assert len(set(pos.tolist())) == n, (seed, name, h)
                        dev = _deviation(block.astype(np.float64), keys).ravel()
                        kept = np.zeros(dev.size, bool)
                        kept[pos] = True
                        at = (seed, name, b, page, h)
                        assert dev[kept].min() >= dev[~kept].max() * (1 - 1e-5), at  # the n farthest
                        planted = dev > 12  # the +-25 entries planted in every page and head
                        assert planted.any() and kept[planted].all(), at
                        exact = block.ravel()[pos].astype(np.float16)
                        np.testing.assert_array_equal(np.asarray(vals[i]), exact, err_msg=str(at))
                        got = np.asarray(x_hat[b, rows, starts[h] : starts[h] + w]).ravel()[pos]
                        np.testing.assert_array_equal(got, exact.astype(np.float32), err_msg=str(at))


@pytest.mark.parametrize(
    "layout, spec",
    [
        (SMOLLM2, gear.GearSpec.paper(4)),
        (SMOLLM2, gear.GearSpec.paper(2)),
        (MIXED, gear.GearSpec(4, 3, 0.1, 16, iterations=2)),
        (MIXED, gear.GearSpec(2, 16, 0.0, 32)),
    ],
)
def test_page_bytes_counts_every_array_a_page_stores(layout, spec):
    k = jax.ShapeDtypeStruct((spec.page_size, layout.k_cols), jnp.float32)
    v = jax.ShapeDtypeStruct((spec.page_size, layout.v_cols), jnp.float32)
    parts = jax.eval_shape(functools.partial(gear.page_parts, layout=layout, spec=spec), k, v)
    sizes = gear.page_bytes(layout, spec)
    assert set(parts) == set(sizes)
    for name, arrays in parts.items():
        assert sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays) == sizes[name], (name, layout, spec)
    p, r = spec.page_size, spec.rank
    n = [spec.outlier_count(w) for w in layout.k_widths + layout.v_widths]
    index = [(p * w - 1).bit_length() for w in layout.k_widths + layout.v_widths]
    assert all(i == gear.index_bits(p, w) for i, w in zip(index, layout.k_widths + layout.v_widths))
    expected = (
        sum(quant.page_bytes(layout.k_widths, layout.v_widths, p, spec.bits).values())
        + sum(2 * (p + w) * r for w in layout.k_widths + layout.v_widths)
        + sum(c * (2 + (1 if i <= 8 else 2)) for c, i in zip(n, index))
    )
    assert sum(sizes.values()) == expected
    if layout == SMOLLM2:  # 3 heads of 64, page 32, rank 2, 2%: 40 outliers a head, 11-bit positions in 2 bytes
        assert n == [40] * 6 and index == [11] * 6
        kivi = {4: 7296, 2: 4224}[spec.bits]
        assert sum(sizes.values()) == kivi + 2 * 3 * (32 + 64) * 2 * 2 + 2 * 3 * 40 * 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bits=3, rank=2, outliers=0.02),
        dict(bits=4, rank=0, outliers=0.02),
        dict(bits=4, rank=2.0, outliers=0.02),
        dict(bits=4, rank=2, outliers=-0.01),
        dict(bits=4, rank=2, outliers=0.5),
        dict(bits=4, rank=2, outliers=True),
        dict(bits=4, rank=2, outliers=float("nan")),
        dict(bits=4, rank=2, outliers=0.02, page_size=0),
        dict(bits=4, rank=2, outliers=0.02, iterations=0),
        dict(bits=4, rank=40, outliers=0.02, page_size=32),
    ],
)
def test_bad_specs_are_one_line_value_errors(kwargs):
    with pytest.raises(ValueError) as err:
        gear.GearSpec(**kwargs)
    assert "\n" not in str(err.value) and str(err.value)


@pytest.mark.parametrize(
    "layout, spec",
    [
        (MIXED, gear.GearSpec(4, 32, 0.0, 32)),  # rank past the 16-wide heads
        (HeadLayout(1, 1, 64, (18,), (16,)), gear.GearSpec(2, 2, 0.0)),  # 18 columns: no whole planes of 4 codes
    ],
)
def test_layouts_a_spec_cannot_serve_are_one_line_value_errors(layout, spec):
    k, v = jnp.ones((1, 32, layout.k_cols)), jnp.ones((1, 32, layout.v_cols))
    with pytest.raises(ValueError) as err:
        gear.page_bytes(layout, spec)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        gear.round_trip(k, v, layout, spec)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="columns"):
        gear.round_trip(jnp.ones((1, 32, 3)), v, MIXED, gear.GearSpec(4, 2, 0.0))


def test_low_rank_scores_without_rebuilding_the_keys():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q = jnp.asarray(_never_zero(rng, (3, 5, 48)), jnp.float32)
    a = jnp.asarray(_never_zero(rng, (3, 32, 4)), jnp.float16)
    b = jnp.asarray(_never_zero(rng, (3, 48, 4)), jnp.float16)
    got = gear.scores_low_rank(q, a, b)
    dense = np.asarray(a, np.float64) @ np.swapaxes(np.asarray(b, np.float64), -1, -2)  # A B^T: [3, 32, 48]
    want = np.asarray(q, np.float64) @ np.swapaxes(dense, -1, -2)
    assert got.shape == (3, 5, 32) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4, err_msg=f"{seed=}")


@pytest.mark.parametrize("spec", [gear.GearSpec(2, 1, 0.01, 32), gear.GearSpec(4, 2, 0.0, 16)])
def test_engine_pages_decode_to_the_round_trip_exactly(spec):
    """``GearPageFormat``: a page is every array ``page_parts`` lists as bytes, each part aligned, and ``decode``
    gives exactly ``round_trip``'s reconstruction of the same pages (the engine then serves what accuracy.py scores)."""
    seed = fresh_seed()
    k, v = _planted(seed)
    fmt = gear.GearPageFormat.for_layout(MIXED, spec)
    sizes = gear.page_bytes(MIXED, spec)
    assert fmt.sizes() == sizes and sum(fmt.bytes_by_part().values()) == fmt.page_bytes
    assert 0 <= fmt.page_bytes - sum(sizes.values()) < len(sizes) * quant.ALIGN and fmt.page_bytes % quant.ALIGN == 0
    t = T // spec.page_size * spec.page_size  # whole pages
    k, v = k[:, :t], v[:, :t]
    pages = jax.jit(fmt.encode)(
        k.reshape(B, -1, spec.page_size, MIXED.k_cols), v.reshape(B, -1, spec.page_size, MIXED.v_cols)
    )
    assert pages.dtype == jnp.uint8 and pages.shape == (B, t // spec.page_size, fmt.page_bytes)
    k_hat, v_hat = jax.jit(fmt.decode)(pages)
    k_ref, v_ref = gear.round_trip(k, v, MIXED, spec)
    np.testing.assert_array_equal(np.asarray(k_hat).reshape(k.shape), np.asarray(k_ref), err_msg=f"{seed=}")
    np.testing.assert_array_equal(np.asarray(v_hat).reshape(v.shape), np.asarray(v_ref), err_msg=f"{seed=}")
    with pytest.raises(ValueError, match="exceeds the narrowest head"):
        gear.GearPageFormat(MIXED.k_widths, MIXED.v_widths, gear.GearSpec(2, 20, 0.01, 32))
