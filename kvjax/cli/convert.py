"""``kvjax-convert``: a checkpoint -> a KV-compressed kvjax checkpoint (orbax params + plan.json + tokenizer).

    kvjax-convert SRC OUT (--target-rate P | --removal-rate R) [--method zack|palu] [--uniform]
                              [--calibration text|prose|code|random|text:FILE] [--num-tokens N] [--k-share S|measured]
                              [--ranks spectrum|measured] [--band W] [--qk-basis shared|pair|measured]
                              [--qk-widths shared|pair] [--kv-bits 4|2|gear2...|none]

SRC is anything ``kvjax.load`` reads (a Hugging Face directory, a .gguf file, 'smollm2', 'gemma3-270m'). OUT is
written beside and swapped in by renames at the end, so a failure leaves nothing half-written; --overwrite replaces
only a kvjax checkpoint, and OUT may not be, contain or lie inside SRC. --kv-bits saves the choice of quantized KV
pages with OUT, so that kvjax-infer, kvjax-serve and kvjax.generate serve it from them by default.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def parse_args(argv=None):
    from kvjax import validate
    from kvjax.cli import options
    from kvjax.compression.calibration import TEXT_SOURCES
    from kvjax.compression.pipeline import MODEL_CONTEXT, RANKS
    from kvjax.compression.plan import check_band
    from kvjax.compression.text import read_text_file
    from kvjax.io.load import resolve
    from kvjax.io.saved import check_target

    rate = functools.partial(validate.rate, "the rate")
    p = argparse.ArgumentParser(
        prog="kvjax-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("src", help="source checkpoint: Hugging Face directory, .gguf file, 'smollm2' or 'gemma3-270m'")
    p.add_argument("out", help="output directory (must not exist unless --overwrite)")
    rates = p.add_mutually_exclusive_group(required=True)
    rates.add_argument("--target-rate", type=validate.arg(rate, float), help="overall KV compression rate p in [0, 1)")
    rates.add_argument(
        "--removal-rate", type=validate.arg(rate, float), help="singular-value mass r every head may drop, in [0, 1)"
    )
    p.add_argument(
        "--method",
        choices=("zack", "palu"),
        default="zack",
        help="zack: rotate Q/K after RoPE (default); palu: pre-RoPE low-rank K baseline",
    )
    p.add_argument("--uniform", action="store_true", help="same rank for every head (the ablation)")
    p.add_argument(
        "--keep-head-order",
        action="store_true",
        help="keep each layer's KV heads in their original order (by default they are reordered so the "
        "decode kernel reads adjacent narrow heads as one; the model's output does not change)",
    )
    p.add_argument(
        "--fill-tiles",
        action="store_true",
        help="move up to 32 columns a head between a layer's heads, at the same rate, where that lets the "
        "decode kernel's runs fill their tiles: faster decode, some accuracy lost (see the README)",
    )
    p.add_argument(
        "--calibration",
        default="text",
        help="'text' (default): real text, rows alternating English prose (Python's pydoc topics) and Python code "
        "(standard-library sources), both shipped with Python; 'prose' or 'code': one of the two; 'text:FILE': a "
        "UTF-8 file; 'random': random token ids, for a model without a tokenizer",
    )
    count = functools.partial(validate.positive, "the count")
    p.add_argument(
        "--num-tokens", type=validate.arg(count, int), default=16384, help="calibration tokens (default 16384)"
    )
    p.add_argument(
        "--seq-len", type=validate.arg(count, int), default=512, help="calibration sequence length (default 512)"
    )
    p.add_argument(
        "--max-context",
        type=validate.arg(options.max_context),
        default=MODEL_CONTEXT,
        help="zack: the positions the Q/K basis serves, derived from pre-RoPE statistics so it holds past --seq-len: "
        "'model' (default) the model's context length, N the longest prompt + new tokens the model will serve, or "
        "'calibration' the positions calibration saw (the basis then degrades past --seq-len)",
    )
    p.add_argument(
        "--band",
        type=validate.arg(functools.partial(check_band, method="zack"), int),
        default=None,
        metavar="W",
        help="zack: banded ZACK, a variant beside the paper's method: each key is stored in the frame of its band of W "
        "positions (16, 32 or 64; a power of two), so one basis fits every position (--max-context does not apply) "
        'and is closer to Palu\'s accuracy at the same bytes (bench/results/accuracy.md "Banded bases"), for '
        'slower decode (bench/results/kernels.md "Banded decode kernel"); served without quantized pages',
    )
    p.add_argument(
        "--qk-basis",
        choices=("shared", "pair", "measured"),
        default="shared",
        help="zack: the directions queries and keys are projected on. 'shared' (default): the paper's one rotation "
        "of both. 'pair': a score-aware pair (queries on A, keys on B), the truncation that least changes the scores "
        'q.k, same bytes, nothing rebuilt (bench/results/accuracy.md "A score-aware Q/K pair in the library"). '
        "'measured': fold the shared basis and the pair (its widths from the shared spectrum or, under F_p, its own) "
        "and keep the one closest to the original on two held-in calibration rows of 4,096 tokens (a fold and a "
        'forward pass each; bench/results/accuracy.md "Which Q/K basis: held-in rows as long as the windows")',
    )
    p.add_argument(
        "--qk-widths",
        choices=("shared", "pair"),
        default="shared",
        help="with --qk-basis pair (adaptive, --ranks spectrum): the spectrum F_p reads the Q/K widths off. "
        "'shared' (default): the shared basis's, so the pair changes only the directions. 'pair': the pair's own, "
        "which falls faster and gives V more columns; better on Gemma 3 at 0.3, worse at 0.5 and on SmolLM2 "
        '(bench/results/accuracy.md "Which Q/K basis: held-in rows as long as the windows"), so '
        "--qk-basis measured, which weighs both, is the safer ask",
    )
    p.add_argument(
        "--k-share",
        type=validate.share_arg({"measured": "measured"}),
        default=None,
        help="with --target-rate: the share of the kept columns Q/K gets (V the rest), or 'measured' to try 0.3-0.7 "
        "and keep the share whose model stays closest to the original on held-in calibration rows (default: one "
        "removal rate for both)",
    )
    p.add_argument(
        "--ranks",
        choices=RANKS,
        default="spectrum",
        help="with --target-rate: how each head's widths are chosen. 'spectrum' (default): one removal rate on every "
        "head's singular values (F_p). 'measured': probe each head's Q/K and V at half width, score the probe by KL "
        "to the original on held-in calibration rows, and spend the rate where it costs least, K and V together "
        '(2 x layers x KV heads extra forward passes; bench/results/accuracy.md "Ranks by measured effect")',
    )
    p.add_argument(
        "--seed",
        type=validate.arg(validate.seed, int),
        default=0,
        help="seed of the random calibration token ids (--calibration random; default 0): the same seed gives the "
        "same plan; text calibration does not use it",
    )
    p.add_argument(
        "--kv-bits",
        type=options.kv_bits_arg(model=False),
        default=None,
        metavar="{4,2,gear2,...,none}",
        help="save with OUT that its KV cache is to be kept in 4- or 2-bit quantized or GEAR pages (see kvjax-serve "
        "--help): "
        "kvjax-infer, kvjax-serve and kvjax.generate then use them unless told otherwise (their --kv-bits none, "
        "kv_bits=None); not with --method palu (default none: pages in the model's dtype)",
    )
    options.add_dtype(p, "parameter dtype of the output")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it is a kvjax checkpoint (never anything else, never SRC)",
    )
    args = p.parse_args(argv)
    if args.k_share is not None and args.target_rate is None:
        p.error("--k-share splits a target rate's columns: give --target-rate")
    if args.ranks == "measured" and (args.target_rate is None or args.uniform or args.k_share is not None):
        p.error("--ranks measured takes --target-rate, and neither --uniform nor --k-share (it splits K and V itself)")
    _check_cache_flags(p, args)
    if args.calibration not in ("random", *TEXT_SOURCES) and not args.calibration.startswith("text:"):
        p.error("--calibration must be 'text', 'prose', 'code', 'random' or 'text:FILE'")
    if args.calibration.startswith("text:"):
        try:  # missing, a directory or not UTF-8: said before the model is loaded
            read_text_file(args.calibration[len("text:") :])
        except (OSError, ValueError) as e:
            p.error(str(e))
    try:
        src = resolve(args.src)
        check_target(args.out, overwrite=args.overwrite, sources=(src,), hint="--overwrite")
    except (OSError, ValueError) as e:
        p.error(str(e))
    if args.calibration != "random" and not _has_tokenizer(src):
        p.error(
            f"{args.src} has no tokenizer, so it cannot be calibrated on text (--calibration {args.calibration}): "
            "pass --calibration random (random token ids)"
        )
    return p, args


def _has_tokenizer(path: str) -> bool:
    """Whether ``kvjax.load(path)`` gives a model with a tokenizer, from its files alone (as ``kvjax.load`` decides):
    a GGUF file builds one from its vocabulary; a kvjax checkpoint has ``tokenizer/``; a Hugging Face directory has
    tokenizer.json or tokenizer_config.json."""
    from kvjax.io.saved import is_kvjax_checkpoint

    if not os.path.isdir(path):
        return True
    if is_kvjax_checkpoint(path):
        return os.path.isdir(os.path.join(path, "tokenizer"))
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def _check_cache_flags(p, args) -> None:
    """--qk-basis, --qk-widths, --band and --kv-bits against --method, --uniform, --ranks and --max-context (a banded
    plan serves every position: its max_context is None)."""
    from kvjax.compression.pipeline import MODEL_CONTEXT
    from kvjax.compression.plan import check_kv_bits

    if args.qk_basis != "shared" and args.method != "zack":
        p.error(f"--qk-basis {args.qk_basis} applies to --method zack (a post-RoPE basis), not {args.method}")
    if args.qk_widths == "pair" and (args.qk_basis != "pair" or args.uniform or args.ranks != "spectrum"):
        p.error(
            "--qk-widths pair applies to --qk-basis pair with adaptive F_p ranks (no --uniform, --ranks spectrum); "
            "--qk-basis measured picks the widths itself"
        )
    if args.band is not None:
        if args.method != "zack":
            p.error(f"--band applies to --method zack (a post-RoPE basis), not {args.method}")
        if args.max_context != MODEL_CONTEXT:  # left as "model", which compress resolves to None with a band
            p.error("--band serves every position: leave out --max-context")
    try:
        check_kv_bits(args.kv_bits, args.method, args.band)
    except ValueError as e:
        with_band = f" --band {args.band}" if args.band is not None else ""
        p.error(f"--kv-bits {args.kv_bits} with --method {args.method}{with_band}: {str(e).removeprefix('kv_bits: ')}")


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    import kvjax

    start = time.perf_counter()
    try:
        model = kvjax.load(args.src, dtype="float32")  # calibrate and fold in float32, store in --dtype
        compressed = kvjax.compress(
            model,
            target_rate=args.target_rate,
            removal_rate=args.removal_rate,
            method=args.method,
            adaptive=not args.uniform,
            calibration=args.calibration,
            num_tokens=args.num_tokens,
            seed=args.seed,
            seq_len=args.seq_len,
            order_heads=not args.keep_head_order,
            fill_tiles=args.fill_tiles,
            max_context=args.max_context,
            k_share=args.k_share,
            band=args.band,
            ranks=args.ranks,
            qk_basis=args.qk_basis,
            qk_widths=args.qk_widths,
            kv_bits=args.kv_bits,  # saved with OUT (kvjax.json's "serving")
        )
    except (FileNotFoundError, IsADirectoryError, ValueError) as e:
        parser.error(str(e))
    if args.dtype != "float32":
        compressed = compressed.astype(args.dtype)
    try:
        compressed.save(args.out, overwrite=args.overwrite, hint="--overwrite")
    except OSError as e:  # a full disk, say: the save left nothing half-written (kvjax.io.atomic)
        print(f"kvjax-convert: error: {e}", file=sys.stderr)
        return 1
    print(compressed.plan.summary())
    print(f"wrote {args.out} ({compressed}) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
