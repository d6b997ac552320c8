"""Methods compared at equal latency from bench/serve.py's JSONs (one per method): for each latency bound, the
highest request rate a method sustains within it (linear between the swept rates where its latency crosses the
bound) and the throughput it reaches there, as the ZACK paper's Fig. 15 reads them; and, at each rate every method
ran, the ratio of their p50 TBT and TTFT to a baseline's."""

from __future__ import annotations

import argparse
import math
import sys

from bench.files import write_json
from bench.plot_serve import load

METRICS = {  # name -> (summary key, scale to the unit shown, unit)
    "p99 TBT": ("tbt_p99_ms", 1.0, "ms"),
    "p50 TBT": ("tbt_p50_ms", 1.0, "ms"),
    "s/token": ("normalized_latency_s_per_token", 1.0, "s"),
}


def sustained(rates, latency, values, bound: float) -> tuple[float, float, bool]:
    """(rate, value at that rate, capped): the highest rate whose ``latency`` is within ``bound``, following the
    curve from the lowest rate to where it first crosses the bound (linear between swept rates), and ``values``
    (a throughput) interpolated there; capped is True when the curve never crosses it (the rate is then a lower
    bound: the sweep's highest); (nan, nan, False) when even the lowest rate exceeds it."""
    if not len(rates) or latency[0] > bound:
        return math.nan, math.nan, False
    for i in range(1, len(rates)):
        if latency[i] > bound:
            f = (bound - latency[i - 1]) / (latency[i] - latency[i - 1])
            return (
                rates[i - 1] + f * (rates[i] - rates[i - 1]),
                values[i - 1] + f * (values[i] - values[i - 1]),
                False,
            )
    return rates[-1], values[-1], True


def curve(data: dict, key: str) -> tuple[list[float], list[float]]:
    """(rates, summary[key]) of one method's sweep, rates ascending."""
    runs = sorted(data["runs"], key=lambda r: r["rate"])
    return [r["rate"] for r in runs], [r["summary"][key] for r in runs]


def at_equal_latency(runs: list[dict], metric: str, bounds: list[float], baselines: list[str]) -> list[dict]:
    """Per bound and method: the sustained rate, output tokens/s there, and their ratios to each baseline."""
    key, scale, _ = METRICS[metric]
    rows = []
    for bound in bounds:
        found = {}
        for data in runs:
            rates, latency = curve(data, key)
            _, tokens = curve(data, "output_tokens_per_s")
            found[data["label"]] = sustained(rates, [x * scale for x in latency], tokens, bound)
        for label, (rate, tokens, capped) in found.items():
            row = dict(metric=metric, bound=bound, method=label, rate=rate, tokens_per_s=tokens, capped=capped)
            for base in baselines:
                if base in found and base != label:
                    row[f"rate_vs_{base}"] = rate / found[base][0] if found[base][0] > 0 else math.nan
                    row[f"tokens_vs_{base}"] = tokens / found[base][1] if found[base][1] > 0 else math.nan
            rows.append(row)
    return rows


def at_equal_rate(runs: list[dict], baseline: str) -> list[dict]:
    """At every rate both ran: each method's p50 TBT and TTFT against the baseline's (baseline / method: > 1 is
    better)."""
    base = next((d for d in runs if d["label"] == baseline), None)
    if base is None:
        return []
    ref = {r["rate"]: r["summary"] for r in base["runs"]}
    rows = []
    for data in runs:
        if data is base:
            continue
        for r in sorted(data["runs"], key=lambda r: r["rate"]):
            if r["rate"] in ref:
                s, b = r["summary"], ref[r["rate"]]
                rows.append(
                    dict(
                        method=data["label"],
                        rate=r["rate"],
                        tbt_p50_ms=s["tbt_p50_ms"],
                        tbt_p50_gain=b["tbt_p50_ms"] / s["tbt_p50_ms"],
                        ttft_p50_s=s["ttft_p50_s"],
                        ttft_p50_gain=b["ttft_p50_s"] / s["ttft_p50_s"],
                        ttft_p99_gain=b["ttft_p99_s"] / s["ttft_p99_s"],
                    )
                )
    return rows


def _ratio(row: dict, base: str, what: str, capped: dict) -> str:
    """``row``'s ratio to ``base`` as text: ">= " where only ``row``'s sweep never crossed its bound (its rate is a
    lower bound), "<= " where only the baseline's did, "~" where both did; ``capped``: (method, metric, bound) ->
    whether that sweep stayed within the bound at every rate."""
    x = row.get(f"{what}_vs_{base}")
    if x is None or math.isnan(x):
        return ""
    mine, theirs = row["capped"], capped.get((base, row["metric"], row["bound"]), False)
    prefix = {(True, False): ">= ", (False, True): "<= ", (True, True): "~"}.get((mine, theirs), "")
    return f"{prefix}{x:.2f}x"


def print_tables(latency_rows: list[dict], rate_rows: list[dict], baselines: list[str]) -> None:
    heads = " | ".join(f"rate / tok/s vs {b}" for b in baselines)
    print(f"| latency bound | method | rate req/s | out tok/s | {heads} |")
    print("|---|---|---|---|" + "---|" * len(baselines))
    capped = {(r["method"], r["metric"], r["bound"]): r["capped"] for r in latency_rows}
    for row in latency_rows:
        unit = METRICS[row["metric"]][2]
        rate = "below the lowest" if math.isnan(row["rate"]) else f"{'>= ' if row['capped'] else ''}{row['rate']:.2f}"
        tokens = "" if math.isnan(row["tokens_per_s"]) else f"{row['tokens_per_s']:.0f}"
        ratios = " | ".join(f"{_ratio(row, b, 'rate', capped)} / {_ratio(row, b, 'tokens', capped)}" for b in baselines)
        print(f"| {row['metric']} <= {row['bound']:g} {unit} | {row['method']} | {rate} | {tokens} | {ratios} |")
    if rate_rows:
        print("\n| method | rate req/s | p50 TBT ms | p50 TBT gain | p50 TTFT s | p50 TTFT gain | p99 TTFT gain |")
        print("|---|---|---|---|---|---|---|")
        for r in rate_rows:
            print(
                f"| {r['method']} | {r['rate']:g} | {r['tbt_p50_ms']:.1f} | {r['tbt_p50_gain']:.2f}x | "
                f"{r['ttft_p50_s']:.3f} | {r['ttft_p50_gain']:.2f}x | {r['ttft_p99_gain']:.2f}x |"
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("jsons", nargs="+", help="bench/serve.py outputs, one per method")
    ap.add_argument("--metric", choices=sorted(METRICS), default="p99 TBT", help="the latency held equal")
    ap.add_argument("--bounds", type=float, nargs="+", default=[100.0, 150.0], help="latency bounds, in its unit")
    ap.add_argument(
        "--baselines", nargs="+", default=["none"], help="methods (JSON labels) the ratios are taken against"
    )
    ap.add_argument("--json", help="write both tables' rows here")
    args = ap.parse_args(argv)
    if any(not 0 < b < math.inf for b in args.bounds):
        ap.error(f"--bounds must be positive numbers, got {args.bounds}")
    try:
        runs = load(args.jsons)
    except (OSError, ValueError) as e:  # a missing file, or one that is not JSON
        ap.error(f"cannot read the sweeps: {e}")
    labels = [d["label"] for d in runs]
    missing = [b for b in args.baselines if b not in labels]
    if missing:
        ap.error(f"baselines {missing} are none of the JSONs' methods {labels}")
    latency_rows = at_equal_latency(runs, args.metric, args.bounds, args.baselines)
    rate_rows = at_equal_rate(runs, args.baselines[0])
    print_tables(latency_rows, rate_rows, args.baselines)
    if args.json:
        write_json(args.json, dict(at_equal_latency=latency_rows, at_equal_rate=rate_rows), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
