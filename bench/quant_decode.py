"""Decode attention over quantized pages, measured beside the kernels it must beat: one layer of the random Llama-3.1-8B
attention shape (32 query heads, 8 KV heads of 128) at ``--shape`` (default B32 x 8K), per rank rate
(``harness.rank_plan``'s representative layer) the bf16 kernel (``ops.decode.kernel``) and the fused quantized one
(``ops.decode.quant_kernel``) at each ``--bits``, and at rate 0 JAX's Pallas ``paged_attention`` on bf16 pages and on
int8 pages with a scale per token (its own quantized form). Every row: CUPTI time, the floor (the bytes the call must
read over the measured copy bandwidth: every byte of a quantized page, codes, scales, zeros and padding), their ratio,
and the speed-up over bf16 at the same rate; every output is first checked against its jnp reference. Issue 35's
targets: int4 at rate 0 >= 3.0x bf16 at rate 0, int4 at rate 0.5 >= 2.8x bf16 at rate 0.5, every quantized row at >= 80%
of copy bandwidth. ``--widths`` adds layers of one head width each (one head class: a class's own speed); ``--packed``
reads runs of adjacent heads as one unit; ``--one-schedule`` plans a layer's class kernels as one (the ablation).
``--gear NAME`` adds GEAR's decode kernel (``ops.decode.gear_kernel``) over pages of that scheme.
``--interpret --timer host --shape 2x256`` runs the same rows on a CPU (plumbing only: its times mean nothing).
Tables: bench/results/quantization.md "Quantized pages: decode kernel"."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.files import write_json
from bench.harness import (
    HKV,
    HQ,
    D,
    PagedCase,
    copy_bandwidth,
    knob_option,
    log,
    pick_layer,
    queries,
    rank_plan,
    rates_arg,
    shape_arg,
)
from kvjax import validate
from kvjax.ops import kv_schemes
from kvjax.ops.decode.gear_kernel import gear_paged_decode
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.quant_kernel import (
    QUANT_DECODE,
    QUANT_KERNEL,
    plan_config,
    quantized_paged_decode,
    unit_kernels,
)
from kvjax.ops.decode.reference import paged_decode_attention, quantized_decode_attention
from kvjax.ops.decode.schedule import build_decode_schedule
from kvjax.ops.quant import PageFormat, check_bits
from kvjax.ops.quant_paging import create_tail

PAGE = 32


def quantized_case(case: PagedCase, bits: int):
    """The case's pages encoded in ``bits`` (every page, so rotated copies stay disjoint) and an empty tail."""
    fmt = PageFormat.for_layout(case.layout, case.page_size, bits)
    pages = jax.jit(fmt.encode)(case.k, case.v)
    return fmt, pages, create_tail(fmt, case.batch, case.k.dtype)


def quant_bytes(case: PagedCase, fmt: PageFormat) -> int:
    """Bytes the quantized call must read: every full page's bytes, the tail's tokens, q and out."""
    lay, p = case.layout, case.page_size
    full = case.lengths // p
    tail = (case.lengths - full * p).sum() * (lay.k_cols + lay.v_cols) * 2
    return int(full.sum() * fmt.page_bytes + tail + case.batch * (lay.q_cols + lay.out_cols) * 2)


def calls(
    case: PagedCase, bits_list, key, kernel, interpret: bool, packed: bool = False, by_class: bool = True
) -> dict:
    """name -> (fn, shared, per_call, bytes, reference) for every row of the case; ``by_class``: the quantized
    schedule planned a class kernel at a time (as ``QuantDecodeOp`` plans it)."""
    lay, lengths = case.layout, jnp.asarray(case.lengths)
    qs = queries(key, (case.batch, lay.q_cols))
    tables = [case.tables[u % case.tables.shape[0]] for u in range(len(qs))]
    out = {}
    plain = build_decode_schedule(case.lengths, lay, case.page_size).schedule.layer(0)

    def bf16(k, v, lengths, s, q, table):
        return paged_decode(q, k, v, table, lengths, s, lay, interpret=interpret)

    def bf16_ref(q, table):
        f32 = jnp.float32
        return paged_decode_attention(q.astype(f32), case.k.astype(f32), case.v.astype(f32), table, lengths, lay)

    per_call = [(q, t) for (q,), t in zip(qs, tables)]
    out["kvjax bf16"] = (bf16, (case.k, case.v, lengths, plain), per_call, case.bytes, bf16_ref)
    for bits in bits_list:
        config = plan_config(QUANT_DECODE, bits, packed)
        classes = [unit_kernels(lay, bits, config, kernel.classes_per_kernel)] if by_class else None
        sched = build_decode_schedule(case.lengths, lay, case.page_size, config=config, classes=classes)
        sched = sched.schedule.layer(0)
        fmt, pages, tail = quantized_case(case, bits)

        def fused(pages, tail, lengths, s, q, table, fmt=fmt):
            return quantized_paged_decode(
                q, pages, tail, table, lengths, s, lay, fmt, kernel=kernel, interpret=interpret
            )

        def fused_ref(q, table, fmt=fmt, pages=pages, tail=tail):
            return quantized_decode_attention(q.astype(jnp.float32), pages, tail, fmt, table, lengths, lay)

        out[f"kvjax int{bits}"] = (fused, (pages, tail, lengths, sched), per_call, quant_bytes(case, fmt), fused_ref)
    return out


def gear_rows(case: PagedCase, names, key, interpret: bool) -> dict:
    """A row per GEAR scheme name (``kv_schemes.parse``: ``gear2-r1-o0.01-p128`` ...): GEAR's decode kernel
    (``ops.decode.gear_kernel``) over the layer's K and V encoded as GEAR pages of the name's page size (a case of
    its own pages, fresh random K and V of the same shape)."""
    lay, out = case.layout, {}
    lengths = jnp.asarray(case.lengths)
    qs = queries(key, (case.batch, lay.q_cols))
    for name in names:
        fmt = kv_schemes.page_format(name, lay, kv_schemes.page_of(name) or PAGE)
        own = PagedCase(lay, case.batch, case.lengths, fmt.page_size, case.tables.shape[0], key)
        pages = jax.jit(fmt.encode)(own.k, own.v)
        tail = create_tail(fmt, own.batch, own.k.dtype)
        del own.k, own.v
        tables = [own.tables[u % own.tables.shape[0]] for u in range(len(qs))]

        def fused(pages, tail, lengths, q, table, fmt=fmt):
            return gear_paged_decode(q, pages, tail, table, lengths, lay, fmt, interpret=interpret)

        def fused_ref(q, table, fmt=fmt, pages=pages, tail=tail):
            return quantized_decode_attention(q.astype(jnp.float32), pages, tail, fmt, table, lengths, lay)

        per_call = [(q, t) for (q,), t in zip(qs, tables)]
        out[f"kvjax {name}"] = (fused, (pages, tail, lengths), per_call, quant_bytes(own, fmt), fused_ref)
    return out


def jax_rows(case: PagedCase, key, interpret: bool) -> dict:
    """JAX's Pallas ``paged_attention`` on the uncompressed layer: bf16 pages, and int8 pages with a float32 scale
    per token and head (its quantized form), head-major pools as it wants them."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    n, p = case.k.shape[:2]
    k = case.k.reshape(n, p, HKV, D).transpose(2, 0, 1, 3)
    v = case.v.reshape(n, p, HKV, D).transpose(2, 0, 1, 3)
    lengths = jnp.asarray(case.lengths)
    qs = queries(key, (case.batch, HQ, D))
    per_call = [(q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(qs)]

    def int8(x):
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
        codes = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)[..., None]).astype(jnp.int8)
        return codes, scale

    (k8, ks), (v8, vs) = int8(k), int8(v)
    pps = case.tables.shape[2]
    splits = max(s for s in (1, 2, 4, 8, 16) if pps % s == 0)  # it needs pages a sequence divisible by its splits
    block = max(b for b in (1, 2, 4) if (pps // splits) % b == 0)
    opts = dict(pages_per_compute_block=block, k_splits=splits, interpret=interpret)

    def plain(k, v, lengths, q, table):
        return paged_attention(q, k, v, table, lengths, **opts)

    def quantized(k, v, ks, vs, lengths, q, table):
        return paged_attention(q, k, v, table, lengths, k_scales_pages=ks, v_scales_pages=vs, **opts)

    meta = case.batch * 2 * HQ * D * 2
    int8_bytes = int(case.lengths.sum()) * HKV * 2 * (D + 4) + meta
    return {
        "jax paged_attention bf16": (plain, (k, v, lengths), per_call, case.bytes, None),
        "jax paged_attention int8": (quantized, (k8, v8, ks, vs, lengths), per_call, int8_bytes, None),
    }


def kernel_times(fn, shared, per_call) -> dict | None:
    """Microseconds a call by kernel name (CUPTI, one batched run after a warm one; the quantized op names a kernel
    by the head classes it runs, ``quant_kernel.kernel_name``); None off the CUPTI timer."""
    if harness.TIMER["name"] != "cupti":
        return None
    f = harness.batched(fn)
    jax.block_until_ready(f(shared, per_call))
    by_name: dict[str, float] = {}
    for name, ms in harness.cupti_kernels(lambda: jax.block_until_ready(f(shared, per_call))):
        key = name.removeprefix("kvjax_quantized_decode_")
        by_name[key] = by_name.get(key, 0.0) + ms * 1e3 / len(per_call)
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def check(name, fn, shared, per_call, reference, layout) -> float:
    """Largest error of the first call against its float32 reference, relative to the output's largest entry (bf16
    inputs and outputs: a few 1e-3 is rounding)."""
    if reference is None:
        return float("nan")
    got = jnp.asarray(fn(*shared, *per_call[0]), jnp.float32)
    want = jnp.asarray(reference(*per_call[0]), jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-6))
    if not err < 2e-2:
        raise AssertionError(f"{name}: relative error {err:.3g} against its reference")
    return err


def run(args) -> dict:
    bandwidth = copy_bandwidth() if not args.interpret else 1e12
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    batch, ctx = args.shape
    key = jax.random.key(args.seed)
    rows = []
    print(
        "\n| rate | kernel | K+V cols | time us | floor us | % of copy bw | vs bf16 at the rate | max rel err |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    result = dict(
        device=jax.devices()[0].device_kind,
        bandwidth=bandwidth,
        shape=[batch, ctx],
        timer=harness.TIMER["name"],
        kernel=dataclasses.asdict(args.kernel),
        rows=rows,
        complete=False,
    )
    layers = [(rate, pick_layer(rank_plan(rate), rate)) for rate in args.rates]
    layers += [(f"u{w}", harness.uniform(w)) for w in args.widths]  # one head class each: a class's own speed
    for rate, lay in layers:
        case = PagedCase(lay, batch, np.full(batch, ctx), PAGE, harness.copies_for(batch * ctx * 4 * HKV * D), key)
        row_calls = calls(case, args.bits, key, args.kernel, args.interpret, args.packed, not args.one_schedule)
        row_calls |= gear_rows(case, args.gear, key, args.interpret)
        if rate == 0:
            row_calls |= jax_rows(case, key, args.interpret)
        base = None
        for name, (fn, shared, per_call, nbytes, reference) in row_calls.items():
            err = check(name, fn, shared, per_call, reference, lay)
            t = harness.time_calls(fn, shared, per_call)
            base = t if name == "kvjax bf16" else base
            floor = nbytes / bandwidth
            rows.append(
                dict(
                    rate=rate,
                    kernel=name,
                    widths=f"{lay.k_cols}+{lay.v_cols}",
                    time_us=t * 1e6,
                    floor_us=floor * 1e6,
                    pct_of_copy=100 * floor / t,
                    speedup=base / t if name.startswith("kvjax") else None,
                    max_rel_err=err,
                    bytes=nbytes,
                    kernels=kernel_times(fn, shared, per_call)
                    if name.startswith(("kvjax int", "kvjax gear"))
                    else None,
                )
            )
            r = rows[-1]
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            print(
                f"| {rate} | {name} | {r['widths']} | {r['time_us']:.0f} | {r['floor_us']:.0f} | "
                f"{r['pct_of_copy']:.0f}% | {speed} | {err:.2g} |",
                flush=True,
            )
            if r["kernels"]:
                log("its kernels, us a call: " + ", ".join(f"{k} {us:.0f}" for k, us in r["kernels"].items()))
            if args.json:  # after every row: a run killed by a device call's limit keeps what it measured
                write_json(args.json, result, indent=1)
        del row_calls, case
    result["complete"] = True
    return result


def _gear(name: str) -> str:
    """A ``--gear`` entry: a GEAR scheme's canonical name (``kv_schemes.served``), else a one-line error."""
    served = kv_schemes.served(name)
    if not str(served).startswith("gear"):
        raise ValueError(f"--gear takes a GEAR scheme such as gear2-r1-o0.01-p128, got {name!r}")
    return served


def _width(width: int) -> int:
    """A ``--widths`` entry: the kernels read heads in multiples of 16 columns, at most the head's 128."""
    if width % 16 or not 16 <= width <= D:
        raise ValueError(f"a width must be a multiple of 16 in [16, {D}], got {width}")
    return width


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=shape_arg("--shape"), default=(32, 8192), help="BxCTX (default 32x8192)")
    ap.add_argument(
        "--rates",
        type=lambda text: rates_arg()(text) if text else [],
        default=[0.0, 0.5],
        help="rank rates, comma-separated (default 0,0.5; empty for --widths alone)",
    )
    ap.add_argument(
        "--bits",
        type=validate.arg(lambda text: [check_bits(int(b)) for b in text.split(",")]),
        default=[4, 2],
        help="code widths, comma-separated (default 4,2)",
    )
    ap.add_argument(
        "--gear",
        action="append",
        default=[],
        type=validate.arg(_gear),
        metavar="NAME",
        help="also: GEAR's decode kernel over pages of this scheme (repeatable), e.g. gear2-r1-o0.01-p128",
    )
    knob_option(ap, "a QuantKernelConfig field, e.g. num_warps=2")
    ap.add_argument(
        "--widths",
        type=validate.arg(lambda text: [_width(int(w)) for w in text.split(",") if w]),
        default=[],
        help="also: a layer of every K and V head this wide (rows u<width>), per width, comma-separated",
    )
    ap.add_argument(
        "--packed",
        action="store_true",
        help="plan runs of adjacent heads as one unit (quant_kernel.plan_config)",
    )
    ap.add_argument(
        "--one-schedule",
        action="store_true",
        help="plan the quantized layer as one, not a class kernel at a time (the ablation: each class kernel then "
        "idles the programs holding none of its items)",
    )
    harness.timer_option(ap)
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here (after every row; 'complete' false until the last)")
    args = ap.parse_args(argv)
    if not args.rates and not args.widths:
        ap.error("nothing to measure: give --rates or --widths")
    args.kernel = harness.with_knobs(QUANT_KERNEL, args.knob)
    harness.TIMER["name"] = args.timer
    result = run(args)
    if args.json:
        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
