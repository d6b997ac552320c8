"""ZipCache's round trip (``kvjax.ops.zipcache``): saliency is normalized attention from the probe queries, the top
tokens by it get high bits, keys are ranged per channel and precision class (or channel-separably per token) and
values channel-separably per token, each sequence on its own; ``token_bytes`` counts exactly the stored arrays.

Compiles dominate the run time on CPU, so tests share a few shapes and specs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_seed

from kvjax.layout import HeadLayout
from kvjax.ops import quant, zipcache
from kvjax.ops.prefill.reference import causal_attention

MIXED = HeadLayout(4, 2, 64, (32, 16), (16, 48))  # group 2, heads of mixed K and V widths
T = 37  # a multiple of nothing
_bound = jax.jit(quant.bound, static_argnums=(1, 2))  # one compile a shape, not one an op


def _heads(widths):
    starts = HeadLayout.offsets(widths)
    return [(a, a + w) for a, w in zip(starts, widths)]


def _inputs(rng, layout, b, t, scales=None):
    """Random Q, K, V [b, t, cols] float32 with outlier channels, no entry zero; sequence i scaled by scales[i]."""
    scales = np.ones(b) if scales is None else np.asarray(scales, float)

    def draw(cols):
        x = rng.standard_normal((b, t, cols)) * rng.uniform(0.2, 3.0, cols)
        x = np.where(x == 0, 0.5, x) * scales[:, None, None]
        return jnp.asarray(x, jnp.float32)

    return draw(layout.q_cols), draw(layout.k_cols), draw(layout.v_cols)


def _brute_saliency(q, k, layout, probes):
    """Normalized attention by plain loops: for each probe query t and query head of KV head h, the causal softmax
    over keys j <= t (inside the window), summed over the group and the probes, over the probes that see j."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, t, _ = k.shape
    g, win = layout.group_size, layout.sliding_window
    out = np.zeros((b, layout.num_kv_heads, t))
    for h, (kw, ka) in enumerate(zip(layout.k_widths, HeadLayout.offsets(layout.k_widths))):
        qa = HeadLayout.offsets(layout.k_widths, g)[h]
        for s in range(b):
            total, count = np.zeros(t), np.zeros(t)
            for p in probes:
                keys = [j for j in range(t) if j <= p and (win is None or p - j < win)]
                for j in keys:
                    count[j] += 1
                for i in range(g):
                    qv = q[s, p, qa + i * kw : qa + (i + 1) * kw]
                    logits = np.array([qv @ k[s, j, ka : ka + kw] for j in keys]) / math.sqrt(layout.head_dim)
                    e = np.exp(logits - logits.max())
                    for j, w in zip(keys, e / e.sum()):
                        total[j] += w
            out[s, h] = np.where(count > 0, total / np.maximum(count, 1), 0)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_saliency_is_normalized_attention_summed_over_the_group(window):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout = HeadLayout(4, 2, 32, (16, 32), (16, 16), window)
    q, k, _ = _inputs(rng, layout, 2, 9)
    got = np.asarray(zipcache.full_saliency(q, k, layout))
    np.testing.assert_allclose(got, _brute_saliency(q, k, layout, range(9)), rtol=1e-5, atol=1e-6, err_msg=seed)
    probes = np.sort(rng.choice(9, 4, replace=False))
    got = np.asarray(zipcache.saliency(q, k, layout, zipcache.ZipSpec(), probes=probes))
    np.testing.assert_allclose(got, _brute_saliency(q, k, layout, probes), rtol=1e-5, atol=1e-6, err_msg=seed)


def test_probes_are_the_recent_tokens_and_distinct_random_earlier_ones():
    seed = fresh_seed()
    spec = zipcache.ZipSpec(seed=seed)
    p = zipcache.probe_positions(1000, spec)
    assert len(p) == 100 and len(set(p.tolist())) == 100, seed
    assert set(range(950, 1000)) <= set(p.tolist()) and (p[:-50] < 950).all(), seed  # 5% recent, 5% earlier
    np.testing.assert_array_equal(p, zipcache.probe_positions(1000, spec), err_msg=seed)
    assert zipcache.probe_positions(7, spec).tolist() == [6], seed  # the last token at least, no random one under 20
    q, k, _ = _inputs(np.random.default_rng(seed), MIXED, 1, T)
    np.testing.assert_array_equal(
        np.asarray(zipcache.saliency(q, k, MIXED, spec)),
        np.asarray(zipcache.saliency(q, k, MIXED, spec, probes=zipcache.probe_positions(T, spec))),
        err_msg=seed,
    )


def _channel_sep(x, widths, bits):
    """Channel-separable token-wise round trip of one sequence x [t, cols], independently of the module."""
    x = np.asarray(x, np.float32)
    norm = np.sqrt(np.abs(x).max(axis=0)).astype(np.float16).astype(np.float32)
    out = np.zeros_like(x)
    for a, b in _heads(widths):
        codes, scale, zero = quant.quantize(jnp.asarray(x[:, a:b] / norm[a:b]), bits, axis=-1)
        out[:, a:b] = np.asarray(quant.dequantize(codes, scale, zero)) * norm[a:b]
    return out


def _channel_wise(x, widths, bits):
    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for a, b in _heads(widths):
        out[:, a:b] = np.asarray(quant.dequantize(*quant.quantize(jnp.asarray(x[:, a:b]), bits, axis=0)))
    return out


def test_all_salient_is_a_plain_high_bit_quantization_per_sequence():
    """salient = 1: every token at high bits, each sequence quantized as if alone (the second one 100 times
    larger: pooling the ranges over the batch, as the reference does, would fail this). Keys channel-wise, values
    channel-separably (separable keys take the values' path: ``test_mixed_widths_...`` bounds them)."""
    seed = fresh_seed()
    layout = HeadLayout(2, 1, 32, (32,), (16,))
    spec = zipcache.ZipSpec(salient=1.0)
    q, k, v = _inputs(np.random.default_rng(seed), layout, 2, 21, scales=[1.0, 100.0])
    parts = zipcache.encode(q, k, v, layout, spec)
    assert parts["k_codes_low"].shape[1] == 0 and bool(np.unpackbits(np.asarray(parts["map"]))[:21].all()), seed
    k_hat, v_hat = zipcache.round_trip(q, k, v, layout, spec)
    for s in range(2):  # a float32 rounding or two (jit may fuse a multiply-add), far under a code's step
        want = _channel_wise(k[s], layout.k_widths, 4)
        np.testing.assert_allclose(k_hat[s], want, rtol=1e-6, atol=1e-6 * float(np.abs(k[s]).max()), err_msg=seed)
        want = _channel_sep(v[s], layout.v_widths, 4)
        np.testing.assert_allclose(v_hat[s], want, rtol=1e-6, atol=1e-6 * float(np.abs(v[s]).max()), err_msg=seed)


def test_the_salient_tokens_are_the_top_ones_by_saliency():
    seed = fresh_seed()
    spec = zipcache.ZipSpec()
    q, k, v = _inputs(np.random.default_rng(seed), MIXED, 2, T)
    scores = np.asarray(zipcache.saliency(q, k, MIXED, spec))
    bits = np.unpackbits(np.asarray(zipcache.encode(q, k, v, MIXED, spec)["map"]), axis=-1)[..., :T].astype(bool)
    n = zipcache.salient_count(T, spec)
    assert n == T - math.floor(0.4 * T)
    for s in range(2):
        for h in range(MIXED.num_kv_heads):
            assert bits[s, h].sum() == n, seed
            assert scores[s, h][bits[s, h]].min() >= scores[s, h][~bits[s, h]].max(), seed
    ties = jnp.asarray([[[1.0, 2.0, 2.0, 2.0, 0.0]]])
    assert np.asarray(zipcache.salient_mask(ties, zipcache.ZipSpec(salient=0.4)))[0, 0].tolist() == [0, 1, 1, 0, 0]


@pytest.fixture(scope="module", params=zipcache.KEY_SCHEMES)
def mixed_case(request):
    """Two sequences over MIXED, bits (4, 2), their spec, parts and round trip."""
    seed = fresh_seed()
    spec = zipcache.ZipSpec(keys=request.param, key_group=8)  # paged keys: groups of 8, the last one partial
    q, k, v = _inputs(np.random.default_rng(seed), MIXED, 2, T, scales=[1.0, 7.0])
    parts = zipcache.encode(q, k, v, MIXED, spec)
    return seed, spec, (q, k, v), parts, zipcache.decode(parts, MIXED, spec)


def test_mixed_widths_round_trip_within_each_tokens_bound(mixed_case):
    """Each entry within ``quant.bound`` of its own range: a salient token's at high bits, another's at low bits
    (channel keys: the range of the token's class per channel; paged keys: of its group of ``key_group`` tokens of
    its class, in order; the rest: the token's, before the normalizer)."""
    seed, spec, (q, k, v), parts, (k_hat, v_hat) = mixed_case
    assert k_hat.shape == k.shape and v_hat.shape == v.shape and k_hat.dtype == jnp.float32, seed
    mask = np.asarray(zipcache.salient_mask(zipcache.saliency(q, k, MIXED, spec), spec))
    for x, x_hat, widths, channel in (
        (k, k_hat, MIXED.k_widths, spec.ranged),
        (v, v_hat, MIXED.v_widths, False),
    ):
        x, x_hat = np.asarray(x), np.asarray(x_hat)
        for s in range(2):
            norm = np.ones(x.shape[-1]) if channel else np.sqrt(np.abs(x[s]).max(0)).astype(np.float16)
            norm = norm.astype(np.float32)
            for h, (a, b) in enumerate(_heads(widths)):
                for salient, bits in ((True, spec.high_bits), (False, spec.low_bits)):
                    rows = np.flatnonzero(mask[s, h] == salient)
                    group = spec.key_group if channel and spec.keys == "paged" else len(rows)
                    for at in range(0, len(rows), max(group, 1)):
                        some = rows[at : at + group]
                        part = jnp.asarray(x[s, some, a:b] / norm[a:b])
                        limit = np.asarray(_bound(part, bits, axis=0 if channel else -1)) * norm[a:b] * (1 + 1e-5)
                        err = np.abs(x_hat[s, some, a:b] - x[s, some, a:b])
                        assert (err <= limit).all(), (seed, spec.keys, s, h, salient, float((err - limit).max()))


def test_token_bytes_counts_the_arrays_of_one_sequence(mixed_case):
    seed, spec, _, parts, _ = mixed_case
    counted = zipcache.token_bytes(MIXED, spec, T)
    assert set(counted) == set(parts), seed
    for name, x in parts.items():
        assert x[0].nbytes / T == pytest.approx(counted[name], rel=1e-12), (seed, name)


def test_paged_keys_follow_a_drifting_cache_that_one_range_a_class_cannot():
    """Keys whose channels drift over 512 positions (as rotated keys do): ranging every 32 tokens of a class cuts
    the low class's key error against one range a class, for two more float16 rows a group; and parts encoded
    under one key scheme are refused by another."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout, t = HeadLayout(2, 1, 64, (64,), (64,)), 512
    q, k, v = _inputs(rng, layout, 1, t)
    k = k + jnp.asarray(np.sin(np.arange(t)[:, None] / 40.0 + rng.uniform(0, 6, 64)) * 4.0, jnp.float32)[None]
    errs = {}
    for keys in ("channel", "paged"):
        spec = zipcache.ZipSpec(keys=keys)
        parts = zipcache.encode(q, k, v, layout, spec)
        errs[keys] = float(jnp.mean(jnp.abs(zipcache.decode(parts, layout, spec)[0] - k)))
        other = zipcache.ZipSpec(keys="channel" if keys == "paged" else "paged")
        with pytest.raises(ValueError, match="not encoded with this spec"):
            zipcache.decode(parts, layout, other)
    assert errs["paged"] < 0.7 * errs["channel"], (seed, errs)


def test_token_bytes_for_smollm2_heads():
    """3 KV heads of 64, 1024 tokens: 615 tokens at 4 bits, 409 at 2; channel keys' two ranges per channel and
    the values' normalizers amortised; values' scale and zero per token and head; 3 map bits a token."""
    got = zipcache.token_bytes(HeadLayout.uniform(9, 3, 64), zipcache.ZipSpec(), 1024)
    want = 2 * (615 * 96 + 409 * 48) / 1024 + 2 * 768 / 1024 + 12 + 384 / 1024 + 3 * 128 / 1024
    assert sum(got.values()) == pytest.approx(want) == pytest.approx(167.90625)


def test_salient_tokens_cut_the_attention_error_on_planted_heavy_hitters():
    """A few tokens per sequence draw most of the attention and carry large values: ZipCache (1/8 of the tokens at
    4 bits, 2 bits else) beats uniform 2-bit token-wise quantization, and the same bits given to random tokens."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    layout, b, t = HeadLayout.uniform(4, 2, 32), 2, 64
    q = 0.5 * rng.standard_normal((b, t, layout.q_cols))
    k, v = rng.standard_normal((b, t, layout.k_cols)), rng.standard_normal((b, t, layout.v_cols))
    planted = [np.sort(rng.choice(t - 8, 3, replace=False)) for _ in range(b)]
    for h, (a, e) in enumerate(_heads(layout.k_widths)):
        u = rng.standard_normal(e - a)
        u /= np.linalg.norm(u)
        for i in range(layout.group_size):  # every query of the group leans toward u, the planted keys lie along it
            qa = HeadLayout.offsets(layout.k_widths, layout.group_size)[h] + i * (e - a)
            q[:, :, qa : qa + e - a] += 3 * u
        for s in range(b):
            k[s, planted[s], a:e] = 8 * u + 0.3 * rng.standard_normal((3, e - a))
            v[s, planted[s], a:e] *= 5
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    attend = jax.jit(lambda k_, v_: causal_attention(q, k_, v_, layout))  # one compile for the four calls
    exact = attend(k, v)

    def error(k_hat, v_hat):
        return float(jnp.linalg.norm(attend(k_hat, v_hat) - exact) / jnp.linalg.norm(exact))

    spec = zipcache.ZipSpec(salient=0.125)
    scores = zipcache.saliency(q, k, layout, spec)
    mask = np.asarray(zipcache.salient_mask(scores, spec))
    assert all(mask[s, :, planted[s]].all() for s in range(b)), seed
    zip_err = error(*zipcache.round_trip(q, k, v, layout, spec, scores=scores))
    random_err = error(*zipcache.round_trip(q, k, v, layout, spec, scores=jnp.asarray(rng.random(scores.shape))))

    @functools.partial(jax.jit, static_argnums=1)
    def uniform(x, widths):
        heads = [quant.quantize(x[..., a:e], 2, axis=-1) for a, e in _heads(widths)]
        return jnp.concatenate([quant.dequantize(*part) for part in heads], axis=-1)

    uniform_err = error(uniform(k, layout.k_widths), uniform(v, layout.v_widths))
    assert zip_err < 0.5 * min(uniform_err, random_err), (seed, zip_err, uniform_err, random_err)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(high_bits=3),
        dict(low_bits=8),
        dict(high_bits=2, low_bits=4),
        dict(high_bits=4, low_bits=4),
        dict(salient=1.5),
        dict(salient=-0.1),
        dict(salient=float("nan")),
        dict(salient=True),
        dict(probe_recent=0.0),
        dict(probe_recent=1.2),
        dict(probe_random=1.0),
        dict(probe_random=-0.01),
        dict(probe_recent=0.6, probe_random=0.5),
        dict(seed=-1),
        dict(seed=1.5),
        dict(keys="tokenwise"),
        dict(key_group=0),
        dict(key_group=2.5),
        dict(key_group=True),
    ],
)
def test_bad_specs_raise_one_line_value_errors(kwargs):
    with pytest.raises(ValueError) as err:
        zipcache.ZipSpec(**kwargs)
    assert "\n" not in str(err.value) and str(err.value), kwargs


def test_bad_arguments_raise_one_line_value_errors():
    q = k = jnp.ones((1, 4, 16))
    layout = HeadLayout(1, 1, 16, (16,), (16,))
    for call in (
        lambda: zipcache.token_bytes(layout, zipcache.ZipSpec(), 0),
        lambda: zipcache.saliency(q, k, layout, zipcache.ZipSpec(), probes=[4]),
        lambda: zipcache.probe_positions(0, zipcache.ZipSpec()),
    ):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)
