"""Q/K and V get their own column budgets (``RankPlan.for_column_budgets``, ``for_target_rate(k_share=)``): each
kind's heads share a removal rate of their own, so neither kind is ranked against the other's singular values."""

import json
import os

import numpy as np
import pytest
from conftest import FIXTURES

from kvjax.compression.plan import ALIGN, RankPlan


def spectra(rng, layers=3, heads=2, d=64, scale=1.0):
    s = np.sort(rng.gamma(0.5, scale, (layers, heads, d)), axis=-1)[..., ::-1]
    return s.copy()


@pytest.mark.parametrize("seed", range(12))
def test_budgets_are_kept_and_nearly_spent(seed):
    rng = np.random.default_rng(seed)
    s_qk, s_v = spectra(rng), spectra(rng, scale=rng.uniform(0.01, 100))  # V on another scale entirely
    cells = s_qk[..., 0].size
    k_cols, v_cols = (int(rng.integers(ALIGN * cells, 64 * cells)) for _ in range(2))
    plan = RankPlan.for_column_budgets("zack", s_qk, s_v, k_cols, v_cols)
    assert plan.k_qk.sum() <= k_cols and plan.k_v.sum() <= v_cols
    assert plan.k_qk.min() >= ALIGN and plan.k_v.min() >= ALIGN and plan.k_qk.max() <= 64
    # nearly spent: one more 16-column step for every head would overshoot (or every head is already full)
    for widths, budget in ((plan.k_qk, k_cols), (plan.k_v, v_cols)):
        assert widths.sum() + ALIGN * widths.size > budget or widths.min() == 64


@pytest.mark.parametrize("seed", range(8))
def test_a_share_reaches_the_rate_and_does_not_depend_on_the_other_kinds_scale(seed):
    rng = np.random.default_rng(seed)
    s_qk, s_v = spectra(rng), spectra(rng)
    p, share = rng.uniform(0.2, 0.7), rng.uniform(0.3, 0.7)
    plan = RankPlan.for_target_rate("zack", s_qk, s_v, p, k_share=share)
    assert plan.rate >= p - 1e-12 and plan.k_share == pytest.approx(share, abs=0.01)
    scaled = RankPlan.for_target_rate("zack", s_qk, s_v * 1e3, p, k_share=share)
    np.testing.assert_array_equal(scaled.k_qk, plan.k_qk)  # V's scale moves no Q/K column
    np.testing.assert_array_equal(scaled.k_v, plan.k_v)


def test_the_share_is_saved_with_the_plan_and_old_plans_load_without_it():
    rng = np.random.default_rng(0)
    plan = RankPlan.for_target_rate("palu", spectra(rng), spectra(rng), 0.5, k_share=0.4)
    again = RankPlan.from_json(plan.to_json())
    assert again.k_share == plan.k_share and (again.k_qk == plan.k_qk).all()
    old = json.loads(plan.to_json())
    del old["k_share"]
    assert RankPlan.from_json(json.dumps(old)).k_share is None
    assert "Q/K share of the kept columns 0.4" in plan.summary()


@pytest.mark.parametrize("share", [0.0, 1.0, -0.5, 2.0])
def test_a_share_outside_zero_one_is_refused(share):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="k_share"):
        RankPlan.for_target_rate("zack", spectra(rng), spectra(rng), 0.5, k_share=share)


def test_a_budget_below_the_narrowest_heads_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="v_cols"):
        RankPlan.for_column_budgets("zack", spectra(rng), spectra(rng), 1000, ALIGN * 6 - 1)


@pytest.mark.parametrize(
    "share,expected", [(None, (32, 32)), (0.5, (32, 32)), (0.25, (16, 48)), (0.75, (48, 16)), (0.1, (16, 48))]
)
def test_a_uniform_plan_splits_its_budget_by_the_share(share, expected):
    """By default evenly (one rate for K and V, the ZACK paper's ZACK/AC), whatever the two spectra's scales."""
    rng = np.random.default_rng(0)
    plan = RankPlan.for_target_rate("zack", spectra(rng), spectra(rng, scale=100.0), 0.5, adaptive=False, k_share=share)
    assert (int(plan.k_qk[0, 0]), int(plan.k_v[0, 0])) == expected and (plan.k_qk == plan.k_qk[0, 0]).all()


@pytest.fixture(scope="module")
def wide():
    from test_compression import WIDE

    import kvjax

    return kvjax.Model.random(WIDE["mistral"], seed=5, scale=5.0)


def test_compress_records_a_given_share_and_measures_one(wide, monkeypatch):
    import kvjax
    from kvjax.compression import split

    given = kvjax.compress(
        wide, target_rate=0.5, k_share=0.4, calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    assert given.plan.rate >= 0.5 and given.plan.k_share == pytest.approx(0.4, abs=0.02)
    seen = []
    real = split.best_share

    def spy(score, shares=split.SHARES):
        share, tried = real(score, shares)
        seen.append((share, tried))
        return share, tried

    monkeypatch.setattr("kvjax.compression.pipeline.best_share", spy)
    measured = kvjax.compress(
        wide, target_rate=0.5, k_share="measured", calibration="random", num_tokens=256, seq_len=64, progress=False
    )
    ((share, tried),) = seen
    assert len(tried) == 7 and share == min(tried, key=lambda t: t[1])[0]  # five shares, then the best's neighbours
    assert measured.plan.k_share == pytest.approx(share, abs=0.02) and measured.plan.rate >= 0.5


@pytest.mark.parametrize(
    "kwargs",
    [dict(target_rate=0.5, k_share=1.0), dict(target_rate=0.5, k_share="best"), dict(removal_rate=0.1, k_share=0.5)],
)
def test_compress_refuses_a_bad_share_before_calibrating(wide, kwargs):
    import kvjax

    with pytest.raises(ValueError, match="k_share"):
        kvjax.compress(wide, **kwargs)


def test_best_share_refines_around_the_coarse_minimum():
    from kvjax.compression.split import best_share

    share, tried = best_share(lambda f: (f - 0.63) ** 2)
    assert share == pytest.approx(0.65) and [t for t, _ in tried] == [0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7]


def test_converter_takes_a_share(tmp_path):
    from kvjax.cli import convert

    for bad in (["--k-share", "1.5"], ["--k-share", "x"], ["--removal-rate", "0.2", "--k-share", "0.5"]):
        argv = [os.path.join(FIXTURES, "falcon_new"), str(tmp_path / "o"), *bad]
        if "--removal-rate" not in bad:
            argv += ["--target-rate", "0.5"]
        with pytest.raises(SystemExit):
            convert.main(argv)
    assert not os.listdir(tmp_path)
