"""Host cost of per-head paging (issue 37: "host bookkeeping under 10% of a step"): for B sequences of the Llama-3.1-8B
shape (32 layers x 8 KV heads) at a context of N tokens, on a rate-0.5 plan's widths (``harness.rank_plan``) or
uncompressed, the time ``kvjax.runtime.head_pages.HeadPages.grow_many`` takes per decode step (every sequence grows
one token in every head, in one call; the entries it fills are what the device's tables need), the bytes those
entries and, beside them, whole per-head tables would send, and the time one sequence's eviction (a random half
kept per head) takes with the moves it returns. With ``--window W`` every layer has a sliding window of W tokens (a
Mistral-like shape), each sequence's prompt has been evicted to half a window and decoded past it, and each step also
gives back the pages the windows passed (``HeadPages.release_passed``, one call for every sequence).

Host work only: the same numbers on any machine with this CPU. Table: bench/results/eviction.md "Per-head pages: host
cost"."""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.files import write_json
from bench.harness import HKV, D, count_arg, print_table, rank_plan
from kvjax.ops.head_paging import layer_tokens_per_page
from kvjax.runtime.head_pages import HeadPages


def _per_page(rate: float, page_elems: int) -> np.ndarray:
    return np.stack([layer_tokens_per_page(lay, page_elems) for lay in rank_plan(rate)])


def measure(rate: float, batch: int, context: int, page_tokens: int, steps: int, window: int | None = None) -> dict:
    """One row: per-step grow time and bytes (and, with ``window``, release time), eviction time and moves, for
    ``batch`` sequences at ``context``."""
    page_elems = page_tokens * 2 * D  # a full-width head's K and V for page_tokens tokens
    per = _per_page(rate, page_elems)
    passed = 0 if window is None else window
    max_pages = int(-(-(context + passed + steps) // per.min()))
    need = int(batch * (-(-(context + passed + steps) // per)).sum())
    pages = HeadPages(need + 1, per, max_pages, windows=None if window is None else [window] * per.shape[0])
    owners = list(range(batch))
    for owner in owners:
        assert pages.grow(owner, context - 1) is not None
        if window is not None:  # the prompt evicted to half its window, then decoded past it (staggered phases)
            pages.evicted(owner, context - 1, np.full(per.shape, min(context - 1, window) // 2))
            assert pages.grow(owner, window + owner) is not None
    if window is not None:
        pages.release_passed(owners)  # what the windows passed before the steps timed: steady state from here
    times, released, sent = [], [], 0
    for _ in range(steps):
        if window is not None:
            t0 = time.perf_counter()
            pages.release_passed(owners)
            released.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        filled = pages.grow_many(owners, 1)
        times.append(time.perf_counter() - t0)
        assert filled is not None
        sent += filled.nbytes
    pages.check()
    whole = batch * per.size * max_pages * 4  # int32 tables of every head, every step
    keep = np.random.default_rng(0).random((*per.shape, context + steps)) < 0.5
    t0 = time.perf_counter()
    source, _ = pages.evict(0, keep)
    evict_s = time.perf_counter() - t0
    return {
        "rate": rate,
        "batch": batch,
        "context": context,
        "page_tokens": page_tokens,
        "window": window,
        "grow_step_us": 1e6 * float(np.median(times)),
        "release_step_us": 1e6 * float(np.median(released)) if released else None,
        "release_step_max_us": 1e6 * float(np.max(released)) if released else None,
        "entries_bytes_per_step": sent / steps,
        "whole_tables_bytes_per_step": whole,
        "evict_one_seq_ms": 1e3 * evict_s,
        "moves": len(source),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--batch", type=count_arg("--batch"), default=32)
    p.add_argument("--contexts", type=count_arg("--contexts"), nargs="+", default=[2048, 8192])
    p.add_argument("--page-tokens", type=count_arg("--page-tokens"), default=16)
    p.add_argument("--steps", type=count_arg("--steps"), default=64)
    p.add_argument("--window", type=count_arg("--window"), default=None, help="a sliding window on every layer")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [
        measure(rate, args.batch, context, args.page_tokens, args.steps, args.window)
        for rate in args.rates
        for context in args.contexts
    ]
    print_table(rows)
    print(f"({HKV} KV heads, 32 layers)")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
