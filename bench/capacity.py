"""The cache sized from a memory budget, end to end on a random Llama-3.1-8B-shaped model (bf16): per rate, shape
(requests x prompt tokens, 128 new each) and budget (a fraction of free device memory, or a size), the pages the
budget buys, how many of the requests fit at once, then every request run through the continuous-batching runner:
the most that ran at once, preemptions, wall time, tokens/s, and the device memory at its peak beside the weights,
the cache and the engine's activation reserve. Each configuration runs in a process of its own, so each peak is
its own. Table: bench/results/engine.md "Engine: memory by budget"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

from bench.engine import model_at
from bench.harness import log, on_gpu
from kvjax import validate
from kvjax.runtime import memory
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where ``bench`` is a package: the runs' cwd
NEW_TOKENS = 128
CONFIGS = "0:64x2048:12GiB,0.5:64x2048:12GiB,0:64x2048:0.9,0:8x32768:0.9,0.5:8x32768:0.9"


def run_one(rate: float, batch: int, ctx: int, budget: float | int, chunk_tokens: int) -> dict:
    """Build the engine with ``budget``, run ``batch`` prompts of ``ctx`` random tokens to ``NEW_TOKENS`` each."""
    model = model_at(rate)
    device = jax.devices()[0]
    before = device.memory_stats()["bytes_in_use"]  # the weights (and nothing else yet)
    free = memory.free_bytes()
    t0 = time.perf_counter()
    engine = Engine(
        model, max_batch=batch, max_seq_len=ctx + NEW_TOKENS, chunk_tokens=chunk_tokens, cache_memory=budget
    )
    cache_bytes = engine.cache.nbytes
    runner = Runner(engine)
    rng = np.random.default_rng(0)
    requests = [runner.add(Request(rng.integers(0, 32000, ctx).tolist(), NEW_TOKENS)) for _ in range(batch)]
    most = 0
    while not runner.scheduler.idle or runner._pending:
        runner.step()
        most = max(most, len(runner.scheduler.running) + len(runner.scheduler.draining))
    wall = time.perf_counter() - t0
    if any(r.finish_reason != "length" for r in requests):
        raise RuntimeError(f"requests failed: {[r.error for r in requests if r.error][:3]}")
    stats = device.memory_stats()
    per_seq = engine.pages_per_seq  # a finished request's pages
    return dict(
        device=device.device_kind,
        rate=rate,
        batch=batch,
        ctx=ctx,
        budget=budget,
        free_gib=free / 2**30,
        weights_gib=before / 2**30,
        cache_gib=cache_bytes / 2**30,
        reserve_gib=engine.activation_bytes() / 2**30,
        pages=engine.num_pages,
        fit_at_once=min(batch, (engine.num_pages - 1) // per_seq),
        most_running=most,
        preemptions=sum(r.preemptions for r in requests),
        steps=runner.steps,
        wall_s=wall,
        new_tok_s=batch * NEW_TOKENS / wall,
        peak_gib=stats["peak_bytes_in_use"] / 2**30,
        peak_beyond_gib=(stats["peak_bytes_in_use"] - before - cache_bytes) / 2**30,
        limit_gib=stats["bytes_limit"] / 2**30,
    )


def print_rows(rows: list[dict]) -> None:
    print(
        "\n| rate | requests x prompt | budget | free GiB | weights GiB | cache GiB (pages) | reserve GiB | "
        "fit at once | most running | preemptions | wall s (incl. compile) | new tok/s | "
        "peak GiB (beyond weights + cache) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rate']} | {r['batch']} x {r['ctx']} | {r['budget']} | {r['free_gib']:.1f} | "
            f"{r['weights_gib']:.1f} | {r['cache_gib']:.1f} ({r['pages']}) | {r['reserve_gib']:.2f} | "
            f"{r['fit_at_once']} | {r['most_running']} | {r['preemptions']} | {r['wall_s']:.1f} | "
            f"{r['new_tok_s']:.0f} | {r['peak_gib']:.1f} ({r['peak_beyond_gib']:.2f}) |",
            flush=True,
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS, help=f"RATE:BxCTX:BUDGET, comma-separated (default {CONFIGS})")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="prompt tokens prefilled per step (default 2048)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one RATE:BxCTX:BUDGET, its row as JSON
    args = ap.parse_args(argv)
    if args.one:  # the parent never touches the GPU: JAX would take most of its memory before the children start
        if not on_gpu():
            raise SystemExit("bench/capacity.py sizes the cache from a GPU's free memory")
        rate, shape, budget = args.one.split(":")
        batch, ctx = map(int, shape.split("x"))
        row = run_one(float(rate), batch, ctx, validate.parse_memory(budget), args.chunk_tokens)
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for config in args.configs.split(","):
        log(f"{config}")
        cmd = [sys.executable, "-m", "bench.capacity", "--one", config, "--chunk-tokens", str(args.chunk_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in out.stdout.splitlines() if line.startswith("ROW ")]
        if out.returncode or not lines:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{config} failed (exit {out.returncode})")
        rows.append(json.loads(lines[-1][4:]))
        print_rows(rows[-1:])
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=rows[0]["device"], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
