"""ZACK's Q/K basis for the positions a model serves (``kvjax.compress(..., max_context=...)``), measured on SmolLM2:
held-out perplexity on positions 1-511 and 512-1023 of 1,024-token windows, for the uncompressed model, ZACK at
p = 0.5 calibrated on 512-token text rows without and with ``max_context`` (its post-RoPE Gram derived from pre-RoPE
statistics for positions 0..max_context-1), and ZACK calibrated on 1,024-token rows. Calibration text: the first
half of Python's pydoc topics; evaluation: the second half (``kvjax.compression.text``). Table: bench/RESULTS.md
"Compression: the basis for the served positions"."""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import kvjax
from kvjax.compression import calibrate, calibration_tokens, fold, make_plan
from kvjax.compression.text import pydoc_text

WINDOW = 1024


def nll_by_position(model, windows, batch=2) -> np.ndarray:
    """[n, WINDOW - 1]: entry j is the negative log-likelihood of the token at position j + 1."""
    out = []
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        logp = jax.nn.log_softmax(model.logits(chunk)[:, :-1], axis=-1)
        out.append(-np.take_along_axis(np.asarray(logp, np.float64), chunk[:, 1:, None], axis=-1)[..., 0])
    return np.concatenate(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--windows", type=int, default=8, help="held-out 1,024-token windows (default 8)")
    ap.add_argument("--rate", type=float, default=0.5, help="ZACK's target rate (default 0.5)")
    ap.add_argument("--num-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    base = kvjax.load("smollm2", dtype="float32", progress=False)
    ids = np.asarray(base.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"])
    if len(ids) < args.windows * WINDOW:
        raise SystemExit(f"the held-out text has {len(ids)} tokens, fewer than {args.windows} windows")
    windows = ids[: args.windows * WINDOW].astype(np.int32).reshape(args.windows, WINDOW)
    rows = []
    print("\n| model | calibration rows | max_context | ppl, positions 1-511 | ppl, positions 512-1023 |")
    print("|---|---|---|---|---|")

    def report(name, rows_len, max_context, model):
        nll = nll_by_position(model, windows)
        row = dict(model=name, rows=rows_len, max_context=max_context)
        row |= dict(ppl_1_511=float(np.exp(nll[:, :511].mean())), ppl_512_1023=float(np.exp(nll[:, 511:].mean())))
        rows.append(row)
        print(
            f"| {name} | {rows_len or '-'} | {max_context or '-'} | {row['ppl_1_511']:.2f} | "
            f"{row['ppl_512_1023']:.2f} |",
            flush=True,
        )

    report("uncompressed", None, None, base)
    for seq_len, contexts in ((512, (None, 512, 1024)), (1024, (None,))):
        stats = calibrate(base, calibration_tokens(base, "prose", args.num_tokens, seq_len, seed=0), progress=False)
        for max_context in contexts:
            plan, bases = make_plan(base, stats, target_rate=args.rate, max_context=max_context)
            report(f"zack p={plan.rate:.2f}", seq_len, max_context, fold(base, plan, bases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(windows=args.windows, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
