"""ZACK with a score-aware Q/K pair (``compress(qk_basis="pair")``, ``CalibrationStats.basis("qk-pair")``): queries
projected on A, keys on B, ``A B^T = I``. The pair is the truncation of least expected squared score error (Eckart-
Young on the Grams' square roots), never worse than one shared rotation; at full width the model is the uncompressed
one (plain and banded); the engine on the kernels gives the reference path's tokens (plain, banded, 4-bit pages); the
plan records the pair, saves and loads, and an old plan loads as the shared basis; "measured" keeps the closer of
the two; bad requests are refused before any work."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed, varied_plan_model

import kvjax
from kvjax.compression import RankPlan
from kvjax.compression.calibration import principal_axes, score_pair

WIDE = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
CALIBRATION = dict(calibration="random", num_tokens=256, seq_len=64, progress=False)


def random_gram(rng, d, decay):
    """A PSD Gram [d, d] with eigenvalues decaying by ``decay`` in a random frame."""
    frame, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return frame @ np.diag(decay ** np.arange(d)) @ frame.T


def score_error(q_gram, k_gram, a, b):
    """E[(q (I - A B^T) k^T)^2] for q ~ N(0, q_gram), k ~ N(0, k_gram) independent: tr(Gq M Gk M^T)."""
    m = np.eye(len(q_gram)) - a @ b.T
    return float(np.trace(q_gram @ m @ k_gram @ m.T))


@pytest.mark.parametrize("width", [1, 4, 9, 16])
def test_the_pair_is_the_truncation_of_least_score_error(width):
    """For random Grams: ``A B^T = I`` at full width; the first ``width`` directions' expected squared score error is
    the tail of the squared singular values (the Eckart-Young optimum) and at most one shared orthogonal basis's
    (ZACK's, from the trace-normalised sum), whatever the two Grams' spectra."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    d = 16
    q, k = random_gram(rng, d, 0.7), random_gram(rng, d, 0.8)
    pair = score_pair(q, k)
    a, b = pair.up.T, pair.down
    np.testing.assert_allclose(a @ b.T, np.eye(d), atol=1e-8, err_msg=f"seed {seed}")
    assert np.all(np.diff(pair.s) <= 1e-12)
    got = score_error(q, k, a[:, :width], b[:, :width])
    np.testing.assert_allclose(got, np.sum(pair.s[width:] ** 2), rtol=1e-6, atol=1e-12, err_msg=f"seed {seed}")
    shared, _ = principal_axes(q / np.trace(q) + k / np.trace(k))
    assert got <= score_error(q, k, shared[:, :width], shared[:, :width]) * (1 + 1e-9) + 1e-12, f"seed {seed}"


@pytest.mark.parametrize("band", [None, 16])
def test_a_full_width_pair_is_the_uncompressed_model(band):
    """Removal rate 0 keeps every direction of the pair: ``A B^T = I``, so the logits are the uncompressed model's
    (float32), plain and banded (across band edges)."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    full = kvjax.compress(model, removal_rate=0.0, band=band, qk_basis="pair", seed=seed % 1000, **CALIBRATION)
    assert full.plan.qk_basis == "pair" and full.plan.rate == 0.0
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(2, 3 * 16 + 5))
    want = np.asarray(model.logits(tokens))
    np.testing.assert_allclose(full.logits(tokens), want, atol=2e-4 * np.abs(want).max(), err_msg=f"seed {seed}")


KERNEL_CASES = [(None, None), (None, 4), (16, None)]


@pytest.mark.parametrize(
    "band, kv_bits, backend",
    [(*case, "interpret") for case in KERNEL_CASES]
    + [pytest.param(*case, "pallas", marks=pytest.mark.gpu) for case in KERNEL_CASES],
)
def test_a_pair_on_the_kernels_gives_the_reference_tokens(band, kv_bits, backend):
    """The engine serves a pair model on the kernels (interpret mode; Pallas on a GPU): queries wide or packed on A,
    keys on B; banded, queries turned and projected a band on A; 4-bit pages. Prompts longer than a chunk get the
    reference path's greedy tokens. And a pair is not the shared basis: the two models' logits differ."""
    seed = fresh_seed()
    base = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    model = varied_plan_model(base, band=band, qk_basis="pair")
    prompts = [np.random.default_rng(seed).integers(0, 97, n).tolist() for n in (45, 20, 3)]
    settings = dict(max_new_tokens=8, max_batch=4, page_size=16, chunk_tokens=32, kv_bits=kv_bits)
    ref = kvjax.generate(model, prompts, backend="reference", **settings)
    ker = kvjax.generate(model, prompts, backend=backend, **settings)
    assert [r.tokens for r in ker] == [r.tokens for r in ref], f"seed {seed}"
    shared = varied_plan_model(base, band=band)
    tokens = np.asarray(prompts[0])[None]
    assert np.abs(np.asarray(shared.logits(tokens)) - np.asarray(model.logits(tokens))).max() > 1e-3


def test_a_pair_plan_is_recorded_saved_and_loaded(tmp_path):
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    pair = kvjax.compress(model, target_rate=0.5, qk_basis="pair", seed=seed % 1000, **CALIBRATION)
    shared = kvjax.compress(model, target_rate=0.5, seed=seed % 1000, **CALIBRATION)
    assert pair.plan.qk_basis == "pair" and shared.plan.qk_basis is None
    assert np.array_equal(pair.plan.k_qk, shared.plan.k_qk)  # F_p's widths come from the shared basis's spectrum
    assert "score-aware pair" in pair.plan.summary() and "score-aware" not in shared.plan.summary()
    pair.save(str(tmp_path / "ckpt"))
    back = kvjax.load(str(tmp_path / "ckpt"), dtype="float32")
    assert back.plan.to_json() == pair.plan.to_json() and back.module.layers[0].attn.q_rotation is not None
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(1, 40))
    np.testing.assert_allclose(back.logits(tokens), pair.logits(tokens), rtol=1e-5, atol=1e-5)
    old = json.loads(shared.plan.to_json())
    del old["qk_basis"]  # a plan written before the field existed
    assert RankPlan.from_json(json.dumps(old)).qk_basis is None


def test_measured_keeps_the_basis_closer_to_the_model():
    """``qk_basis="measured"`` folds both and keeps the one of lower KL on the held-in rows: the plan records the
    one whose model equals compressing with it directly."""
    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    settings = dict(target_rate=0.6, seed=seed % 1000, **CALIBRATION)
    chosen = kvjax.compress(model, qk_basis="measured", **settings)
    plan = chosen.plan
    direct = kvjax.compress(model, qk_basis=plan.qk_basis or "shared", qk_widths=plan.qk_widths or "shared", **settings)
    assert chosen.plan.to_json() == direct.plan.to_json()
    tokens = np.random.default_rng(seed).integers(0, WIDE.vocab_size, size=(1, 30))
    np.testing.assert_allclose(chosen.logits(tokens), direct.logits(tokens), rtol=1e-6, atol=1e-6)


def test_measured_scores_rows_as_long_as_the_pick_asks_within_the_models_context(monkeypatch):
    """The pick scores ``PROBE_ROWS`` held-in rows of ``PICK_TOKENS`` (1,024-token rows misranked the two bases on
    SmolLM2), capped at the model's context; sensitivity probes keep their ``PROBE_TOKENS``."""
    from kvjax.compression import pipeline

    lengths = []
    real = pipeline.kl_to
    monkeypatch.setattr(
        pipeline, "kl_to", lambda model, rows, n, **k: lengths.append(rows.shape) or real(model, rows, n, **k)
    )
    model = kvjax.Model.random(WIDE, seed=fresh_seed() % 1000, scale=5.0)
    context = WIDE.max_position_embeddings
    for pick, expected in ((96, 96), (10 * context, context)):
        monkeypatch.setattr(pipeline, "PICK_TOKENS", pick)
        kvjax.compress(model, target_rate=0.6, qk_basis="measured", **CALIBRATION)
        assert lengths.pop() == (pipeline.PROBE_ROWS, expected)
    monkeypatch.setattr(pipeline, "PROBE_TOKENS", 80)
    kvjax.compress(model, target_rate=0.6, ranks="measured", **CALIBRATION)
    assert lengths.pop() == (pipeline.PROBE_ROWS, 80)


def test_a_pair_reads_its_widths_off_the_spectrum_asked_for(monkeypatch):
    """Under F_p a pair's Q/K widths come from the shared basis's spectrum (the directions change, not the widths)
    or, with ``qk_widths="pair"``, from its own singular values; either plan meets the rate, records the rule, and
    saves and loads it; the measured pick weighs all three candidates and returns one of them."""
    from kvjax.compression import calibrate, calibration_tokens, make_plan, pipeline

    seed = fresh_seed() % 1000
    model = kvjax.Model.random(WIDE, seed=seed, scale=5.0)
    tokens = calibration_tokens(model, "random", 256, 64, seed)
    stats = calibrate(model, tokens, progress=False)
    shared, _ = make_plan(model, stats, target_rate=0.5, qk_basis="shared")
    pair, _ = make_plan(model, stats, target_rate=0.5, qk_basis="pair")
    own, bases = make_plan(model, stats, target_rate=0.5, qk_basis="pair", qk_widths="pair", order_heads=False)
    np.testing.assert_array_equal(pair.k_qk, shared.k_qk)
    np.testing.assert_array_equal(own.s_qk, bases["k"].s)
    assert own.rate >= 0.5 and own.qk_widths == "pair" and pair.qk_widths is None
    assert "the pair's own spectrum" in own.summary() and "the shared basis's spectrum" in pair.summary()
    assert RankPlan.from_json(own.to_json()).qk_widths == "pair"
    settings = dict(target_rate=0.5, method="zack", adaptive=True, max_context=None, band=None)
    seen = []
    real = pipeline.make_plan
    monkeypatch.setattr(
        pipeline, "make_plan", lambda *a, **k: seen.append((k["qk_basis"], k["qk_widths"])) or real(*a, **k)
    )
    for widths, expected in ((True, 3), (False, 2)):
        seen.clear()
        pick = pipeline.pick_qk_basis(model, stats, "random", tokens, seed, settings, widths)
        assert len(seen) == expected and pick in seen and len(set(seen)) == expected


def test_measured_ranks_with_a_pair_rank_by_the_pairs_own_spectrum():
    """Ranks by measured effect probe the pair's directions, so the plan's Q/K spectrum is the pair's own."""
    from kvjax.compression import calibrate, calibration_tokens, make_plan
    from kvjax.compression.pipeline import measure_sensitivity

    seed = fresh_seed()
    model = kvjax.Model.random(WIDE, seed=seed % 1000, scale=5.0)
    tokens = calibration_tokens(model, "random", 256, 64, seed % 1000)
    stats = calibrate(model, tokens, progress=False)
    sens = measure_sensitivity(model, stats, "random", tokens, qk_basis="pair", progress=False)
    plan, bases = make_plan(model, stats, target_rate=0.5, sensitivity=sens, qk_basis="pair")
    assert plan.qk_basis == "pair" and plan.ranks == "measured" and plan.rate >= 0.5
    np.testing.assert_array_equal(plan.s_qk, bases["k"].s)
    np.testing.assert_array_equal(bases["k"].s, stats.basis("qk-pair", model).s)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(qk_basis="pairs"), r"qk_basis must be one of \('shared', 'pair', 'measured'\), got 'pairs'"),
        (dict(qk_basis=["pair"]), r"qk_basis must be one of .*, got \['pair'\]"),
        (dict(qk_basis="pair", method="palu"), r"qk_basis='pair' applies to method='zack'"),
        (dict(qk_basis="measured", method="palu"), r"qk_basis='measured' applies to method='zack'"),
        (dict(qk_basis="pair", qk_widths="own"), r"qk_widths must be one of \('shared', 'pair'\), got 'own'"),
        (dict(qk_widths="pair"), r"qk_widths='pair' applies to qk_basis='pair' with adaptive F_p ranks"),
        (dict(qk_basis="measured", qk_widths="pair"), r"qk_basis='measured' picks the widths itself"),
        (dict(qk_basis="pair", qk_widths="pair", adaptive=False), r"qk_widths='pair' applies to qk_basis='pair'"),
        (dict(qk_basis="pair", qk_widths="pair", ranks="measured"), r"qk_widths='pair' applies to qk_basis='pair'"),
    ],
)
def test_bad_qk_bases_are_refused_before_any_work(kwargs, message, monkeypatch):
    import kvjax.compression.pipeline as pipeline

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before refusing")

    monkeypatch.setattr(pipeline, "calibrate", no_calibration)
    model = kvjax.Model.random(WIDE, seed=1)
    with pytest.raises(ValueError, match=message):
        kvjax.compress(model, target_rate=0.5, **CALIBRATION, **kwargs)


def test_a_plan_refuses_an_unknown_qk_basis_a_palu_pair_and_widths_off_no_pair():
    s = np.ones((1, 2, 64))
    widths = np.full((1, 2), 32)
    assert RankPlan("zack", 64, widths, widths, s, s, qk_basis="shared").qk_basis is None
    with pytest.raises(ValueError, match=r"qk_basis must be one of \('shared', 'pair'\), got 'odd'"):
        RankPlan("zack", 64, widths, widths, s, s, qk_basis="odd")
    with pytest.raises(ValueError, match="qk_basis='pair' applies to method='zack'"):
        RankPlan("palu", 64, widths, widths, s, s, qk_basis="pair")
    assert RankPlan("zack", 64, widths, widths, s, s, qk_basis="pair", qk_widths="shared").qk_widths is None
    for bad in (dict(qk_widths="pair"), dict(qk_basis="pair", qk_widths="pair", ranks="measured")):
        with pytest.raises(ValueError, match="qk_widths='pair' applies to a pair's widths under F_p"):
            RankPlan("zack", 64, widths, widths, s, s, **bad)
    with pytest.raises(ValueError, match=r"qk_widths='pair' applies to adaptive plans"):
        RankPlan("zack", 64, widths, widths, s, s, adaptive=False, qk_basis="pair", qk_widths="pair")
    with pytest.raises(ValueError, match=r"qk_widths must be one of \('shared', 'pair'\), got 'odd'"):
        RankPlan("zack", 64, widths, widths, s, s, qk_basis="pair", qk_widths="odd")


def test_the_converter_saves_a_pair(tmp_path, capsys):
    """End to end through kvjax-convert: --qk-basis pair is saved with OUT, said in its summary, and loads."""
    from kvjax.cli import convert

    src = tmp_path / "src"
    kvjax.Model.random(WIDE, seed=fresh_seed() % 1000, scale=5.0).save(str(src))
    out = tmp_path / "out"
    flags = "--target-rate 0.5 --qk-basis pair --calibration random --num-tokens 128 --seq-len 64".split()
    assert convert.main([str(src), str(out), *flags]) == 0
    assert "score-aware pair" in capsys.readouterr().out
    assert kvjax.load(str(out)).plan.qk_basis == "pair"
    assert kvjax.load(str(out)).plan.qk_widths is None  # the shared spectrum's widths


def test_the_converter_saves_a_pair_with_its_own_widths(tmp_path, capsys):
    """--qk-widths pair reaches the plan: saved with OUT, said in its summary."""
    from kvjax.cli import convert

    src = tmp_path / "src"
    kvjax.Model.random(WIDE, seed=fresh_seed() % 1000, scale=5.0).save(str(src))
    out = tmp_path / "out"
    flags = "--target-rate 0.5 --qk-basis pair --qk-widths pair --calibration random --num-tokens 128 --seq-len 64"
    assert convert.main([str(src), str(out), *flags.split()]) == 0
    assert "the pair's own" in capsys.readouterr().out
    plan = kvjax.load(str(out)).plan
    assert plan.qk_basis == "pair" and plan.qk_widths == "pair"
