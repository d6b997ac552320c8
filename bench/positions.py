"""ZACK's Q/K basis for the positions a model serves (``kvjax.compress(..., max_context=...)``), measured on
``--model`` (default SmolLM2): held-out perplexity by position (1-511, 512-1023, then doubling up to the window) of
``--window``-token windows, for the uncompressed model, ZACK calibrated on 512-token rows without and with
``max_context`` (its post-RoPE Gram derived from pre-RoPE statistics for positions 0..max_context-1: the window, and
the model's context length, ``kvjax.compress``'s default), and ZACK calibrated on rows as long as the window; with
``--bands``, banded ZACK (``compress(band=W)``: one basis for every position) beside them, or alone with
``--bands-only``. Each
cell: the perplexity, and its ratio to the uncompressed model's over the same positions. Calibration text:
``--calibration`` (default "prose", the first half of Python's pydoc topics); evaluation: the second half
(``kvjax.compression.text``). Tables: bench/results/accuracy.md "Compression: the basis for the served positions"."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from bench.files import write_json
from kvjax.compression import calibrate, calibration_tokens, fold, make_plan
from kvjax.compression.calibration import check_source
from kvjax.compression.plan import check_band
from kvjax.compression.text import pydoc_text


def nll_by_position(model, windows, batch=2) -> np.ndarray:
    """[n, window - 1]: entry j is the negative log-likelihood of the token at position j + 1."""
    out = []
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        logp = jax.nn.log_softmax(model.logits(chunk)[:, :-1], axis=-1)
        # the targets' entries only: a 262K-token vocabulary (Gemma 3) makes the whole array gigabytes
        out.append(-np.asarray(jnp.take_along_axis(logp, jnp.asarray(chunk[:, 1:, None]), axis=-1)[..., 0], np.float64))
    return np.concatenate(out)


def buckets(window: int) -> list[tuple[int, int]]:
    """Position ranges [start, end) of a window: 1-511, 512-1023, then doubling (1024-2047, ...) up to the window."""
    edges = [1, 512]
    while edges[-1] < window:
        edges.append(min(2 * edges[-1], window))
    return list(zip(edges[:-1], edges[1:], strict=True))


def parse(argv=None):
    """The command line, its flags checked (before any model loads)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="what kvjax.load reads (default smollm2)")
    ap.add_argument("--window", type=int, default=1024, help="evaluation window in tokens (default 1024)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows (default 8)")
    ap.add_argument("--rate", type=float, default=0.5, help="ZACK's target rate (default 0.5)")
    ap.add_argument("--calibration", default="prose", help="calibration source (default prose; see kvjax.compress)")
    ap.add_argument("--num-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    ap.add_argument("--bands", type=int, nargs="*", default=[], help="also: banded ZACK with these bands W")
    ap.add_argument("--bands-only", action="store_true", help="with --bands: no plain ZACK rows")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.bands_only and not args.bands:
        ap.error("--bands-only needs --bands")
    for band in args.bands:
        try:
            check_band(band, "zack")
        except ValueError as e:
            ap.error(f"--bands: {e}")
    if args.window <= 512 or args.windows < 1 or args.num_tokens < 1 or not 0 < args.rate < 1:
        ap.error("--window must exceed 512, --windows and --num-tokens be positive, --rate lie in (0, 1)")
    return ap, args


def main(argv=None) -> None:
    ap, args = parse(argv)
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 as on the CPU (the GPU's default is TF32)
    try:
        base = kvjax.load(args.model, dtype="float32", progress=False)
    except (OSError, ValueError) as e:
        ap.error(f"--model: {e}")
    try:
        check_source(base, args.calibration)
    except (OSError, ValueError) as e:
        ap.error(f"--calibration: {e}")
    if args.window > base.config.max_position_embeddings:
        ap.error(f"--window {args.window} exceeds the model's {base.config.max_position_embeddings} positions")
    ids = np.asarray(base.tokenizer(pydoc_text("heldout"), add_special_tokens=False)["input_ids"])
    if len(ids) < args.windows * args.window:
        ap.error(f"the held-out text has {len(ids)} tokens, fewer than {args.windows} windows of {args.window}")
    windows = ids[: args.windows * args.window].astype(np.int32).reshape(args.windows, args.window)
    spans = buckets(args.window)
    names = [f"{a}-{b - 1}" for a, b in spans]
    rows = []
    print(f"\n| model | calibration rows | max_context | {' | '.join(f'ppl, positions {n}' for n in names)} |")
    print("|---|---|---|" + "---|" * len(spans))

    def report(name, rows_len, max_context, model):
        nll = nll_by_position(model, windows, batch=max(1, 2048 // args.window))
        ppl = {n: float(np.exp(nll[:, a - 1 : b - 1].mean())) for n, (a, b) in zip(names, spans, strict=True)}
        ratio = {n: ppl[n] / rows[0]["ppl"][n] for n in names} if rows else dict.fromkeys(names, 1.0)
        rows.append(dict(model=name, rows=rows_len, max_context=max_context, ppl=ppl, ratio_to_base=ratio))
        cells = " | ".join(f"{ppl[n]:.2f} ({ratio[n]:.3f})" for n in names)
        print(f"| {name} | {rows_len or '-'} | {max_context or '-'} | {cells} |", flush=True)
        if args.json:  # after every row, so a run cut short keeps the rows it finished
            write_json(
                args.json,
                dict(
                    model=args.model, window=args.window, windows=args.windows, calibration=args.calibration, rows=rows
                ),
            )

    report("uncompressed", None, None, base)
    served = base.config.max_position_embeddings  # compress's default max_context
    plain = ((512, dict.fromkeys((None, args.window, served))), (args.window, (None,)))
    for seq_len, contexts in ((512, ()),) if args.bands_only else plain:
        tokens = calibration_tokens(base, args.calibration, args.num_tokens, seq_len, seed=0)
        stats = calibrate(base, tokens, batch_size=max(1, 2048 // seq_len), progress=False)  # bounded memory
        for max_context in contexts:
            plan, bases = make_plan(base, stats, target_rate=args.rate, max_context=max_context)
            report(f"zack p={plan.rate:.2f}", seq_len, max_context, fold(base, plan, bases))
        for band in args.bands if seq_len == 512 else ():
            plan, bases = make_plan(base, stats, target_rate=args.rate, band=band)
            report(f"zack band {band} p={plan.rate:.2f}", seq_len, None, fold(base, plan, bases))


if __name__ == "__main__":
    main()
