"""A ``kvjax-serve`` of random weights in a real model's shape, for bench/serve.py (speed needs no trained
weights): uncompressed, or compressed by ZACK or Palu to the widths of ``harness.rank_plan`` at a rate. Every method
gets the same KV memory (``--cache-memory`` bytes), so a compressed cache holds more sequences in it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax.numpy as jnp

from bench.engine import model_at
from bench.harness import LLAMA_8B, LLAMA_70B
from kvjax import validate
from kvjax.cli.options import eviction_arg
from kvjax.cli.serve import capacity_line
from kvjax.ops.quant import GROUP, PageFormat, check_bits
from kvjax.parallel.forward import device_layouts
from kvjax.runtime import compile_cache
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.engine import Engine
from kvjax.serving.api import create_app, server_config
from kvjax.serving.worker import Worker
from kvjax.validate import parse_memory

PAGE_SIZE = 16
SHAPES = {
    "llama-3.1-8b": LLAMA_8B,
    "llama-3.1-70b": LLAMA_70B,  # with --tensor-parallel: 141 GB of weights, never built whole
    "mistral-7b": dataclasses.replace(
        LLAMA_8B, arch="mistral", vocab_size=32000, rope_theta=1e6, max_position_embeddings=32768
    ),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--method", choices=("none", "zack", "palu"), default="zack")
    ap.add_argument("--rate", type=float, default=0.5, help="compression rate (ignored for --method none)")
    ap.add_argument(
        "--plan",
        choices=("ordered", "uniform"),
        default="ordered",
        help="head widths: per head and layer as harness.rank_plan draws them (default), or one width for every "
        "head (Palu's own setting, where its kernel runs fastest: bench/results/kernels.md \"Palu's decode kernel\")",
    )
    ap.add_argument("--layers", type=int, help="keep only this many layers (smoke runs on the CPU)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument(
        "--prefill-min-tokens",
        type=int,
        default=512,
        help="shortest padded prefill call (default 512: with one row a call, 7 step shapes to compile)",
    )
    ap.add_argument("--prefill-max-rows", type=int, default=1, help="most chunks a prefill call holds (default 1)")
    ap.add_argument(
        "--no-compile-ahead", action="store_true", help="compile steps as requests need them (default: all first)"
    )
    ap.add_argument("--cache-memory", default="40GiB", help="KV cache bytes, the same for every method (default 40GiB)")
    ap.add_argument(
        "--kv-bits",
        type=validate.arg(check_bits, int),
        default=None,
        help="quantized pages of 4 or 2 bits (of quant.GROUP tokens), on top of --method (default: bf16 pages)",
    )
    ap.add_argument(
        "--evict",
        type=eviction_arg,
        default=None,
        metavar="METHOD:AMOUNT",
        help="evict each prompt once prefilled (kvjax-serve --evict, e.g. kvcompress:4x), on top of --method; the "
        "staging pages (two whole --max-seq-len prompts) come out of --cache-memory and the per-head pages get the "
        "rest (default none)",
    )
    ap.add_argument(
        "--tensor-parallel",
        type=validate.arg(lambda v: validate.positive("--tensor-parallel", v), int),
        default=1,
        help="split the model over this many GPUs (random shares drawn on each; --cache-memory is a device's)",
    )
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="share no pages between identical prefixes (kvjax-serve --no-prefix-caching; default: shared)",
    )
    ap.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|off",
        help="JAX's persistent compilation cache, as kvjax-serve keeps it (default: $KVJAX_COMPILE_CACHE, else "
        "~/.cache/kvjax/jax)",
    )
    args = ap.parse_args(argv)
    try:
        where = compile_cache.use(args.compile_cache)
    except ValueError as e:
        ap.error(f"--compile-cache: {e}")
    print(f"compile cache {where or 'off'}", file=sys.stderr, flush=True)
    if args.tensor_parallel > 1 and args.evict:
        ap.error(
            "--evict is not served under --tensor-parallel by this bench yet (its per-head budget is one device's)"
        )
    budget = parse_memory(args.cache_memory)
    if not isinstance(budget, int):
        ap.error(
            f"--cache-memory must be a size such as 40GiB (the same bytes for every method), got {args.cache_memory!r}"
        )
    import uvicorn

    rate = 0.0 if args.method == "none" else args.rate
    shape = (
        SHAPES[args.shape] if args.layers is None else dataclasses.replace(SHAPES[args.shape], num_layers=args.layers)
    )
    n = args.tensor_parallel
    t0 = time.perf_counter()
    model = model_at(rate, shape, form=args.plan, method=args.method if rate else "zack", shapes_only=n > 1)
    # the cache itself gets the budget (not the budget less each method's activation reserve), so every method's
    # K/V bytes are the same
    page = GROUP if args.kv_bits else PAGE_SIZE
    if args.evict and args.kv_bits:
        ap.error("--evict does not stack with --kv-bits yet (the engine refuses it)")
    layouts = model.layouts if n == 1 else device_layouts(model.layouts, n)[2]  # what a device's pages hold
    num_pages = budget // _page_bytes(layouts, model.dtype, page, args.kv_bits)
    num_pages = num_pages if not args.evict else _head_pages(model, args, budget)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        page_size=page,
        kv_bits=args.kv_bits,
        chunk_tokens=args.chunk_tokens,
        num_pages=num_pages,
        prefill_min_tokens=args.prefill_min_tokens,
        prefill_max_rows=args.prefill_max_rows,
        eviction=args.evict,
        tensor_parallel=n,
        prefix_caching=False if args.no_prefix_caching else None,
    )
    print(f"random weights and engine built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.evict and (pages := engine.cache.staging.nbytes + engine.cache.heads.pool.nbytes) > budget:
        ap.error(f"the staging and per-head pages take {pages:,} bytes, more than --cache-memory ({budget:,})")
    if not args.no_compile_ahead:  # no request of the sweep waits for a compile
        t0 = time.perf_counter()
        cores = os.cpu_count() or 1
        steps = engine.compile_ahead(greedy=(True,), threads=cores, progress=True, processes=cores)
        kept = sum(getattr(step, "stored", False) for step in engine._compiled.values())
        took = time.perf_counter() - t0
        print(
            f"compiled {steps} steps ahead in {took:.0f} s ({kept} through the step store)", file=sys.stderr, flush=True
        )
    worker = Worker(engine).start()
    name = (
        f"{args.shape}-{args.method}" + (f"-{rate:g}" if rate else "") + (f"-int{args.kv_bits}" if args.kv_bits else "")
    )
    name += "-uniform" if rate and args.plan == "uniform" else ""
    name += f"-{args.evict.name.replace(':', '-')}" if args.evict else ""
    name += f"-tp{n}" if n > 1 else ""
    name += "-no-prefix" if args.no_prefix_caching else ""
    print(capacity_line(engine, model), file=sys.stderr, flush=True)
    print(f"serving {name!r} on http://127.0.0.1:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(
            server_config(create_app(worker, model, name), "127.0.0.1", args.port, log_level="warning")
        ).run()
    finally:
        worker.stop()
    return 0


def _page_bytes(layouts, dtype, page: int, kv_bits) -> int:
    """Bytes of one whole-context page: every byte of a quantized page (codes, scales, zeros, padding), the tails
    aside, or ``page`` tokens at the ``layouts``' widths."""
    if kv_bits:
        return sum(PageFormat.for_layout(lay, page, kv_bits).page_bytes for lay in layouts)
    return page * bytes_per_token(layouts, dtype)


def _head_pages(model, args, budget: int) -> int:
    """An evicting engine's per-head pages in ``budget`` once its staging pool (``Engine._evicting_pages``: two whole
    ``max_seq_len`` prompts and the null page) is taken out; a page holds ``PAGE_SIZE`` tokens of the widest head
    (``Engine._eviction_setup``). The engine's cache bytes are checked against the budget after it is built."""
    staging = (2 * -(-args.max_seq_len // PAGE_SIZE) + 1) * _page_bytes(model.layouts, model.dtype, PAGE_SIZE, None)
    widest = max(k + v for lay in model.layouts for k, v in zip(lay.k_widths, lay.v_widths))
    return (budget - staging) // (PAGE_SIZE * widest * jnp.dtype(model.dtype).itemsize)


if __name__ == "__main__":
    sys.exit(main())
