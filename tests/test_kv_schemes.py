"""Schemes of serving K/V for teacher-forced scoring (``kvjax.ops.kv_schemes``): KIVI-style pages count the bytes
the engine allocates, GEAR's extra terms cost bytes and buy accuracy, names parse or fail in one line."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

from kvjax.layout import HeadLayout
from kvjax.models.model import Model
from kvjax.ops import gear, kv_schemes
from kvjax.ops.quant import PageFormat
from kvjax.runtime.cache import token_bytes

LAYOUT = HeadLayout(4, 2, 64, (32, 16), (16, 48))


@pytest.mark.parametrize("bits,page", [(4, 32), (2, 16)])
def test_kivi_counts_what_the_engine_allocates(bits, page):
    scheme = kv_schemes.parse(str(bits), page)
    fmt = PageFormat.for_layout(LAYOUT, page, bits)
    assert sum(scheme.page_bytes(LAYOUT).values()) == fmt.page_bytes
    assert kv_schemes.token_bytes(scheme, [LAYOUT]) == token_bytes((LAYOUT,), jnp.float32, (fmt,))
    assert kv_schemes.parse(f"kivi{bits}", page) == scheme and scheme.name == f"kivi{bits}"


def test_gear_spends_more_bytes_for_less_error():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(1, 64, LAYOUT.k_cols)) * 3, jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 64, LAYOUT.v_cols)), jnp.float32)
    kivi, geared = kv_schemes.parse("2"), kv_schemes.parse("gear2")
    assert geared == kv_schemes.Gear(gear.GearSpec.paper(2)) and geared.page_size == kivi.page_size == 32
    err = {}
    for name, scheme in (("kivi", kivi), ("gear", geared)):
        kq, vq = scheme.round_trip(None, k, v, LAYOUT)
        err[name] = float(jnp.linalg.norm(kq - k) + jnp.linalg.norm(vq - v))
    assert err["gear"] < err["kivi"], f"seed {seed}: {err}"
    assert sum(geared.page_bytes(LAYOUT).values()) > sum(kivi.page_bytes(LAYOUT).values())


def test_model_hidden_takes_a_scheme():
    model = Model.random(TINY_CONFIGS["llama"], seed=0, scale=2.0)
    ids = np.random.default_rng(fresh_seed()).integers(0, model.config.vocab_size, (1, 40))
    by_scheme = model.hidden(ids, kv=kv_schemes.Kivi(2, 16))
    geared = model.hidden(ids, kv=kv_schemes.Gear(gear.GearSpec(2, 2, 0.02, page_size=16)))
    assert geared.shape == by_scheme.shape and bool(jnp.isfinite(geared).all())
    assert not np.allclose(np.asarray(geared), np.asarray(by_scheme))
    with pytest.raises(TypeError, match="kv must be a kvjax.ops.kv_schemes scheme"):
        model.hidden(ids, kv=2)


def test_zipcache_spends_its_bits_on_salient_tokens():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, 48, LAYOUT.q_cols)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 48, LAYOUT.k_cols)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 48, LAYOUT.v_cols)), jnp.float32)
    scheme = kv_schemes.parse("zipcache")
    kq, vq = scheme.round_trip(q, k, v, LAYOUT)
    assert kq.shape == k.shape and vq.shape == v.shape and bool(jnp.isfinite(kq).all())
    per_token = sum(kv_schemes.token_bytes(scheme, [LAYOUT]).values())
    two, four = (sum(kv_schemes.token_bytes(kv_schemes.Kivi(b), [LAYOUT]).values()) for b in (2, 4))
    assert two < per_token < 1.2 * four, (two, per_token, four)


@pytest.mark.parametrize("bad", ["3", "gear8", "", "zip"])
def test_unknown_names_are_one_line_errors(bad):
    with pytest.raises(ValueError, match="KV scheme must be one of") as err:
        kv_schemes.parse(bad)
    assert "\n" not in str(err.value)


def test_gear_settings_in_a_name_round_trip_and_bad_ones_are_one_line_errors():
    scheme = kv_schemes.parse("gear2-r1-o0.005", 128)
    assert (scheme.spec.bits, scheme.spec.rank, scheme.spec.outliers, scheme.page_size) == (2, 1, 0.005, 128)
    assert scheme.name == "gear2-r1-o0.005-p128" and kv_schemes.parse(scheme.name) == scheme  # the page in the name
    assert kv_schemes.parse("gear2-r1-o0.005-p64", 128).page_size == 64  # the name's page wins
    assert kv_schemes.parse("gear2-r1-o0.005").name == "gear2-r1-o0.005"  # quant.GROUP: no -p
    assert kv_schemes.parse("gear4-r2-o0.02").name == "gear4"  # the reference's settings keep the short name
    cases = (("gear2-r0", "rank"), ("gear2-o0.7", "outliers"), ("gear2-r40", "exceeds"), ("gear2-x1", "must be one"))
    for bad, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            kv_schemes.parse(bad)
        assert "\n" not in str(err.value)


def test_zipcache_key_schemes_by_name():
    """ "zipcache" keeps the reference's channel keys; "-paged" ranges keys a page of a class at a time (the page
    from the caller), "-separable" per token; each name is its own canonical name."""
    for name, keys in (("zipcache", "channel"), ("zipcache-paged", "paged"), ("zipcache-separable", "separable")):
        scheme = kv_schemes.parse(name.upper(), 64)
        assert (scheme.spec.keys, scheme.spec.key_group, scheme.page_size, scheme.name) == (keys, 64, 64, name)
    with pytest.raises(ValueError, match="KV scheme must be one of"):
        kv_schemes.parse("zipcache-tokenwise")
