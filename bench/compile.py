"""Compile time of the attention kernels for a whole model (random Llama-3.1-8B rank plans, 32 layers, bf16): the
prefill kernel over every layer (one kernel shared by all layers, ``prefill_attention(shared=...)``), with and without
a cached prefix, and the decode op over every layer (a decode and a merge kernel for each group of layers that share
them, ``tables.kernel_groups``; ``--knob`` sets DecodeConfig fields such as ``kernel_classes``). Each is lowered and
compiled by XLA on its own, timed by the host. ``--kv-bits 4`` compiles the quantized decode op instead
(``QuantDecodeOp``: its groups from ``quant_kernel.kernel_groups`` under the same ``kernel_classes`` cap, a branch
per head class; ``--quant-knob`` sets QuantKernelConfig fields such as ``narrow_step_tokens``), so ``--layers 1``
times one layer's kernel. Tables: bench/results/startup.md "Engine: compile times", "Quantized pages: compile times"."""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import knob_option, log, on_gpu, rank_plan, with_knobs
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.quant_kernel import QUANT_DECODE, QUANT_KERNEL, QuantDecodeOp, head_classes
from kvjax.ops.decode.tables import kernel_groups, run_classes
from kvjax.ops.prefill.config import PREFILL
from kvjax.ops.prefill.kernel import prefill_attention
from kvjax.ops.prefill.work import tile_classes
from kvjax.ops.quant_paging import create_tail


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
    schedule = op.schedule(lengths)
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


def quant_decode_case(layouts, batch: int, ctx: int, bits: int, config, kernel, page_size: int = 32):
    """``decode_case`` for the quantized decode op over ``bits``-bit pages, and the op (its kernel groups)."""
    pps = -(-ctx // page_size)
    op = QuantDecodeOp(layouts, page_size, pps, bits=bits, max_batch=batch, config=config, kernel=kernel)
    lengths = np.full(batch, ctx, np.int32)
    rng = np.random.default_rng(0)
    pages = batch * pps + 1
    fmts = [op.formats[lay] for lay in layouts]
    args = (
        jnp.asarray(rng.standard_normal((batch, max(lay.q_cols for lay in layouts))), jnp.bfloat16),
        jnp.asarray(rng.integers(0, 60, (pages, max(f.page_bytes for f in fmts))), jnp.uint8),  # finite float16 meta
        create_tail(max(fmts, key=lambda f: f.k_cols + f.v_cols), batch, jnp.bfloat16),
        jnp.arange(1, pages, dtype=jnp.int32).reshape(batch, pps),
        jnp.asarray(lengths),
        op.schedule(lengths),
    )

    def run(q, pool, tail, table, lengths, schedule):
        total = 0.0
        for i, (lay, fmt) in enumerate(zip(layouts, fmts)):
            cols = fmt.k_cols + fmt.v_cols
            out = op.run(
                q[:, : lay.q_cols],
                pool[:, : fmt.page_bytes],
                tail[..., :cols],
                table,
                lengths,
                schedule.layer(i),
                lay,
            )
            total = total + out[0, 0].astype(jnp.float32)
        return total

    return run, args, op


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,0.5,0.7", help="compression rates, comma-separated (default 0,0.5,0.7)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model (default 32)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens (default 2048)")
    knob_option(ap)
    ap.add_argument("--decode-only", action="store_true", help="compile the decode op only")
    ap.add_argument("--kv-bits", type=int, choices=(4, 2), help="the quantized decode op over pages of these bits")
    ap.add_argument("--quant-knob", action="append", default=[], metavar="NAME=VALUE", help="a QuantKernelConfig field")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not on_gpu():
        raise SystemExit("bench/compile.py compiles the GPU kernels")
    if args.kv_bits:
        return quant_main(args)
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


def quant_main(args) -> None:
    """The quantized decode op's rows: its kernels, their head classes, and the compile time of every layer."""
    config = with_knobs(QUANT_DECODE, args.knob)
    kernel = with_knobs(QUANT_KERNEL, args.quant_knob)
    rows = []
    print("\n| rate | bits | layers | kernels (head classes) | decode s (32 x 2K) |\n|---|---|---|---|---|")
    for rate in map(float, args.rates.split(",")):
        layouts = rank_plan(rate, args.layers, config=config)
        run, dargs, op = quant_decode_case(layouts, 32, 2048, args.kv_bits, config, kernel)
        groups = set(op.groups.values())
        classes = sum(len({c for lay in g for c in head_classes(lay, args.kv_bits)}) for g in groups)
        # a kernel a class (classes_per_kernel 1) compiles once per class of a group; else one switch a group, at
        # most (a layer of more classes than the switch takes runs several)
        kernels = classes if kernel.classes_per_kernel == 1 else len(groups)
        dec = compile_seconds(run, *dargs)
        rows.append(
            dict(
                rate=rate,
                bits=args.kv_bits,
                layers=args.layers,
                decode_kernels=kernels,
                head_classes=classes,
                decode_s=dec,
                knobs=args.knob,
                quant_knobs=args.quant_knob,
            )
        )
        print(f"| {rate} | {args.kv_bits} | {args.layers} | {kernels} ({classes}) | {dec:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
