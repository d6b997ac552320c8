"""What sliding-window page pools buy: for a model shape, budgets and batch shapes, the pages the engine gives its
whole-context pool and its window pools (``Engine`` itself, as a server would size them), the tokens and whole
sequences the cache then holds, and the same with every layer's pages held for the whole context (the engine
before window pools). The engine's arithmetic only: no step runs, so it needs no GPU. Table: bench/results/engine.md
"Engine: sliding-window page pools"."""

from __future__ import annotations

import argparse

import kvjax
from bench.files import json_folder, write_json
from bench.harness import GEMMA3_270M
from kvjax import validate
from kvjax.runtime import memory
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.engine import Engine

SHAPES = {"gemma3-270m": GEMMA3_270M}
PAGE_SIZE = 16


def one(model: kvjax.Model, budget: int, batch: int, seq_len: int, chunk: int) -> dict:
    """The engine's pools at ``budget`` bytes, beside one pool for every layer at the same budget."""
    engine = Engine(
        model,
        max_batch=batch,
        max_seq_len=seq_len,
        page_size=PAGE_SIZE,
        chunk_tokens=chunk,
        cache_memory=budget,
        backend="interpret",  # the kernels' activation reserve, as on a GPU
    )
    reserve = engine.activation_bytes()
    page = PAGE_SIZE * bytes_per_token(model.layouts, model.dtype)
    (before,) = memory.pool_pages(budget, reserve, [page], [batch * engine.pages_per_seq + 1], what="budget")
    tokens, tokens_before = ((n - 1) * PAGE_SIZE for n in (engine.num_pages, before))
    return dict(
        budget_gib=budget / 2**30,
        batch=batch,
        seq_len=engine.max_seq_len,
        chunk_tokens=chunk,
        pages=engine.num_pages,
        window_pages=engine.window_pages,
        cache_gib=engine.cache.nbytes / 2**30,
        tokens=tokens,
        sequences=min(batch, tokens // engine.max_seq_len),
        tokens_before=tokens_before,
        sequences_before=min(batch, tokens_before // engine.max_seq_len),
    )


def budget_arg(text: str) -> int:
    """A budget in bytes ("4GiB", "500MB"); fractions of device memory mean nothing here."""
    value = validate.parse_memory(text)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"budgets are positive sizes here (like 4GiB), got {text!r}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-270m")
    ap.add_argument("--dtype", choices=validate.DTYPES, default="bfloat16")
    ap.add_argument(
        "--budgets",
        type=validate.arg(lambda v: [budget_arg(x) for x in v.split(",")]),
        default="1GiB,4GiB,16GiB",
        help="cache budgets in bytes (sizes like 4GiB), comma-separated",
    )
    ap.add_argument(
        "--shapes",
        default="64x8192,16x32768",
        help="batch x max_seq_len pairs, comma-separated (default 64x8192,16x32768)",
    )
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        ap.error(f"--shapes: expected BATCHxLEN pairs like 16x32768, got {args.shapes!r}")
    if args.chunk_tokens < 1:
        ap.error("--chunk-tokens must be positive")
    json_folder(ap, args.json)
    cfg = SHAPES[args.shape]
    model = kvjax.Model.random(cfg, dtype=args.dtype)  # random weights: only shapes matter here
    rows = []
    print(
        "| budget | batch x len | whole-context pages | window pages (window) | tokens | sequences at once | "
        "one pool: tokens | one pool: sequences |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        for batch, seq_len in shapes:
            try:
                row = one(model, budget, batch, seq_len, args.chunk_tokens)
            except ValueError as e:
                print(f"| {memory.size(budget)} | {batch} x {seq_len} | {e} |")
                continue
            rows.append(row)
            windows = ", ".join(f"{n:,} ({w})" for w, n in row["window_pages"].items())
            print(
                f"| {memory.size(budget)} | {batch} x {seq_len} | {row['pages']:,} | {windows} | {row['tokens']:,} | "
                f"{row['sequences']} | {row['tokens_before']:,} | {row['sequences_before']} |"
            )
    if args.json:
        write_json(args.json, dict(shape=args.shape, dtype=args.dtype, page_size=PAGE_SIZE, rows=rows), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
