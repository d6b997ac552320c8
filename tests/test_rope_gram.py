"""ZACK's Q/K basis for any served positions: post-RoPE Grams derived exactly from pre-RoPE ones
(``kvjax.compression.positions``), and ``max_context`` through compress, the plan, checkpoints and generate."""

import dataclasses
import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed

import kvjax
from kvjax.compression import RankPlan, calibrate, calibration_tokens, make_plan
from kvjax.compression.positions import post_rope_gram
from kvjax.models.rope import apply_rope, inverse_frequencies

SCALINGS = {
    "default": {},
    "llama3": dict(TINY_CONFIGS["llama3_tied"].rope),
    "linear": {"rope_type": "linear", "factor": 4.0},
}
WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)


def rope64(x, pos, inv_freq):
    """``apply_rope`` (rotate-half) in float64 on the host: rows ``x`` [n, d] all at position ``pos``."""
    angles = np.concatenate([pos * inv_freq, pos * inv_freq])
    h = x.shape[-1] // 2
    return x * np.cos(angles) + np.concatenate([-x[:, h:], x[:, :h]], axis=-1) * np.sin(angles)


def test_host_rope_is_the_models_rope():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 64)) + 0.1
    inv_freq = inverse_frequencies(64, 1e4, SCALINGS["llama3"])
    for pos in (0, 5, 300):
        ours = rope64(x, pos, inv_freq)
        theirs = apply_rope(jnp.asarray(x[None, :, None], jnp.float32), jnp.full((1, 3), pos), inv_freq)
        tol = 1e-6 * (1 + pos) * np.abs(x).max()  # the model's angles are float32
        np.testing.assert_allclose(ours, np.asarray(theirs)[0, :, 0], atol=tol, err_msg=f"seed {seed}, pos {pos}")


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("d", [8, 64])
def test_matches_the_empirical_gram_of_rows_at_every_position(d, n, scaling):
    """The same rows X placed at every position 0..n-1: their post-RoPE Gram / n is post_rope_gram(X^T X)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rng.integers(1, 2 * d), d)) * rng.uniform(0.1, 10, size=d) + rng.normal(size=d)
    inv_freq = inverse_frequencies(d, float(rng.choice([1e4, 5e5])), SCALINGS[scaling])
    empirical = sum(r.T @ r for r in (rope64(x, pos, inv_freq) for pos in range(n))) / n
    got = post_rope_gram(x.T @ x, inv_freq, n)
    err = np.abs(got - empirical).max() / np.abs(empirical).max()
    assert err < 1e-10, f"seed {seed}: relative error {err:.3g}"


def test_one_position_is_the_identity_and_the_result_is_symmetric_psd():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(3, 2, 200, 128)) + rng.uniform(-1, 1, size=128)
    gram = np.swapaxes(x, -1, -2) @ x  # [L, Hkv, d, d]
    inv_freq = inverse_frequencies(128, 5e5, SCALINGS["llama3"])
    tol = 1e-14 * np.abs(gram).max()
    np.testing.assert_allclose(post_rope_gram(gram, inv_freq, 1), gram, rtol=0, atol=tol, err_msg=f"seed {seed}")
    for n in (2, 1000, 131072):
        out = post_rope_gram(gram, inv_freq, n)
        assert out.shape == gram.shape and out.dtype == np.float64
        np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2), err_msg=f"seed {seed}, n {n}")
        lam = np.linalg.eigvalsh(out)
        assert lam.min() >= -1e-12 * lam.max(), f"seed {seed}, n {n}: eigenvalue {lam.min():.3g}"
        np.testing.assert_allclose(np.trace(out, axis1=-2, axis2=-1), np.trace(gram, axis1=-2, axis2=-1), rtol=1e-12)


def test_bad_input_is_refused():
    gram, inv_freq = np.eye(8), inverse_frequencies(8, 1e4, {})
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_context must be positive"):
            post_rope_gram(gram, inv_freq, bad)
    with pytest.raises(TypeError, match="max_context must be an integer"):
        post_rope_gram(gram, inv_freq, 2.5)
    with pytest.raises(ValueError, match="d even"):
        post_rope_gram(np.eye(7), inv_freq, 4)
    with pytest.raises(ValueError, match="inv_freq must have shape"):
        post_rope_gram(gram, inv_freq[:3], 4)
    with pytest.raises(ValueError, match="finite"):
        post_rope_gram(gram * np.nan, inv_freq, 4)


def test_calibration_gathers_the_pre_rope_query_gram():
    """Layer 0's q_pre Gram equals the outer products of q rows (before RoPE) computed straight from the weights."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000)
    tokens = calibration_tokens(model, "random", num_tokens=40, seq_len=16, seed=seed)
    stats = calibrate(model, tokens, batch_size=2, progress=False)
    block = model.module.layers[0]
    x = block.attn_norm(jnp.take(model.module.embed[...], tokens[tokens >= 0], axis=0))
    q = np.asarray(block.attn.project(x)[0], np.float64).reshape(40, 2, -1, 64)  # [T, Hkv, G, d]
    want = np.einsum("tgnd,tgne->gde", q, q)
    np.testing.assert_allclose(stats.grams["q_pre"][0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert set(stats.grams) == {"q", "q_pre", "k", "k_pre", "v"}
    with pytest.raises(ValueError, match="'qk' basis only"):
        stats.basis("v", model, max_context=64)
    with pytest.raises(ValueError, match="max_context applies to method='zack'"):
        make_plan(model, stats, target_rate=0.5, method="palu", max_context=64)
    with pytest.raises(ValueError, match="max_context must be positive"):
        make_plan(model, stats, target_rate=0.5, max_context=0)
    del stats.grams["q_pre"]
    with pytest.raises(ValueError, match="no pre-RoPE query Gram"):
        stats.basis("qk", model, max_context=64)


def test_max_context_through_compress_save_load_and_generate(tmp_path):
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    with pytest.raises(ValueError, match="max_context must be positive"):
        kvjax.compress(model, target_rate=0.5, max_context=0)
    small = kvjax.compress(
        model, target_rate=0.5, calibration="random", num_tokens=256, seq_len=64, max_context=128, progress=False
    )
    assert small.plan.max_context == 128 and small.plan.rate >= 0.5
    assert "positions 0..127 (max_context)" in small.plan.summary()
    full = kvjax.compress(
        model, removal_rate=0.0, calibration="random", num_tokens=256, seq_len=64, max_context=200, progress=False
    )
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(1, 24))
    want = np.asarray(model.logits(tokens))  # full rank: the rotation is orthogonal, the logits stay (float32)
    np.testing.assert_allclose(full.logits(tokens), want, atol=1e-4 * np.abs(want).max(), err_msg=f"seed {seed}")

    small.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32")
    assert back.plan.max_context == 128 and back.plan.to_json() == small.plan.to_json()
    old = json.loads(small.plan.to_json())
    del old["max_context"]  # a plan written before the field existed
    assert RankPlan.from_json(json.dumps(old)).max_context is None
    (tmp_path / "ckpt" / "plan.json").write_text(json.dumps(old))
    assert kvjax.load(str(tmp_path / "ckpt"), dtype="float32").plan.max_context is None
    os.remove(tmp_path / "ckpt" / "plan.json")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvjax.generate(small, [[3, 1, 4, 1, 5]] * 2, max_new_tokens=8)  # within max_context: no warning
    long_prompt = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=120).tolist()
    with pytest.warns(UserWarning, match=r"prompt 1 needs 130 positions .*max_context=128"):
        out = kvjax.generate(small, [[3, 1, 4], long_prompt], max_new_tokens=10)
    assert len(out[1].tokens) >= 1


def test_compress_covers_the_models_context_by_default():
    """By default ZACK's Q/K basis is the one for every position the model serves (its context length), recorded in
    the plan; None asks for the positions calibration saw; Palu (a pre-RoPE basis) records none. kvjax-convert takes
    the same three, and kvjax-serve warns once when it serves past a plan's positions."""
    from types import SimpleNamespace

    from kvjax.cli import options
    from kvjax.cli.serve import positions_warning

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    kw = dict(target_rate=0.5, calibration="random", num_tokens=256, seq_len=64, seed=seed % 1000, progress=False)
    default = kvjax.compress(model, **kw)
    context = WIDE.max_position_embeddings
    assert default.plan.max_context == context > 64
    assert f"positions 0..{context - 1} (max_context)" in default.plan.summary()
    explicit = kvjax.compress(model, **kw, max_context=context)
    assert explicit.plan.to_json() == default.plan.to_json()
    assert kvjax.compress(model, **kw, max_context=None).plan.max_context is None
    assert kvjax.compress(model, **kw, method="palu").plan.max_context is None
    with pytest.raises(ValueError, match="max_context applies to method='zack'"):
        kvjax.compress(model, **kw, method="palu", max_context=128)
    with pytest.raises(ValueError, match="max_context must be 'model', a positive integer or None, got 'all'"):
        kvjax.compress(model, **kw, max_context="all")

    assert [options.max_context(t) for t in ("model", "calibration", "64")] == ["model", None, 64]
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError):
            options.max_context(bad)

    engine = SimpleNamespace(max_seq_len=context)
    assert positions_warning(engine, default) is None and positions_warning(engine, model) is None
    small = SimpleNamespace(plan=SimpleNamespace(max_context=64))
    assert "made for positions 0..63 (max_context=64)" in positions_warning(engine, small)
