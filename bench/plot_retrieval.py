"""One heat map of retrieval accuracy for several models side by side, from ``bench/accuracy.py retrieval`` JSONs:
a row per model (uncompressed first, then by variant and rate) and context, a column per depth, each cell's accuracy
written in it. The per-run maps ``accuracy.py --png-dir`` writes hold one model each; this one is for comparing.

    python3 plot_retrieval.py results/retrieval-a.json results/retrieval-b.json --task passkey --out plots/x.png
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import retrieval
from files import read_accuracy_jsons, write_atomic


def _label(run: dict) -> str:
    """A run's model as a row label: "uncompressed" or "zack p=0.101"."""
    if run["variant"] == "uncompressed":
        return "uncompressed"
    share = "" if run.get("k_share") is None else f", Q/K share {run['k_share']:g}"
    return f"{run['variant']} p={run['rate']:.2f}{share}"


def grid_rows(runs: list[dict], task: str) -> tuple[list[str], list[float], np.ndarray]:
    """Row labels, depths and accuracies [rows, depths] of ``task``'s runs: one row per model and context, the
    uncompressed model once (the first of its runs), then the others by variant and target rate."""
    chosen, seen = [], set()
    for run in runs:
        key = (_label(run), run.get("calibration"), run.get("max_context"))
        if run["task"] == task and key not in seen:
            seen.add(key)
            chosen.append(run)
    if not chosen:
        raise ValueError(f"no run of task {task!r} in the JSONs")
    chosen.sort(key=lambda r: (r["variant"] != "uncompressed", r["variant"], r["target_rate"]))
    depths = chosen[0]["results"]["depths"]
    labels, values = [], []
    for run in chosen:
        results = run["results"]
        if results["depths"] != depths:
            raise ValueError(f"runs have different depths: {depths} and {results['depths']}")
        cells = retrieval.accuracy(results)
        for context in results["contexts"]:
            labels.append(f"{_label(run)}, {context}")
            values.append([cells[(context, d)] for d in depths])
    return labels, depths, np.array(values)


def plot(runs: list[dict], task: str, path: str, title: str) -> None:
    """Write the side-by-side heat map of ``task``'s runs to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels, depths, grid = grid_rows(runs, task)
    trials = {run["results"]["trials"] for run in runs if run["task"] == task}
    fig = Figure(figsize=(0.9 * len(depths) + 4.0, 0.32 * len(labels) + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("depth of the key line (fraction of the filler)")
    ax.set_title(f"{title}\n{'/'.join(map(str, sorted(trials)))} trials a cell; rows: model, context", fontsize=10)
    for (i, j), value in np.ndenumerate(grid):
        color = "white" if value < 0.2 or value > 0.85 else "black"
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=color)
    fig.colorbar(image, ax=ax, label="accuracy")
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), mode="wb")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsons", nargs="+", help="bench/accuracy.py retrieval outputs")
    ap.add_argument("--task", choices=retrieval.TASKS, default="passkey", help="the task to draw (default passkey)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None, help="the plot's title (default: the model and task)")
    args = ap.parse_args(argv)
    runs, model = read_accuracy_jsons(ap, args.jsons, "retrieval")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        plot(runs, args.task, args.out, args.title or f"{model}: {args.task} retrieval")
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
