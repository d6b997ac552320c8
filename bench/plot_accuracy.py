"""Perplexity and KL against the compression rate, one line per variant, from ``bench/accuracy.py eval`` JSONs: a
column per held-out source, perplexity (log scale, the uncompressed model's and its +1% dashed) above KL, at one
window length; grid rows only (bisection probes are left out).

    python3 -m bench.plot_accuracy bench/results/accuracy-eval-*.json --window 4096 --out bench/plots/accuracy.png
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.files import read_accuracy_jsons, write_atomic


def curves(rows: list[dict], window: int) -> dict:
    """{source: {"base": ppl, variant label: [(achieved rate, ppl, kl), ...] by rate}} of ``rows`` at ``window``."""
    out: dict = {}
    for row in rows:
        if row["window"] != window or row.get("probe"):
            continue
        source = out.setdefault(row["source"], {})
        if row["variant"] == "uncompressed":
            source["base"] = row["ppl"]
            continue
        label = row["variant"] + ("" if row.get("k_share") is None else f" (Q/K share {row['k_share']:g})")
        points = source.setdefault(label, [])
        if all(p[0] != row["rate"] for p in points):  # uniform plans may reach one rate from two targets
            points.append((row["rate"], row["ppl"], row["kl"]))
    if not out:
        raise ValueError(f"no rows at window {window}")
    for source in out.values():
        for label, points in source.items():
            if label != "base":
                points.sort()
    return out


def plot(rows: list[dict], window: int, path: str, title: str) -> None:
    """Write the perplexity and KL curves of ``rows`` at ``window`` to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = curves(rows, window)
    fig = Figure(figsize=(5.0 * len(data), 7.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(data), squeeze=False, sharex=True)
    for col, (source, lines) in enumerate(sorted(data.items())):
        top, bottom = axes[0][col], axes[1][col]
        for label, points in sorted((k, v) for k, v in lines.items() if k != "base"):
            rates, ppl, kl = zip(*points, strict=True)
            top.plot(rates, ppl, marker="o", label=label)
            bottom.plot(rates, kl, marker="o", label=label)
        if "base" in lines:
            top.axhline(lines["base"], color="black", lw=0.8, label="uncompressed")
            top.axhline(1.01 * lines["base"], color="black", lw=0.8, ls="--", label="uncompressed +1%")
        top.set_yscale("log")
        top.set_title(f"{source}, {window}-token windows")
        top.set_ylabel("perplexity (log scale)")
        bottom.set_ylabel("KL(uncompressed || compressed), nats a token")
        bottom.set_xlabel("compression rate p (share of K/V columns removed)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110), mode="wb")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsons", nargs="+", help="bench/accuracy.py eval outputs")
    ap.add_argument("--window", type=int, default=4096, help="the window length to draw (default 4096)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None, help="the plot's title (default: the model)")
    args = ap.parse_args(argv)
    rows, model = read_accuracy_jsons(ap, args.jsons, "eval")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        plot(rows, args.window, args.out, args.title or f"{model}: held-out perplexity and KL against the rate")
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
