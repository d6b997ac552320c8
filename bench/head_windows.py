"""Per-head pages an evicting engine holds on a sliding-window model as decode passes its windows (issue 37): one
held-out prose prompt of ``--prompt`` tokens evicted by ``--evict``, then ``--new`` greedy tokens, through the engine
and its scheduler (``Runner``). After every step, the per-head pages the sequence holds in its local (sliding-window)
and global layers, twice: with local heads giving back the pages their window has passed
(``HeadPages.release_passed``), and with the host told of no windows, so that every page is kept (the engine before
2026-12-05). The two runs' tokens must be equal: a page given back is one no query reads again.

Table: bench/results/eviction.md "Per-head pages on sliding-window models"."""

from __future__ import annotations

import argparse

import numpy as np

import kvjax
from bench.accuracy import heldout_ids
from bench.files import json_folder, write_json
from kvjax.ops.paging import NULL_PAGE
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request


def run(model, prompt: list[int], new: int, evict: str, release: bool, backend: str) -> tuple[list, list[int]]:
    """(pages held after each step, [local, global] per step; the tokens) of one evicting run."""
    engine = Engine(
        model, max_batch=1, max_seq_len=len(prompt) + new, chunk_tokens=512, eviction=evict, backend=backend
    )
    runner = Runner(engine)
    heads = runner.scheduler.pages.heads
    if not release:
        heads.windows = np.zeros_like(heads.windows)  # every layer counted as whole-context: no page goes back
    local = np.array([w is not None for w in engine.head_windows])
    r = runner.add(Request(prompt, new))
    held = []
    while runner.busy:
        runner.step()
        if heads.holds(r.id):
            pages = (heads.table(r.id) != NULL_PAGE).sum(axis=(1, 2))  # [layers]
            held.append([int(pages[local].sum()), int(pages[~local].sum())])
    return held, r.tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", help="a model with sliding-window layers (default gemma3-270m)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (held-out prose)")
    ap.add_argument("--new", type=int, default=768, help="tokens decoded after it")
    ap.add_argument("--evict", default="kvcompress:2x", help="the eviction policy (default kvcompress:2x)")
    ap.add_argument("--every", type=int, default=128, help="a table row every this many decoded tokens")
    ap.add_argument("--backend", default="reference", help="attention backend (reference on a CPU)")
    ap.add_argument("--json", help="write the per-step counts here")
    args = ap.parse_args(argv)
    if min(args.prompt, args.new, args.every) < 1:
        ap.error("--prompt, --new and --every must be positive")
    json_folder(ap, args.json)
    model = kvjax.load(args.model, dtype=args.dtype)
    windows = sorted({lay.sliding_window for lay in model.module.layouts if lay.sliding_window})
    if not windows:
        ap.error(f"{args.model} has no sliding-window layers")
    prompt = heldout_ids(model, "prose", args.prompt).tolist()
    kept, kept_tokens = run(model, prompt, args.new, args.evict, False, args.backend)
    freed, freed_tokens = run(model, prompt, args.new, args.evict, True, args.backend)
    if kept_tokens != freed_tokens:
        raise SystemExit("the runs' tokens differ: a page given back was read again")
    print(f"{args.model}, windows {windows}, prompt {args.prompt}, {args.evict}; per-head pages the sequence holds")
    print("| decoded | local layers, all kept | local layers, given back | global layers |")
    print("|---|---|---|---|")
    for step in [*range(0, len(kept), args.every), len(kept) - 1]:
        print(f"| {step} | {kept[step][0]:,} | {freed[step][0]:,} | {freed[step][1]:,} |")
    if args.json:
        fields = {k: getattr(args, k) for k in ("model", "dtype", "prompt", "new", "evict", "backend")}
        write_json(args.json, fields | {"windows": windows, "kept": kept, "given_back": freed}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
