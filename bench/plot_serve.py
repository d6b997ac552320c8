"""Plots of bench/serve.py's JSONs (one per method), made on the CPU with matplotlib: normalized latency (seconds
per output token) against request rate, one line per method, as in the ZACK paper's Fig. 15; and the CDFs of
TTFT and of the gaps between tokens at one rate."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        data["label"] = data.get("method") or os.path.splitext(os.path.basename(path))[0]
        runs.append(data)
    return runs


def _title(runs: list[dict]) -> str:
    """The model shape all runs share (their model names' common prefix, e.g. "mistral-7b") and the trace."""
    shape = os.path.commonprefix([data.get("model", "") for data in runs]).rstrip("-")
    return f"{shape + ', ' if shape else ''}{runs[0]['trace']} trace"


def latency_plot(runs: list[dict], out: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for data in runs:
        rates = [r["rate"] for r in data["runs"]]
        latency = [r["summary"]["normalized_latency_s_per_token"] for r in data["runs"]]
        ax.plot(rates, latency, marker="o", label=data["label"])
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(_title(runs))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def cdf_plot(runs: list[dict], rate: float, out: str) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for data in runs:
        match = [r for r in data["runs"] if r["rate"] == rate]
        if not match:
            continue
        done = [r for r in match[0]["records"] if not r["error"] and r["token_times"]]
        ttft = np.sort([r["token_times"][0] - r["sent"] for r in done])
        gaps = np.sort(np.concatenate([np.diff(r["token_times"]) for r in done]) * 1e3)
        for ax, x in ((left, ttft), (right, gaps)):
            ax.plot(x, np.arange(1, len(x) + 1) / max(len(x), 1), label=data["label"])
    left.set_xlabel("time to first token (s)")
    right.set_xlabel("time between tokens (ms, log scale)")
    right.set_xscale("log")
    for ax in (left, right):
        ax.set_ylabel("fraction of requests" if ax is left else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{_title(runs)} at {rate:g} requests/s")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("jsons", nargs="+", help="bench/serve.py outputs, one per method")
    ap.add_argument("--rate", type=float, help="the rate of the CDF plot (default: the highest all share)")
    ap.add_argument("--out", default=".", help="folder for latency.png and cdf.png (default .)")
    args = ap.parse_args(argv)
    try:
        runs = load(args.jsons)
    except (OSError, ValueError) as e:  # a missing file, or one that is not JSON
        ap.error(f"cannot read the sweeps: {e}")
    shared = set.intersection(*({r["rate"] for r in d["runs"]} for d in runs))
    rate = args.rate if args.rate is not None else max(shared, default=runs[0]["runs"][-1]["rate"])
    os.makedirs(args.out, exist_ok=True)
    latency_plot(runs, os.path.join(args.out, "latency.png"))
    cdf_plot(runs, rate, os.path.join(args.out, "cdf.png"))
    print(f"wrote {os.path.join(args.out, 'latency.png')} and {os.path.join(args.out, 'cdf.png')} (CDFs at {rate:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
