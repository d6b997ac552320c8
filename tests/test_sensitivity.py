"""Ranks by measured effect (``kvjax.compression.sensitivity``): a probe is the truncated model, the greedy allocation
reaches the rate with the least modelled cost, and ``compress(ranks="measured")`` records it and refuses what it
cannot combine with."""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest
from test_compression import WIDE

import kvjax
from kvjax.compression import calibrate, calibration_tokens, fold
from kvjax.compression.pipeline import make_plan, measure_sensitivity
from kvjax.compression.plan import ALIGN, RankPlan
from kvjax.compression.sensitivity import Sensitivity, allocate, dropped_share, measure


def spectra(rng, layers, heads, d):
    return np.sort(rng.gamma(0.7, 1.0, (layers, heads, d)), axis=-1)[..., ::-1].copy()


def cost(s_qk, s_v, sens, k_qk, k_v):
    """The modelled cost the allocation minimises: per head, KL per unit energy times the energy its width drops."""
    per = sens.per_energy()
    return sum(
        (
            per[i]
            * np.vectorize(lambda layer, head, s=s, w=w: dropped_share(s[layer, head], w[layer, head]))(
                *np.indices(w.shape)
            )
        ).sum()
        for i, (s, w) in enumerate(((s_qk, k_qk), (s_v, k_v)))
    )


def rate(k_qk, k_v, d):
    return 1 - (k_qk.sum() + k_v.sum()) / (2 * k_qk.size * d)


@pytest.mark.parametrize("seed", range(6))
def test_allocation_reaches_the_rate_with_the_least_modelled_cost(seed):
    """Exhaustive over every width assignment of a 1x2-head, d=64 model: no assignment that reaches p costs less."""
    rng = np.random.default_rng(seed)
    d, p = 64, rng.uniform(0.2, 0.7)
    s_qk, s_v = spectra(rng, 1, 2, d), spectra(rng, 1, 2, d)
    sens = Sensitivity(rng.uniform(1e-3, 1, (2, 1, 2)), rng.uniform(0.1, 0.6, (2, 1, 2)), 32)
    k_qk, k_v = allocate(s_qk, s_v, sens, p)
    assert rate(k_qk, k_v, d) >= p - 1e-12
    assert rate(k_qk, k_v, d) - p < ALIGN / (2 * 2 * d)  # one block fewer would miss p
    best = min(
        cost(s_qk, s_v, sens, np.array([w[:2]]), np.array([w[2:]]))
        for w in itertools.product(range(ALIGN, d + 1, ALIGN), repeat=4)
        if rate(np.array(w[:2]), np.array(w[2:]), d) >= p - 1e-12
    )
    assert cost(s_qk, s_v, sens, k_qk, k_v) <= best * (1 + 1e-9) + 1e-15


def test_a_sensitive_head_keeps_more_and_scales_do_not_matter():
    rng = np.random.default_rng(1)
    s = np.tile(spectra(rng, 1, 1, 64), (2, 3, 1))  # six identical heads
    kl = np.full((2, 2, 3), 1e-2)
    kl[1, 0, 2] = 1.0  # one V head moves the outputs 100x more
    sens = Sensitivity(kl, np.full((2, 2, 3), 0.3), 32)
    k_qk, k_v = allocate(s, s, sens, 0.5)
    assert k_v[0, 2] == k_v.max() and k_v[0, 2] > np.delete(k_v.ravel(), 2).max()
    s_qk, s_v = spectra(rng, 2, 3, 64), spectra(rng, 2, 3, 64)  # distinct heads: no ties for rounding to break
    widths = allocate(s_qk, s_v, sens, 0.5)
    again = allocate(s_qk * 1e3, s_v * 1e-3, sens, 0.5)  # the cost is a share of each head's own energy
    np.testing.assert_array_equal(again, widths)


@pytest.mark.parametrize("p", [0.0, 0.74, 0.75, 0.9])
def test_allocation_at_the_edges(p):
    rng = np.random.default_rng(2)
    s_qk, s_v = spectra(rng, 2, 2, 64), spectra(rng, 2, 2, 64)
    sens = Sensitivity(rng.uniform(0.1, 1, (2, 2, 2)), np.full((2, 2, 2), 0.5), 32)
    with pytest.raises(ValueError, match="does not match this model"):
        allocate(s_qk, s_v, Sensitivity(sens.kl[:, :1], sens.dropped[:, :1], 32), 0.5)
    if p > 0.75:
        with pytest.raises(ValueError, match="out of reach"):
            allocate(s_qk, s_v, sens, p)
        return
    k_qk, k_v = allocate(s_qk, s_v, sens, p)
    assert rate(k_qk, k_v, 64) >= p - 1e-12 and min(k_qk.min(), k_v.min()) >= ALIGN
    if p == 0.0:
        assert (k_qk == 64).all() and (k_v == 64).all()


@pytest.fixture(scope="module")
def case():
    model = kvjax.Model.random(WIDE["llama"], seed=3, scale=4.0)
    tokens = calibration_tokens(model, "random", 256, 64, seed=1)
    return model, tokens, calibrate(model, tokens, progress=False)


@pytest.mark.parametrize("method,band", [("zack", None), ("zack", 16), ("palu", None)])
def test_a_probe_is_the_model_truncated_at_that_head(case, method, band):
    """Zeroing a head's basis columns past the probe width (every shape kept) gives the logits of the plan that
    keeps that head at the probe width, for Q/K (ZACK's rotation, banded frames, Palu's latent) and for V."""
    model, tokens, stats = case
    full, bases = make_plan(model, stats, removal_rate=0.0, method=method, band=band, order_heads=False)
    for kind, key, field in (("qk", "k", "k_qk"), ("v", "v", "k_v")):
        layer, head = 1, 1
        cut = dataclasses.replace(bases[key], down=bases[key].down.copy())
        cut.down[layer, head, :, 32:] = 0.0
        probe = fold(model, full, bases | {key: cut}).logits(tokens[:2])
        widths = getattr(full, field).copy()
        widths[layer, head] = 32
        narrow = dataclasses.replace(full, **{field: widths})
        truncated = fold(model, narrow, bases).logits(tokens[:2])
        np.testing.assert_allclose(probe, truncated, rtol=1e-4, atol=1e-4, err_msg=kind)
        assert not np.allclose(probe, model.logits(tokens[:2]), atol=1e-3)  # and the probe did cut something


def test_measure_probes_every_head_once_and_refuses_a_cut_plan(case):
    model, tokens, stats = case
    seen = []

    def score(m):
        seen.append(m)
        return float(len(seen))

    full, bases = make_plan(model, stats, removal_rate=0.0, order_heads=False)
    sens = measure(model, full, bases, score, progress=False)
    layers, heads = full.k_qk.shape
    assert len(seen) == 2 * layers * heads and sens.kl.shape == (2, layers, heads) and sens.probe_width == 32
    np.testing.assert_array_equal(sens.kl.ravel(), np.arange(1, 2 * layers * heads + 1))
    assert ((0 < sens.dropped) & (sens.dropped < 1)).all()
    cut, _ = make_plan(model, stats, target_rate=0.5)
    with pytest.raises(ValueError, match="every direction"):
        measure(model, cut, bases, score, progress=False)
    for width in (0, 8, 64, 40):
        with pytest.raises(ValueError, match="probe width"):
            measure(model, full, bases, score, width=width, progress=False)


def test_measured_ranks_track_real_probes(case):
    """On a real (random-weight) model the probes' KL are positive and the plan meets its rate."""
    model, tokens, stats = case
    sens = measure_sensitivity(model, stats, "random", tokens, progress=False)
    assert (sens.kl > 0).all()
    plan, _ = make_plan(model, stats, target_rate=0.5, sensitivity=sens)
    assert plan.rate >= 0.5 and plan.ranks == "measured" and plan.rate - 0.5 < ALIGN / 64


def test_compress_with_measured_ranks_records_them_and_old_plans_load(case):
    model, _, _ = case
    out = kvjax.compress(
        model, target_rate=0.4, ranks="measured", calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    assert out.plan.ranks == "measured" and out.plan.rate >= 0.4
    assert "measured effect" in out.plan.summary()
    again = RankPlan.from_json(out.plan.to_json())
    assert again.ranks == "measured"
    old = json.loads(out.plan.to_json())
    del old["ranks"]
    assert RankPlan.from_json(json.dumps(old)).ranks is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_rate=0.5, ranks="kl"), "ranks must be one of"),
        (dict(target_rate=0.5, ranks=None), "ranks must be one of"),
        (dict(removal_rate=0.2, ranks="measured"), "ranks='measured' takes a target_rate"),
        (dict(target_rate=0.5, adaptive=False, ranks="measured"), "ranks='measured' takes"),
        (dict(target_rate=0.5, k_share=0.5, ranks="measured"), "ranks='measured' takes"),
    ],
)
def test_compress_refuses_what_measured_ranks_cannot_combine_with(case, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvjax.compress(case[0], calibration="random", num_tokens=256, seq_len=64, progress=False, **kwargs)


def test_a_plan_refuses_an_unknown_rank_rule():
    rng = np.random.default_rng(0)
    s = spectra(rng, 1, 1, 64)
    with pytest.raises(ValueError, match="ranks must be"):
        RankPlan("zack", 64, [[32]], [[32]], s, s, ranks="fisher")


def test_the_converter_saves_measured_ranks(tmp_path, capsys, case):
    """End to end through kvjax-convert on a saved random model of 64-column heads; a model of 16-column heads has
    nothing to cut, and says so as F_p does."""
    from conftest import FIXTURES

    from kvjax.cli import convert

    src = tmp_path / "src"
    case[0].save(str(src))
    out = tmp_path / "out"
    flags = "--target-rate 0.4 --ranks measured --calibration random --num-tokens 128 --seq-len 64".split()
    assert convert.main([str(src), str(out), *flags]) == 0
    assert "measured effect" in capsys.readouterr().out
    plan = kvjax.load(str(out)).plan
    assert plan.ranks == "measured" and plan.rate >= 0.4
    with pytest.raises(SystemExit):
        convert.main([f"{FIXTURES}/falcon_new", str(tmp_path / "narrow"), *flags])
    assert "out of reach" in capsys.readouterr().err


@pytest.mark.parametrize("positions,keep", [(7, True), (64, False), (1000, True)])
def test_kl_to_in_blocks_equals_the_whole_rows_formula(case, positions, keep, monkeypatch):
    """``kl_to`` projects a few positions at a time (memory): its score is the mean KL over every position of the
    whole rows, whatever the block (one that does not divide the rows, one that covers them), whether it keeps the
    base model's log-probs or forms them again for each score."""
    from kvjax.compression import split
    from kvjax.compression.split import kl_to

    if not keep:
        monkeypatch.setattr(split, "KEEP_BYTES", 0)
    model, tokens, stats = case
    rng = np.random.default_rng()
    compressed = fold(model, *make_plan(model, stats, target_rate=float(rng.uniform(0.3, 0.6))))
    rows = tokens[-2:]
    base_logp = jax.nn.log_softmax(model.logits(rows), axis=-1)
    logp = jax.nn.log_softmax(compressed.logits(rows), axis=-1)
    expected = float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())
    got = kl_to(model, tokens, 2, positions=positions)(compressed)
    assert expected > 1e-4 and got == pytest.approx(expected, rel=1e-4)
    assert kl_to(model, tokens, 2, positions=positions)(model) == pytest.approx(0.0, abs=1e-6)


def test_kl_to_releasing_each_models_forward_scores_the_same_and_keeps_none(case):
    """``release=True`` (candidate plans scored once each) drops the scored model's compiled forward and changes
    no score."""
    from kvjax.compression.split import kl_to
    from kvjax.models import model as models

    model, tokens, stats = case
    compressed = fold(model, *make_plan(model, stats, target_rate=0.5))
    kept = kl_to(model, tokens, 2)(compressed)
    assert models._hidden._cache_size() > 0
    assert kl_to(model, tokens, 2, release=True)(compressed) == kept
    assert models._hidden._cache_size() == 0


@pytest.mark.parametrize("positions", [0, -3, 2.5, float("nan"), "128", True])
def test_kl_to_refuses_a_block_that_is_not_a_positive_integer(case, positions):
    from kvjax.compression.split import kl_to

    model, tokens, _ = case
    with pytest.raises((ValueError, TypeError), match="positions"):
        kl_to(model, tokens, 2, positions=positions)
