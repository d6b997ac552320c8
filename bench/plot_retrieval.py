"""One heat map of retrieval accuracy for several models side by side, from ``bench/accuracy.py retrieval`` JSONs:
a row per model (uncompressed first, then by variant and rate) and context, a column per depth, each cell's accuracy
written in it. The per-run maps ``accuracy.py --png-dir`` writes hold one model each; this one is for comparing.
A grid split over several runs (by context, by variant) reads as one. ``--markdown`` also prints the mean accuracy
per model and context and the largest rate within 2 points of the uncompressed model, as in
``bench/results/accuracy.md``; ``--mean-depths`` averages only some depths (those the uncompressed model answers, say).

    python3 -m bench.plot_retrieval bench/results/retrieval-a.json bench/results/retrieval-b.json --task passkey \\
        --out bench/plots/x.png
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from bench import retrieval
from bench.accuracy import largest_passing
from bench.files import read_accuracy_jsons, write_atomic


def _label(run: dict) -> str:
    """A run's model as a row label: "uncompressed" or "zack p=0.101"."""
    if run["variant"] == "uncompressed":
        return "uncompressed"
    share = "" if run.get("k_share") is None else f", Q/K share {run['k_share']:g}"
    return f"{run['variant']} p={run['rate']:.2f}{share}"


def models(runs: list[dict], task: str) -> list[tuple[dict, dict[tuple[int, float], float]]]:
    """``task``'s models in ``runs``, each once (uncompressed first, then by variant and target rate): its first run
    and its accuracy per (context, depth) joined over every run of it, so a grid split by context over several
    JSONs reads as one; a context a model has twice (the uncompressed run each JSON repeats) keeps its first."""
    merged: dict[tuple, tuple[dict, dict]] = {}
    for run in runs:
        if run["task"] != task:
            continue
        key = (_label(run), run.get("calibration"), run.get("max_context"))
        first, cells = merged.setdefault(key, (run, {}))
        if run["results"]["depths"] != first["results"]["depths"]:
            raise ValueError(f"runs have different depths: {first['results']['depths']} and {run['results']['depths']}")
        for cell, accuracy in retrieval.accuracy(run["results"]).items():
            cells.setdefault(cell, accuracy)
    if not merged:
        raise ValueError(f"no run of task {task!r} in the JSONs")
    return sorted(
        merged.values(), key=lambda m: (m[0]["variant"] != "uncompressed", m[0]["variant"], m[0]["target_rate"])
    )


def grid_rows(runs: list[dict], task: str) -> tuple[list[str], list[float], np.ndarray]:
    """Row labels, depths and accuracies [rows, depths] of ``task``'s runs: one row per model (``models``) and
    context, contexts ascending."""
    chosen = models(runs, task)
    depths = chosen[0][0]["results"]["depths"]
    labels, values = [], []
    for run, cells in chosen:
        for context in sorted({c for c, _ in cells}):
            labels.append(f"{_label(run)}, {context}")
            values.append([cells[(context, d)] for d in depths])
    return labels, depths, np.array(values)


def table(runs: list[dict], task: str, tolerance: float = 0.02, depths: list[float] | None = None) -> list[str]:
    """Markdown lines: ``task``'s mean accuracy over ``depths`` (default: all) per model and context, then per
    variant and context the largest grid target rate whose mean (and every smaller grid rate's) is within
    ``tolerance`` of the uncompressed model's, by ``accuracy.largest_passing`` as ``within_tolerance`` judges it (0
    where none is). Fewer depths leave out cells the uncompressed model fails (depth 1 for both real models:
    bench/results/accuracy.md "Retrieval: SmolLM2 and Gemma 3 270M, 1K to 8K")."""
    chosen = models(runs, task)
    if depths is not None:
        known = chosen[0][0]["results"]["depths"]
        if not depths or any(d not in known for d in depths):
            raise ValueError(f"--mean-depths must be some of the runs' depths {known}, got {depths}")
        chosen = [(run, {cell: a for cell, a in cells.items() if cell[1] in depths}) for run, cells in chosen]
    contexts = sorted({c for _, cells in chosen for c, _ in cells})
    means = [
        {c: float(np.mean([a for (cc, _), a in cells.items() if cc == c])) for c in sorted({c for c, _ in cells})}
        for _, cells in chosen
    ]
    name = {c: f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts}
    lines = [
        f"| {task} | rate | " + " | ".join(f"{name[c]} mean" for c in contexts) + " |",
        "|---|---|" + "---|" * len(contexts),
    ]
    for (run, _), mean in zip(chosen, means, strict=True):
        cols = " | ".join(f"{mean[c]:.3f}" if c in mean else "-" for c in contexts)  # "-": a context it lacks
        lines.append(f"| {_label(run).split(' p=')[0]} | {run['rate']:.3f} | {cols} |")
    base = next((m for (run, _), m in zip(chosen, means, strict=True) if run["variant"] == "uncompressed"), None)
    if base is None:
        return lines
    lines += [
        "",
        f"| {task}: largest grid rate within {100 * tolerance:g} points | "
        + " | ".join(name[c] for c in contexts)
        + " |",
    ]
    lines.append("|---|" + "---|" * len(contexts))
    for variant in sorted({run["variant"] for run, _ in chosen} - {"uncompressed"}):
        grid = {run["target_rate"]: m for (run, _), m in zip(chosen, means, strict=True) if run["variant"] == variant}
        best = []
        for c in contexts:

            def passes(m, c=c):
                return c in m and c in base and m[c] >= base[c] - tolerance - 1e-9

            best.append(f"{largest_passing(grid.__getitem__, grid, passes, steps=0, upper=0.0)[0]:g}")
        lines.append(f"| {variant} | " + " | ".join(best) + " |")
    return lines


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
    ap.add_argument(
        "--markdown", action="store_true", help="also print the task's mean accuracy per model and context as Markdown"
    )
    ap.add_argument(
        "--mean-depths",
        type=float,
        nargs="+",
        metavar="D",
        help="--markdown: average these depths only (default: every depth of the runs)",
    )
    ap.add_argument("--title", default=None, help="the plot's title (default: the model and task)")
    args = ap.parse_args(argv)
    runs, model = read_accuracy_jsons(ap, args.jsons, "retrieval")
    try:
        lines = table(runs, args.task, depths=args.mean_depths) if args.markdown else []  # bad depths: no PNG
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        plot(runs, args.task, args.out, args.title or f"{model}: {args.task} retrieval")
        if lines:
            print("\n".join(lines))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
