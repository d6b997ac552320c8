"""Compile time of the attention kernels for a whole model (random Llama-3.1-8B rank plans, 32 layers, bf16): the
prefill kernel over every layer (one kernel shared by all layers, ``prefill_attention(shared=...)``), with and without
a cached prefix, and the decode op over every layer (a decode and a merge kernel for each group of layers that share
them, ``tables.kernel_groups``; ``--knob`` sets DecodeConfig fields such as ``kernel_classes``). Each is lowered and
compiled by XLA on its own, timed by the host. Table: bench/RESULTS.md "Engine: compile times"."""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from harness import log, on_gpu, rank_plan, with_knobs

from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.tables import kernel_groups, run_classes
from kvjax.ops.prefill.config import PREFILL
from kvjax.ops.prefill.kernel import prefill_attention
from kvjax.ops.prefill.plan import tile_classes


def compile_seconds(fn, *args) -> float:
    """Seconds to trace, lower and compile ``fn`` for ``args`` (nothing cached before)."""
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0


def prefill_case(layouts, t: int, page_size: int = 16):
    """A function running the prefill kernel of every layer on one chunk of ``t`` tokens, and its arguments."""
    widest = max(layouts, key=lambda lay: lay.q_cols + lay.k_cols + lay.v_cols)
    rng = np.random.default_rng(0)
    pages = t // page_size + 1

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    args = (
        arr(1, t, widest.q_cols),
        arr(1, t, widest.k_cols),
        arr(1, t, widest.v_cols),
        arr(pages, page_size, widest.k_cols),
        arr(pages, page_size, widest.v_cols),
        jnp.arange(1, pages, dtype=jnp.int32)[None],
        jnp.full((1,), t, jnp.int32),
        jnp.full((1,), t, jnp.int32),
    )

    def run(q, k, v, kp, vp, table, lengths, starts, prefix):
        total = 0.0
        for lay in layouts:
            out, _, _ = prefill_attention(
                q[..., : lay.q_cols],
                k[..., : lay.k_cols],
                v[..., : lay.v_cols],
                lay,
                lengths,
                kp[..., : lay.k_cols],
                vp[..., : lay.v_cols],
                table,
                starts if prefix else None,
                shared=layouts,
            )
            total = total + out[0, 0, 0].astype(jnp.float32)
        return total

    return run, args


def decode_case(layouts, batch: int, ctx: int, page_size: int = 16, config=DECODE):
    """A function running the decode op of every layer for ``batch`` sequences of ``ctx`` tokens, and its arguments."""
    widest = max(layouts, key=lambda lay: lay.q_cols + lay.k_cols + lay.v_cols)
    pps = -(-ctx // page_size)
    op = DecodeOp(layouts, page_size, pps, max_batch=batch, config=config)
    lengths = np.full(batch, ctx, np.int32)
    schedule = op.plan(lengths)
    rng = np.random.default_rng(0)
    pages = batch * pps + 1
    args = (
        jnp.asarray(rng.standard_normal((batch, widest.q_cols)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((pages, page_size, widest.k_cols)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((pages, page_size, widest.v_cols)), jnp.bfloat16),
        jnp.arange(1, pages, dtype=jnp.int32).reshape(batch, pps),
        jnp.asarray(lengths),
        schedule,
    )

    def run(q, kp, vp, table, lengths, schedule):
        total = 0.0
        for i, lay in enumerate(layouts):
            out = op.run(
                q[:, : lay.q_cols], kp[..., : lay.k_cols], vp[..., : lay.v_cols], table, lengths, schedule.layer(i), lay
            )
            total = total + out[0, 0].astype(jnp.float32)
        return total

    return run, args


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,0.5,0.7", help="compression rates, comma-separated (default 0,0.5,0.7)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model (default 32)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens (default 2048)")
    ap.add_argument(
        "--knob", action="append", default=[], metavar="NAME=VALUE", help="a DecodeConfig field (repeatable)"
    )
    ap.add_argument("--decode-only", action="store_true", help="compile the decode op only")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not on_gpu():
        raise SystemExit("bench/compile.py compiles the GPU kernels")
    config = with_knobs(DECODE, args.knob)
    rows = []
    print(
        "\n| rate | width classes (prefill) | prefill s | prefill after a prefix s | decode kernels (run classes) | "
        "decode s (32 x 2K) |\n|---|---|---|---|---|---|"
    )
    for rate in map(float, args.rates.split(",")):
        layouts = rank_plan(rate, args.layers)
        pre = [float("nan")] * 2
        if not args.decode_only:
            run, pargs = prefill_case(layouts, args.chunk)
            pre = [compile_seconds(functools.partial(run, prefix=p), *pargs) for p in (False, True)]
            log(f"rate {rate}: prefill compiled")
        run, dargs = decode_case(layouts, 32, 2048, config=config)
        dec = compile_seconds(run, *dargs)
        classes = len(tile_classes(layouts, PREFILL.tile_widths))
        groups = set(kernel_groups(layouts, config).values())
        kernels, run_cls = len(groups), sum(len(run_classes(g, config)) for g in groups)
        rows.append(
            dict(
                rate=rate,
                layers=args.layers,
                classes=classes,
                prefill_s=pre[0],
                prefix_s=pre[1],
                decode_kernels=kernels,
                decode_classes=run_cls,
                decode_s=dec,
                knobs=args.knob,
            )
        )
        print(f"| {rate} | {classes} | {pre[0]:.1f} | {pre[1]:.1f} | {kernels} ({run_cls}) | {dec:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
