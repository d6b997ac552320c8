"""The decode kernel (``kvjax.ops.decode.kernel.paged_decode``) measured: its correctness against the jnp reference
on every shape class, its time beside the floor (bytes it must read over the copy bandwidth) and beside the
baselines, a sweep of ``DecodeConfig`` variants per rank plan (autotune), bandwidth by head width, and the
rate-0.5 layer as one launch per width class. Every schedule is built with the config the kernel then runs with (the
kernel reads its knobs from ``schedule.config``). Tables: bench/results/kernels.md "Decode kernel: time beside the
floor", "Decode schedule: unit costs", "Decode: run width and pieces" and "Kernel correctness"."""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.baselines import cudnn_decode_call, jax_paged_call, palu_decode_call
from bench.harness import (
    HKV,
    ODD,
    WINDOWED,
    D,
    PagedCase,
    compile_ahead,
    copies_for,
    highest,
    knobs,
    log,
    pick_layer,
    print_checks,
    queries,
    randn,
    rank_plan,
    rel_err,
    time_calls,
    timing_job,
    uniform,
    worst_head,
)
from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.reference import paged_decode_attention
from kvjax.ops.decode.schedule import BuiltSchedule, build_decode_schedule

# The fields the autotune table prints, and its variants: the schedule's unit costs, a floor or a large fixed cost
# per token (bench/results/kernels.md "Decode schedule: unit costs"; the earlier sweeps of warps, stages, tokens per
# step, pieces, folding, orders and run width are in its other "Decode" sections).
DECODE_SWEPT = (
    "order",
    "pack_tile",
    "tile_weight",
    "floor_tile",
    "token_cost",
    "programs_per_sm",
    "num_warps",
    "num_stages",
    "block_tokens",
    "max_segments",
)
DECODE_SWEEP = [
    DECODE,
    dataclasses.replace(DECODE, floor_tile=0, token_cost=256),
    dataclasses.replace(DECODE, token_cost=256),
]


def kvjax_decode_call(case, sched, key):
    """(fn, shared, per_call) for ``time_calls``: ``paged_decode`` with ``sched``, fresh queries, rotating pages."""
    lay, lengths = case.layout, jnp.asarray(case.lengths)

    def fn(k, v, lengths, s, q, table):
        return paged_decode(q, k, v, table, lengths, s, lay)

    qs = queries(key, (case.batch, lay.q_cols))
    per_call = [(q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(qs)]
    return fn, (case.k, case.v, lengths, sched), per_call


def schedule_of(case, config: DecodeConfig, num_programs: int | None = None, **changes) -> BuiltSchedule:
    """The schedule of a case under ``config`` with ``changes`` (``DecodeConfig`` fields) applied."""
    config = dataclasses.replace(config, **changes)
    return build_decode_schedule(case.lengths, case.layout, case.page_size, num_programs, config=config)


# ---------------------------------------------------------------- correctness


def decode_check_inputs(
    key, layout, batch, lengths, page_size, dtype, config: DecodeConfig, num_programs=None, headroom=1
):
    """``paged_decode``'s positional arguments for one check case (chunks down to a page, so groups split)."""
    case = PagedCase(layout, batch, lengths, page_size, 1, key, dtype)
    built = build_decode_schedule(
        case.lengths,
        layout,
        page_size,
        num_programs,
        headroom_pages=headroom,
        config=dataclasses.replace(config, min_chunk_tokens=page_size),
    )
    return case.q, case.k, case.v, case.tables[0], jnp.asarray(case.lengths), built.schedule.layer(0), layout


def check_decode(args, interpret=False):
    """(relative error against the float32 reference, (worst group's error, its KV head)) of one check case."""
    out = paged_decode(*args, interpret=interpret)
    (q, k, v, table, lengths), layout = args[:5], args[-1]
    ref = highest(lambda q, k, v, lay: paged_decode_attention(q, k, v, table, lengths, lay), q, k, v, layout)
    return rel_err(out, ref), worst_head(out, ref, layout, layout.v_widths)


def decode_checks(key, match="", config: DecodeConfig = DECODE, interpret=False):
    """Check rows of every decode shape class (the cases whose name contains ``match``) against the reference."""
    # GQA groups 1, 2, 4, 8; pages 16 and 32; ragged, 1-token and 32K sequences; a sliding window; split groups
    # (merge); bf16 and float32; rate-0, rate-0.5 and odd widths; one head per unit, and runs of heads through 128-
    # and 256-column tiles (read in pieces where they save columns).
    keys = iter(jax.random.split(key, 16))
    bf, f32 = jnp.bfloat16, jnp.float32
    r05, r07 = pick_layer(rank_plan(0.5, config=config), 0.5), pick_layer(rank_plan(0.7, config=config), 0.7)
    r05_filled = pick_layer(rank_plan(0.5, form="filled", config=config), 0.5)
    g8 = HeadLayout(32, 4, 128, (32, 64, 96, 128), (128, 96, 64, 32))
    g2 = HeadLayout(4, 2, 64, (32, 64), (64, 16))
    r0 = HeadLayout.uniform(32, 8, 128)
    ragged = np.linspace(100, 3000, 8).astype(int)
    cases = [  # name, layout, batch, lengths, page size, dtype, pack_tile (0: one head per unit)
        ("llama r0.5 B32 4K p32", r05, 32, np.full(32, 4096), 32, bf, 0),
        ("llama r0 B8 ragged p16", r0, 8, ragged, 16, bf, 0),
        ("odd widths B4 ragged p16", ODD, 4, [1, 17, 600, 2049], 16, f32, 0),
        ("G1 window 300 p16", WINDOWED, 3, [1000, 299, 5], 16, bf, 0),
        ("G8 B1 32K p32", g8, 1, [32768], 32, bf, 0),
        ("G2 p32", g2, 5, [33, 64, 65, 700, 1], 32, f32, 0),
        # runs of adjacent heads read as one (kvjax.ops.decode.units), at both run widths
        ("packed 128: llama r0.7 B32 4K p32", r07, 32, np.full(32, 4096), 32, bf, 128),
        ("packed 256: llama r0.5 B32 4K p32", r05, 32, np.full(32, 4096), 32, bf, 256),
        ("packed 256: llama r0.5 filled B32 4K p32", r05_filled, 32, np.full(32, 4096), 32, bf, 256),
        ("packed 256: llama r0 B8 ragged p16", r0, 8, ragged, 16, bf, 256),
        ("packed 128: odd widths B4 ragged p16", ODD, 4, [1, 17, 600, 2049], 16, f32, 128),
        ("packed 256: G1 window 300 p16", WINDOWED, 3, [1000, 299, 5], 16, bf, 256),
        ("packed 256: G8 B1 32K p32", g8, 1, [32768], 32, bf, 256),
        ("packed 128: G2 p32", g2, 5, [33, 64, 65, 700, 1], 32, f32, 128),
    ]
    cases = [
        (
            name,
            dt,
            decode_check_inputs(next(keys), lay, b, lengths, ps, dt, dataclasses.replace(config, pack_tile=pack)),
        )
        for name, lay, b, lengths, ps, dt, pack in cases
        if match in name
    ]
    compile_ahead([lambda a=args: paged_decode.lower(*a, interpret=interpret) for _, _, args in cases])
    rows = []
    for name, dt, args in cases:
        err, (worst, head) = check_decode(args, interpret)
        log(f"decode check {name}: {err:.1e}")
        tol = 1e-2 if dt == bf else 1e-4
        rows.append(("decode", name, jnp.dtype(dt).name, err, f"{worst:.1e} (kv head {head})", err < tol))
    print_checks(rows)
    log("decode checks done")
    return rows


# ---------------------------------------------------------------- timings


def print_row(r) -> None:
    """One row of the decode table."""
    ratio = r["time_us"] / r["floor_us"]
    speedup = f"{r['speedup_vs_rate0']:.2f}x" if r.get("speedup_vs_rate0") else ""
    print(
        f"| {r['kernel']} | {r['batch']} | {r['ctx']} | {r['rate']} | {r['widths']} | {r['time_us']:.1f} | "
        f"{r['floor_us']:.1f} | {ratio:.2f} | {100 / ratio:.0f}% | {speedup} |",
        flush=True,
    )


def decode_autotune(key, bw, rates, batch=32, ctx=4096, configs=DECODE_SWEEP) -> dict[float, DecodeConfig]:
    """Per rate, the fastest of ``configs`` at one shape (all compiled ahead, side by side), for the later tables."""
    print(f"\n{batch} x {ctx}:\n| rate | {' / '.join(DECODE_SWEPT)} | time us | % of copy bw |\n|---|---|---|---|")
    jobs = []
    for rate in rates:
        lay = pick_layer(rank_plan(rate, config=configs[0]), rate)
        case = PagedCase(
            lay, batch, np.full(batch, ctx), 32, copies_for(batch * ctx * (lay.k_cols + lay.v_cols) * 2), key
        )
        for config in configs:
            sched = schedule_of(case, config).schedule.layer(0)
            jobs.append((rate, config, case.bytes, kvjax_decode_call(case, sched, key)))
    compile_ahead([timing_job(*job) for *_, job in jobs])
    best = {}
    for rate, config, nbytes, job in jobs:
        t = time_calls(*job)
        print(
            f"| {rate} | {knobs(config, DECODE_SWEPT, DECODE)} | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |",
            flush=True,
        )
        if rate not in best or t < best[rate][0]:
            best[rate] = (t, config)
    del jobs
    log("decode autotune done")
    return {r: config for r, (t, config) in best.items()}


def decode_table(key, bw, shapes, rates, quick, tuned, orders=("lpt", "naive"), forms=("ordered",)):
    """Rows of kvjax (each rate's ``tuned`` config at ``orders``, plans in ``forms``) and the baselines, by floors."""
    print(
        "\n| kernel | batch | ctx | rate | K+V cols | time us | floor us | time/floor | % of copy bw | vs rate 0 |"
        "\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    variants = {
        r: [(o, f) for f in (forms if r > 0 else ("ordered",)) for o in (orders if r > 0 else (tuned[r].order,))]
        for r in rates
    }
    layers = {(r, f): pick_layer(rank_plan(r, form=f, config=tuned[r]), r) for r in rates for _, f in variants[r]}
    for batch, ctx in shapes:
        # every case, schedule and kvjax call of the shape first, so their kernels compile side by side
        cases, calls = {}, {}
        for rate in rates:
            for order, form in variants[rate]:
                lay = layers[rate, form]
                nbytes = batch * ctx * (lay.k_cols + lay.v_cols) * 2
                if (rate, form) not in cases:
                    cases[rate, form] = PagedCase(lay, batch, np.full(batch, ctx), 32, copies_for(nbytes), key)
                case = cases[rate, form]
                t0 = time.perf_counter()
                built = schedule_of(case, tuned[rate], order=order)
                host = time.perf_counter() - t0
                calls[rate, order, form] = host, kvjax_decode_call(case, built.schedule.layer(0), key)
        compile_ahead([timing_job(*call) for _, call in calls.values()])
        base = None
        for rate in rates:
            for order, form in variants[rate]:
                case = cases[rate, form]
                lay = case.layout
                floor = case.bytes / bw
                host, call = calls.pop((rate, order, form))
                t = time_calls(*call)
                base = t if rate == 0 else base
                rows.append(
                    dict(
                        kernel=f"kvjax {order}" + (f" ({form} plan)" if form != "ordered" else ""),
                        batch=batch,
                        ctx=ctx,
                        rate=rate,
                        widths=f"{lay.k_cols}+{lay.v_cols}",
                        time_us=t * 1e6,
                        floor_us=floor * 1e6,
                        speedup_vs_rate0=(base / t) if base else None,
                        host_ms=host * 1e3,
                    )
                )
                print_row(rows[-1])
                del call
            case = cases.get((rate, "ordered")) or cases[rate, forms[0]]
            lay = case.layout
            floor = case.bytes / bw
            if rate == 0:
                rows += _uncompressed_baselines(case, key, ctx, floor, base)
            if rate == 0.5 and not quick and batch >= 32 and ctx >= 4096:
                fn, shared, per_call, pbytes, r, rv = palu_decode_call(case, lay, key)
                t = time_calls(fn, shared, per_call)
                rows.append(
                    dict(
                        kernel=f"palu (K rank {r}, V {rv})",
                        batch=batch,
                        ctx=ctx,
                        rate=rate,
                        widths=f"{HKV * r}+{HKV * rv}",
                        time_us=t * 1e6,
                        floor_us=pbytes / bw * 1e6,
                        speedup_vs_rate0=base / t,
                    )
                )
                print_row(rows[-1])
            del case
        del cases
        log(f"decode {batch}x{ctx} done")
    return rows


def _uncompressed_baselines(case, key, ctx, floor, base) -> list[dict]:
    """JAX paged_attention (where its blocks divide the table) and cuDNN on the rate-0 case, as printed rows."""
    times = {}
    for ppb, splits in ((4, 16 if ctx >= 16384 else 8),):
        if case.pps % splits or (case.pps // splits) % min(ppb, case.pps // splits):
            continue
        t = time_calls(*jax_paged_call(case, key, ppb, splits))
        times["jax paged_attention"] = min(t, times.get("jax paged_attention", t))
    times["cudnn (contiguous)"] = time_calls(*cudnn_decode_call(case, key))
    rows = []
    for kernel, t in times.items():
        rows.append(
            dict(
                kernel=kernel,
                batch=case.batch,
                ctx=ctx,
                rate=0.0,
                widths="1024+1024",
                time_us=t * 1e6,
                floor_us=floor * 1e6,
                speedup_vs_rate0=base / t,
            )
        )
        print_row(rows[-1])
    return rows


def width_sweep(key, bw, config: DecodeConfig = DECODE):
    """Decode bandwidth at batch 32, 4K by head width, heads read as one padded tile or in up to 3 pieces."""
    # pieces only where each saves ``piece_saving`` columns (bench/results/kernels.md "Decode: run width and pieces")
    print("\n| layout | pieces | time us | % of copy bw |\n|---|---|---|---|")
    sweep = [
        ("rate 0.5 layer", pick_layer(rank_plan(0.5, config=config), 0.5)),
        ("rate 0.7 layer", pick_layer(rank_plan(0.7, config=config), 0.7)),
        *((f"uniform {w}", uniform(w)) for w in (48, 64, 80, 96, 112)),
    ]
    jobs = {}
    for name, lay in sweep:
        case = PagedCase(lay, 32, np.full(32, 4096), 32, 1, key)
        for pieces in (1, 3) if name != "uniform 64" else (1,):
            built = schedule_of(case, config, max_segments=pieces)
            jobs[name, pieces] = case.bytes, kvjax_decode_call(case, built.schedule.layer(0), key)
    compile_ahead([timing_job(*job) for _, job in jobs.values()])
    for (name, pieces), (nbytes, job) in jobs.items():
        t = time_calls(*job)
        print(
            f"| {name} | {'one tile' if pieces == 1 else 'exact'} | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |",
            flush=True,
        )
    log("width sweep done")


def per_class_launches(key, bw, lay, batch=32, ctx=4096, config: DecodeConfig = DECODE):
    """The rate-0.5 layer as one launch per width class (own schedule, own code) against one launch switching them."""
    subs, inputs, nbytes = [], [], 0
    for (kw, vw), n in collections.Counter(zip(lay.k_widths, lay.v_widths)).items():
        sub = HeadLayout(lay.group_size * n, n, D, (kw,) * n, (vw,) * n)
        case = PagedCase(sub, batch, np.full(batch, ctx), 32, 1, key)
        sched = schedule_of(case, config).schedule.layer(0)
        subs.append(sub)
        inputs.append((case.k, case.v, jnp.asarray(case.lengths), sched, case.tables[0]))
        nbytes += case.bytes
    qs = [tuple(randn(k, (batch, sub.q_cols)) for sub in subs) for k in jax.random.split(key, 8)]

    def fn(inputs, qs):
        return [
            paged_decode(q, k, v, table, lengths, s, sub)
            for sub, (k, v, lengths, s, table), q in zip(subs, inputs, qs, strict=True)
        ]

    t = time_calls(fn, (inputs,), [(q,) for q in qs])
    case = PagedCase(lay, batch, np.full(batch, ctx), 32, 1, key)
    one = time_calls(*kvjax_decode_call(case, schedule_of(case, config).schedule.layer(0), key))
    print(
        f"\n| rate-0.5 layer, batch {batch}, {ctx} tokens | time us | % of copy bw |\n|---|---|---|\n"
        f"| one launch, classes switched per item | {one * 1e6:.1f} | {100 * case.bytes / bw / one:.0f}% |\n"
        f"| one launch per width class ({len(subs)}) | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |",
        flush=True,
    )


def profile_one(spec: str, config: DecodeConfig = DECODE):
    """One decode call after a warm-up, for ``ncu``: "uniform:W", "rate:R" or "filled:R" (filled plan) at B32 x 4K."""
    kind, val = spec.split(":")
    lay = (
        uniform(int(val))
        if kind == "uniform"
        else pick_layer(
            rank_plan(float(val), form="filled" if kind == "filled" else "ordered", config=config), float(val)
        )
    )
    key = jax.random.key(0)
    case = PagedCase(lay, 32, np.full(32, 4096), 32, 1, key)
    fn, shared, per_call = kvjax_decode_call(case, schedule_of(case, config).schedule.layer(0), key)
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*shared, *per_call[0]))
    print(f"profiled {spec}: {lay.k_cols}+{lay.v_cols} cols, useful bytes {case.bytes}")
