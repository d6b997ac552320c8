"""bench/serve_compare.py reads the rate a method sustains within a latency bound off its swept curve: between the
rates where the curve crosses the bound, linearly, and never past a rate that already broke it."""

import math

import numpy as np
import pytest

serve_compare = pytest.importorskip("serve_compare")


def test_crossing_is_interpolated_between_the_swept_rates():
    rate, tokens, capped = serve_compare.sustained([1, 2, 4], [50.0, 90.0, 130.0], [100.0, 200.0, 300.0], 110.0)
    assert rate == pytest.approx(3.0) and tokens == pytest.approx(250.0) and not capped


def test_a_curve_within_the_bound_is_a_lower_bound_and_one_above_it_sustains_nothing():
    assert serve_compare.sustained([1, 2], [10.0, 20.0], [5.0, 9.0], 100.0) == (2, 9.0, True)
    rate, tokens, capped = serve_compare.sustained([1, 2], [150.0, 160.0], [5.0, 9.0], 100.0)
    assert math.isnan(rate) and math.isnan(tokens) and not capped


def test_the_first_crossing_counts_even_if_the_curve_dips_back():
    rate, _, _ = serve_compare.sustained([1, 2, 3, 4], [50.0, 150.0, 60.0, 70.0], [1.0, 2.0, 3.0, 4.0], 100.0)
    assert rate == pytest.approx(1.5)


@pytest.mark.parametrize("seed", range(20))
def test_the_sustained_rate_lies_where_the_curve_meets_the_bound(seed):
    rng = np.random.default_rng(seed)
    rates = np.cumsum(rng.uniform(0.5, 2.0, 6))
    latency = np.cumsum(rng.uniform(1.0, 30.0, 6))  # rising
    bound = rng.uniform(latency[0], latency[-1])
    rate, _, capped = serve_compare.sustained(list(rates), list(latency), list(rates * 100), bound)
    assert not capped and rates[0] <= rate <= rates[-1]
    assert np.interp(rate, rates, latency) == pytest.approx(bound)


def test_tables_compare_methods_at_equal_latency_and_rate():
    def run(label, rates, p99, tokens, p50):
        return dict(
            label=label,
            runs=[
                dict(
                    rate=r,
                    summary=dict(
                        tbt_p99_ms=a,
                        output_tokens_per_s=t,
                        tbt_p50_ms=m,
                        ttft_p50_s=0.5,
                        ttft_p99_s=1.0,
                        normalized_latency_s_per_token=0.01,
                    ),
                )
                for r, a, t, m in zip(rates, p99, tokens, p50)
            ],
        )

    runs = [
        run("none", [1, 2], [80.0, 120.0], [100.0, 180.0], [10.0, 12.0]),
        run("zack", [1, 2], [60.0, 90.0], [110.0, 210.0], [8.0, 6.0]),
    ]
    rows = serve_compare.at_equal_latency(runs, "p99 TBT", [100.0], ["none"])
    zack = next(r for r in rows if r["method"] == "zack")
    assert zack["capped"] and zack["rate"] == 2
    assert zack["rate_vs_none"] == pytest.approx(2 / 1.5)
    gains = serve_compare.at_equal_rate(runs, "none")
    assert [g["tbt_p50_gain"] for g in gains] == pytest.approx([10 / 8, 12 / 6])


def test_ratios_of_a_sweep_that_never_crossed_its_bound_are_bounds_themselves():
    row = {"method": "zack", "metric": "p99 TBT", "bound": 100.0, "capped": True, "rate_vs_none": 2.0}
    base = {"method": "none", "metric": "p99 TBT", "bound": 100.0, "capped": False, "rate_vs_zack": 0.5}
    capped = {(r["method"], r["metric"], r["bound"]): r["capped"] for r in (row, base)}
    assert serve_compare._ratio(row, "none", "rate", capped) == ">= 2.00x"
    assert serve_compare._ratio(base, "zack", "rate", capped) == "<= 0.50x"
    both = dict.fromkeys(capped, True)
    assert serve_compare._ratio(row, "none", "rate", both) == "~2.00x"
    assert serve_compare._ratio(row, "palu", "rate", capped) == ""
