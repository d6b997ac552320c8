"""Palu's fused decode kernel (``kvjax.ops.palu.palu_decode``) measured on one representative layer of the rate-0.5
plan of the Llama-3.1-8B shape: checked against the jnp reference, then timed (CUPTI) at its knobs (tokens a step,
warps, pipeline stages, splits), beside the floor (the latent K and V bytes over the copy bandwidth), ZACK's decode
kernel on the same widths (with ``--bands``, also banded ZACK's: the same kernel projecting each query once a band,
beside plain ZACK with the banded config's folds, which separates the two costs; with ``--query-knobs``, the band
queries' kernel alone), and Palu's decode as XLA fuses the jnp form. Tables: bench/results/kernels.md "Palu's
decode kernel", "Banded decode kernel"."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.baselines import palu_decode_call
from bench.decode import kvjax_decode_call, schedule_of
from bench.harness import (
    HKV,
    D,
    PagedCase,
    batched,
    copies_for,
    copy_bandwidth,
    cupti_kernels,
    knob_option,
    log,
    on_gpu,
    pick_layer,
    rank_plan,
    rel_err,
    time_calls,
    with_knobs,
)
from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.models.latent import LatentK
from kvjax.models.rope import inverse_frequencies
from kvjax.ops.decode.bands import band_queries, band_queries_reference
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.op import banded_config
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.palu import TARGET_PROGRAMS, default_splits, palu_decode


def palu_kernel_call(case, rebuild, key, **knobs):
    """(fn, shared, per_call) for ``time_calls``: ``palu_decode`` on the case's pages, fresh queries, rotating pages."""
    lay, lengths = case.layout, jnp.asarray(case.lengths)
    up = rebuild.up

    def fn(k, v, lengths, up, q, table):
        return palu_decode(q, k, v, table, lengths, up, rebuild.inv_freq, lay, **knobs)

    return fn, (case.k, case.v, lengths, up), head_queries(case, key)


def head_queries(case, key) -> list[tuple]:
    """``time_calls``'s per-call inputs: fresh whole-head queries [B, H * d] (bf16), each with a rotating page set."""
    shape = (case.batch, case.layout.num_heads * D)
    qs = [jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key, 8)]
    return [(q, case.tables[u % case.tables.shape[0]]) for u, q in enumerate(qs)]


def banded_call(case, rebuild, sched, key):
    """(fn, shared, per_call) for ``time_calls``: ``paged_decode`` of banded keys (``rebuild.band``) with ``sched``,
    fresh whole-head queries, rotating pages."""
    lay, lengths = case.layout, jnp.asarray(case.lengths)

    def fn(k, v, lengths, s, basis, q, table):
        return paged_decode(q, k, v, table, lengths, s, lay, basis=basis, inv_freq=rebuild.inv_freq, band=rebuild.band)

    return fn, (case.k, case.v, lengths, sched, rebuild.basis()), head_queries(case, key)


def kernel_shares(fn, shared, per_call) -> str:
    """Each kernel's microseconds a call of ``time_calls``' batched ``fn`` (CUPTI), the largest first."""
    f = batched(fn)
    jax.block_until_ready(f(shared, per_call))
    by_name: collections.Counter = collections.Counter()
    for name, ms in cupti_kernels(lambda: jax.block_until_ready(f(shared, per_call))):
        by_name[name] += ms * 1e3 / len(per_call)
    return ", ".join(f"{name} {us:.0f}" for name, us in by_name.most_common())


def check_banded(case, rebuild, sched) -> float:
    """Relative error of the banded kernel against the float32 reference with the same rebuild."""
    fn, shared, per_call = banded_call(case, rebuild, sched, jax.random.key(1))
    q, table = per_call[0]
    return reference_error(case, rebuild, q, table, fn(*shared, q, table))


def reference_error(case, rebuild, q, table, out) -> float:
    """Relative error of a kernel's ``out`` for ``q`` on the pages of ``table`` against the float32 reference with
    ``rebuild`` (its ``up`` in float32)."""
    exact = dataclasses.replace(rebuild, up=tuple(u.astype(jnp.float32) for u in rebuild.up))
    f32 = jnp.float32
    with jax.default_matmul_precision("highest"):
        ref = paged_decode_attention(
            q.astype(f32), case.k.astype(f32), case.v.astype(f32), table, jnp.asarray(case.lengths), case.layout, exact
        )
    return rel_err(out, ref)


def latent_of(layout, key) -> LatentK:
    """Random ``up`` per head for ``layout`` (Llama-3.1's RoPE base)."""
    keys = jax.random.split(key, layout.num_kv_heads)
    up = tuple(
        (jax.random.normal(k, (w, D), jnp.float32) / np.sqrt(w)).astype(jnp.bfloat16)
        for k, w in zip(keys, layout.k_widths)
    )
    return LatentK(up, inverse_frequencies(D, 500000.0, {}), layout)


def check(case, rebuild, **knobs) -> float:
    """Relative error of the kernel against the float32 reference on the case's first page set."""
    q = jax.random.normal(jax.random.key(1), (case.batch, case.layout.num_heads * D), jnp.bfloat16)
    table, lengths = case.tables[0], jnp.asarray(case.lengths)
    up = rebuild.up
    out = palu_decode(q, case.k, case.v, table, lengths, up, rebuild.inv_freq, case.layout, **knobs)
    return reference_error(case, rebuild, q, table, out)


def palu_rows(args, case, rebuild, key, row) -> None:
    """Palu's kernel at every combination of the knobs' lists, each checked then timed (a ``row`` each)."""
    grid = itertools.product(*(map(int, x.split(",")) for x in (args.steps, args.warps, args.stages, args.targets)))
    for step, warps, stages, target in grid:
        splits = default_splits(case.batch, case.layout.num_kv_heads, target)
        knobs = dict(step=step, num_warps=warps, num_stages=stages, splits=splits, target_programs=target)
        try:
            err = check(case, rebuild, **knobs)
            t = time_calls(*palu_kernel_call(case, rebuild, key, **knobs))
        except Exception as e:  # a variant the GPU cannot run (shared memory, registers): reported, skipped
            log(f"{knobs}: {type(e).__name__}: {str(e)[:200]}")
            continue
        row("palu (Pallas)", " ".join(f"{k}={v}" for k, v in knobs.items()), t, err)


def query_knobs(text: str) -> list[tuple[int, int, int, int, int]]:
    """``--query-knobs``: comma-separated BLOCK:PIECE:WARPS[:BLOCKS[:SEQS]], each a positive integer (BLOCKS and
    SEQS: 1 when left out); a ValueError names a bad one."""
    out = []
    for spec in filter(None, text.split(",")):
        parts = spec.split(":")
        if not 3 <= len(parts) <= 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"expected BLOCK:PIECE:WARPS[:BLOCKS[:SEQS]] of positive integers, got {spec!r}")
        out.append(tuple(map(int, parts + ["1"] * (5 - len(parts)))))
    return out


def band_query_rows(args, case, rebuild, band: int, key, row, bandwidth: float) -> None:
    """Banded ZACK's band queries alone (``bands.band_queries``) at each of ``--query-knobs``' variants and as one
    XLA GEMM, each checked against the float32 product and timed (CUPTI) beside its floor (the queries' bytes
    written, over the copy bandwidth)."""
    lay, lengths = case.layout, jnp.asarray(case.lengths)
    ctx = int(max(case.lengths))
    bands = -(-ctx // band)
    basis, inv_freq = rebuild.basis(), rebuild.inv_freq
    per_call = [(q,) for q, _ in head_queries(case, key)]
    with jax.default_matmul_precision("highest"):
        f32 = jnp.float32
        exact = band_queries_reference(per_call[0][0].astype(f32), basis.astype(f32), inv_freq, band, lay, bands)
    at = (case.batch, ctx, bands * case.batch * lay.q_cols * 2 / bandwidth, f"band {band} queries")

    def reference(basis, lengths, q):
        return band_queries_reference(q, basis, inv_freq, band, lay, bands)

    variants = [("band queries (XLA GEMM)", "", reference)]
    for block, piece, warps, blocks, seqs in args.query_knobs:
        knobs = dict(block=block, piece=piece, num_warps=warps)
        knobs |= {k: v for k, v in (("blocks", blocks), ("seqs", seqs)) if v > 1}  # the base form takes neither

        def kernel(basis, lengths, q, knobs=knobs):
            return band_queries(q, basis, inv_freq, band, lay, bands, lengths=lengths, **knobs)

        variants.append(("band queries (Pallas)", " ".join(f"{k}={v}" for k, v in knobs.items()), kernel))
    for name, knobs, fn in variants:
        try:
            err = rel_err(fn(basis, lengths, *per_call[0]), exact)
            t = time_calls(fn, (basis, lengths), per_call)
        except Exception as e:  # a variant the GPU cannot run (shared memory, registers): reported, skipped
            log(f"{name} {knobs}: {type(e).__name__}: {str(e)[:200]}")
            continue
        row(name, knobs, t, err, at=at)


def banded_rows(args, case, rebuild, key, row, bandwidth: float) -> None:
    """At each of ``--bands``: plain ZACK's kernel with the banded config's folds, banded ZACK's decode (checked,
    timed, with ``--breakdown`` its kernels' shares) and, with ``--query-knobs``, its band queries alone."""
    for band in [int(b) for b in args.bands.split(",") if b]:
        config = banded_config(args.config, band)
        sched = schedule_of(case, config).schedule.layer(0)
        knobs = f"fold_tokens={config.fold_tokens}"
        row("zack (Pallas)", knobs, time_calls(*kvjax_decode_call(case, sched, key)))
        banded = dataclasses.replace(rebuild, band=band)
        err = check_banded(case, banded, sched)
        call = banded_call(case, banded, sched, key)
        row(f"zack banded {band} (Pallas)", knobs, time_calls(*call), err)
        if args.breakdown:
            log(f"band {band}, us a call: {kernel_shares(*call)}")
        if args.query_knobs:
            band_query_rows(args, case, banded, band, key, row, bandwidth)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="32x2048,32x8192,8x32768", help="BxCTX, comma-separated")
    ap.add_argument("--rate", type=float, default=0.5, help="the plan's rate (default 0.5)")
    ap.add_argument("--steps", default="16,32", help="tokens a loop step, comma-separated (default 16,32)")
    ap.add_argument("--warps", default="2,4", help="warps, comma-separated (default 2,4)")
    ap.add_argument("--stages", default="2", help="pipeline stages, comma-separated (default 2)")
    ap.add_argument(
        "--targets",
        default=str(TARGET_PROGRAMS),
        help=f"programs Palu's splits aim at, comma-separated (default {TARGET_PROGRAMS})",
    )
    ap.add_argument(
        "--breakdown", action="store_true", help="with --bands: also each kernel's share of a banded call (CUPTI)"
    )
    ap.add_argument("--uniform", action="store_true", help="also every head at the plan's mean widths (Palu's own)")
    ap.add_argument(
        "--bands", default="", help="also banded ZACK's decode at these bands, comma-separated (e.g. 16,32,64)"
    )
    ap.add_argument("--no-palu", action="store_true", help="skip Palu's kernel (with --bands: banded against plain)")
    ap.add_argument(
        "--query-knobs",
        type=validate.arg(query_knobs),
        default=[],
        help="with --bands: also the band queries alone, at these BLOCK:PIECE:WARPS[:BLOCKS[:SEQS]] variants of "
        "their kernel (comma-separated, e.g. 64:32:4,32:128:4:4:2; BLOCKS: blocks of bands a program, SEQS: "
        "sequences a program, default 1 each), beside the XLA GEMM",
    )
    knob_option(ap, "a DecodeConfig field for --bands")
    harness.timer_option(ap)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.timer == "host" and args.breakdown:
        ap.error("--breakdown reads each kernel's time from CUPTI: use it with --timer cupti")
    harness.TIMER["name"] = args.timer
    args.config = with_knobs(DECODE, args.knob)
    if not on_gpu():
        raise SystemExit("bench/palu.py times the kernel on a GPU")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    planned = pick_layer(rank_plan(args.rate), args.rate)
    layouts = {"plan": planned}
    if args.uniform:  # Palu's own setting: one rank for every head, the same columns in all
        k, v = (16 * round(cols / HKV / 16) for cols in (planned.k_cols, planned.v_cols))
        layouts["uniform"] = HeadLayout(planned.num_heads, HKV, D, (k,) * HKV, (v,) * HKV)
    rows = []
    print(
        "\n| B x ctx | widths | kernel | knobs | us | floor us | % of floor | rel. err |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for shape, (name, lay) in itertools.product(args.shapes.split(","), layouts.items()):
        batch, ctx = map(int, shape.split("x"))
        rebuild = latent_of(lay, jax.random.key(2))
        key = jax.random.key(batch * ctx)
        per_copy = batch * ctx * (lay.k_cols + lay.v_cols) * 2
        case = PagedCase(lay, batch, [ctx] * batch, 16, copies_for(per_copy), key)
        floor = case.bytes / bw
        widths = f"{name} {lay.k_cols}+{lay.v_cols}"

        def row(kernel, knobs, t, err=None, at=(batch, ctx, floor, widths)):
            b, c, fl, w = at
            rows.append(dict(batch=b, ctx=c, widths=w, kernel=kernel, knobs=knobs, us=t * 1e6, floor_us=fl * 1e6))
            rows[-1]["rel_err"] = err
            e = "" if err is None else f"{err:.1e}"
            print(
                f"| {b} x {c} | {w} | {kernel} | {knobs} | {t * 1e6:.0f} | {fl * 1e6:.0f} | {100 * fl / t:.0f}% | {e} |"
            )

        if not args.no_palu:
            palu_rows(args, case, rebuild, key, row)
        t = time_calls(*kvjax_decode_call(case, schedule_of(case, DECODE).schedule.layer(0), key))
        row("zack (Pallas)", "defaults", t)
        banded_rows(args, case, rebuild, key, row, bw)
        if name == "uniform":
            fn, shared, per_call, _, r, rv = palu_decode_call(case, lay, key)
            row("palu (XLA, jnp)", "", time_calls(fn, shared, per_call))
        del case
    if args.json:
        with open(args.json, "w") as f:
            layouts = {name: str(lay) for name, lay in layouts.items()}
            json.dump(dict(device=jax.devices()[0].device_kind, bandwidth=bw, layouts=layouts, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
