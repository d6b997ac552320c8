"""The decode schedule measured (``kvjax.ops.decode.schedule`` and ``schedule_cache``): schedule options side by
side on one compiled kernel, the orders (auto, stream, LPT, naive) on ragged batches with their scheduled balance,
and the host cost of scheduling: a build, the schedules a ``ScheduleCache`` keeps over a run of steps, the balance
aged schedules meet, the headroom trade-off and what a step waits with builds in the step or ahead. Tables:
bench/results/kernels.md "Decode schedule: planner options (items per program, token cost)", "Decode schedule: ragged
batches" and "Host cost of the plan"."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time

import numpy as np

from bench.decode import kvjax_decode_call, schedule_of
from bench.harness import PagedCase, copies_for, log, pick_layer, rank_plan, time_calls
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.schedule import (
    DecodeSchedule,
    ScheduleShape,
    build_decode_schedule,
    load_balance,
    realized_loads,
)
from kvjax.ops.decode.schedule_cache import ScheduleCache
from kvjax.ops.decode.units import head_runs

# LPT options, one head per unit and costs from widths alone (bench/results/kernels.md "Decode schedule: planner options
# (items per program, token cost)"): items per program x a per-token cost.
SCHEDULE_VARIANTS = [
    dataclasses.replace(DECODE, order="lpt", pack_tile=0, tile_weight=0, items_per_program=i, token_cost=c)
    for c in (0, 32)
    for i in (1, 2)
]
ORDERS = ("auto", "stream", "lpt", "naive")


def pad_schedule(s: DecodeSchedule, shape: ScheduleShape, config: DecodeConfig) -> DecodeSchedule:
    """One layer's schedule padded to ``shape`` and run with ``config``, so schedules compared share one kernel."""
    return dataclasses.replace(s.padded(shape), config=config)


def schedule_table(key, bw, cases, variants=SCHEDULE_VARIANTS, num_programs=None):
    """Rows of schedule ``variants`` side by side on one compiled kernel per (rate, batch, ctx) case."""
    # finer items (more to balance, more merges) and a per-token cost that weighs narrow heads above their bytes
    print(
        "\n| plan | batch | ctx | items per program | token cost | items | planned balance | time us | "
        "% of copy bw |\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for rate, batch, ctx in cases:
        lay = pick_layer(rank_plan(rate), rate)
        if len({head_runs(lay, v) for v in variants}) > 1:
            raise ValueError("the variants cut this layer into different units: they cannot share one kernel")
        nbytes = batch * ctx * (lay.k_cols + lay.v_cols) * 2
        case = PagedCase(lay, batch, np.full(batch, ctx), 32, copies_for(nbytes), key)
        built = [schedule_of(case, v, num_programs) for v in variants]
        shape = functools.reduce(ScheduleShape.cover, (b.schedule.shape for b in built))
        for v, b in zip(variants, built, strict=True):
            sched = pad_schedule(b.schedule.layer(0), shape, variants[0])
            t = time_calls(*kvjax_decode_call(case, sched, key))
            rows.append(
                dict(
                    rate=rate,
                    batch=batch,
                    ctx=ctx,
                    items_per_program=v.items_per_program,
                    token_cost=v.token_cost,
                    items=int(b.num_items[0]),
                    balance=b.balance,
                    time_us=t * 1e6,
                    pct=100 * case.bytes / bw / t,
                )
            )
            print(
                f"| r{rate} | {batch} | {ctx} | {v.items_per_program} | {v.token_cost} | "
                f"{rows[-1]['items']} | {b.balance:.3f} | {t * 1e6:.1f} | {rows[-1]['pct']:.0f}% |",
                flush=True,
            )
        del case
    log("schedule table done")
    return rows


def lpt_table(key, bw, cases, tuned, forms=("ordered",)):
    """Rows of the four orders on ragged batches (lengths uniform in [ctx/8, ctx]), each rate's ``tuned`` config."""
    print(
        "\n| plan | batch | max ctx | order | time us | floor us | % of copy bw | planned balance | host plan ms |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for (rate, batch, ctx), form in itertools.product(cases, forms):
        config = tuned[rate]
        lay = pick_layer(rank_plan(rate, form=form, config=config), rate)
        name = f"r{rate}" + (f" {form}" if form != "ordered" else "")
        lengths = np.random.default_rng(batch * ctx).integers(ctx // 8, ctx + 1, batch)
        nbytes = int(lengths.sum()) * (lay.k_cols + lay.v_cols) * 2
        case = PagedCase(lay, batch, lengths, 32, copies_for(nbytes), key)
        floor = case.bytes / bw
        for order in ORDERS:
            t0 = time.perf_counter()
            built = schedule_of(case, config, order=order)
            host = time.perf_counter() - t0
            t = time_calls(*kvjax_decode_call(case, built.schedule.layer(0), key))
            rows.append(
                dict(
                    rate=rate,
                    form=form,
                    batch=batch,
                    ctx=ctx,
                    order=order,
                    time_us=t * 1e6,
                    floor_us=floor * 1e6,
                    host_ms=host * 1e3,
                    balance=built.balance,
                )
            )
            print(
                f"| {name} | {batch} | {ctx} | {order} | {t * 1e6:.1f} | {floor * 1e6:.1f} | "
                f"{100 * floor / t:.0f}% | {built.balance:.3f} | {host * 1e3:.2f} |",
                flush=True,
            )
    return rows


def schedule_cost(
    decode_us_per_layer: float | None,
    bw: float | None,
    steps: int = 1024,
    config: DecodeConfig = DECODE,
    headrooms=(16, 64, 128, 256, 512),
) -> dict:
    """Host cost of scheduling a 32-layer rate-0.5 model at batch 256 over ``steps`` steps of one token each."""
    # Per build; over the steps, as ScheduleCache keeps schedules: the balance aged schedules meet at the real
    # lengths (``realized_loads``) beside fresh schedules', rebuilds against aged balance per headroom, and what a
    # step loses to scheduling in the step or ahead beside sleeps standing in for the device step (the decode
    # table's time per layer and the copy bandwidth estimate a step, else 11 ms).
    layouts, ps = rank_plan(0.5, config=config), 16
    lengths = np.random.default_rng(0).integers(256, 769, 256)  # mean 512: the shortest step measured, most share
    default = ScheduleCache(layouts, ps, config=config)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        default.build(lengths)
        times.append(time.perf_counter() - t0)
    build = statistics.median(times)
    step_s = None
    if decode_us_per_layer and bw:
        step_s = 32 * decode_us_per_layer * 1e-6 + 16e9 / bw  # + Llama-3.1-8B bf16 weights read once per step

    def run(cache, steps, device_s=0.0, every=16):
        """Host seconds of each step past ``device_s``, and its schedule's balance at the real lengths every few
        steps."""
        spent, balance = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            cache(lengths + s)
            if device_s:
                time.sleep(device_s)
            spent.append(time.perf_counter() - t0 - device_s)
            if s % every == 0:
                balance.append(load_balance(realized_loads(cache.built.schedule, lengths + s, layouts, ps)))
        return np.array(spent), np.array(balance)

    fresh = np.mean(
        [
            load_balance(
                realized_loads(
                    build_decode_schedule(lengths + s, layouts, ps, config=config).schedule, lengths + s, layouts, ps
                )
            )
            for s in range(0, steps, 64)
        ]
    )
    print(
        f"\nschedule host cost, 32 layers of the rate-0.5 plan, batch 256, lengths 256..768 growing one token a "
        f"step, page 16, {default.num_programs} programs: {build * 1e3:.2f} ms per build (median of 20); balance "
        f"at the real lengths of a fresh plan every step {fresh:.3f}"
    )
    print(
        f"\n| headroom tokens | rebuilds in {steps} steps | ms/step amortized | worst step ms | aged balance mean "
        f"| aged balance worst |\n|---|---|---|---|---|---|"
    )
    sweep = []
    for headroom in sorted({*headrooms, config.headroom_tokens}):
        cache = ScheduleCache(layouts, ps, config=dataclasses.replace(config, headroom_tokens=headroom), ahead=False)
        spent, balance = run(cache, steps)
        sweep.append(
            dict(
                headroom_tokens=headroom,
                rebuilds=cache.rebuilds,
                amortized_ms=spent.mean() * 1e3,
                worst_ms=spent[1:].max() * 1e3,
                balance_aged=balance.mean(),
                balance_aged_min=balance.min(),
            )
        )
        print(
            f"| {headroom}{' (default)' if headroom == DECODE.headroom_tokens else ''} | {cache.rebuilds} | "
            f"{spent.mean() * 1e3:.4f} | {spent[1:].max() * 1e3:.2f} | {balance.mean():.3f} | {balance.min():.3f} |"
        )
    res = dict(
        build_ms=build * 1e3,
        steps=steps,
        balance_fresh=fresh,
        sweep=sweep,
        **next(row for row in sweep if row["headroom_tokens"] == config.headroom_tokens),
    )

    device_s = step_s or 0.011
    print(
        f"\nhost time per step past a {device_s * 1e3:.1f} ms sleep standing in for the device step, {steps // 2} "
        f"steps, {config.headroom_tokens} tokens of headroom:"
    )
    for ahead in (False, True):
        cache = ScheduleCache(layouts, ps, config=config, ahead=ahead)
        spent, _ = run(cache, steps // 2, device_s, every=steps)
        name = "ahead" if ahead else "in_step"
        res.update({f"{name}_ms": np.median(spent) * 1e3, f"{name}_worst_ms": spent[1:].max() * 1e3})
        print(
            f"  built {'ahead' if ahead else 'in the step'}: {cache.rebuilds} plans ({cache.built_ahead} built "
            f"ahead), median {res[f'{name}_ms']:.3f} ms, worst after the first {res[f'{name}_worst_ms']:.2f} ms"
        )
    if step_s:
        res.update(
            step_ms=step_s * 1e3,
            build_pct=100 * build / step_s,
            amortized_pct=100 * res["amortized_ms"] * 1e-3 / step_s,
            ahead_worst_pct=100 * res["ahead_worst_ms"] * 1e-3 / step_s,
        )
        print(
            f"decode step estimate (32 x measured attention at batch 256, 512 tokens + 16 GB of weights at copy "
            f"bandwidth): {step_s * 1e3:.2f} ms -> plan {res['build_pct']:.2f}% per build, "
            f"{res['amortized_pct']:.3f}% amortized; built ahead, {res['ahead_worst_pct']:.2f}% of a step at worst"
        )
    return res
