"""The prefill kernel (``kvjax.ops.prefill.kernel.prefill_attention``) measured: its correctness against the jnp
reference (output and the K/V it writes into the pages), its time beside the floor (causal FLOPs over the measured
matmul rate) balanced and unbalanced against cuDNN, and a sweep of ``PrefillConfig`` variants. Tables:
bench/results/kernels.md "Prefill vs cuDNN", "Prefill: knob sweep" and "Kernel correctness"."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.baselines import cudnn_prefill_call
from bench.harness import (
    ODD,
    WINDOWED,
    batched,
    compile_ahead,
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
    worst_head,
)
from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.prefill.config import PREFILL, PrefillConfig
from kvjax.ops.prefill.kernel import prefill_attention
from kvjax.ops.prefill.reference import causal_attention

# heads too wide for 128-key prefill steps (``plan.keys_per_step`` gives them 64) beside narrow ones
WIDE = HeadLayout(32, 8, 128, (112, 128, 16, 96, 112, 64, 128, 48), (112, 16, 128, 112, 80, 128, 96, 48))
# The fields the sweep prints, and its variants of the defaults (bench/results/kernels.md "Prefill: knob sweep").
PREFILL_SWEPT = ("block_q", "block_k", "max_block_q", "tile_widths", "num_warps", "num_stages")
PREFILL_SWEEP = [
    PREFILL,
    *(
        dataclasses.replace(PREFILL, **change)
        for change in (
            dict(tile_widths=(128,)),
            dict(tile_widths=(16, 32, 64, 128)),
            dict(num_warps=4),
            dict(block_q=64, num_warps=4),
            dict(num_stages=4),
            dict(block_q=64, block_k=64, num_warps=4),
            dict(num_warps=4, num_stages=2),
            dict(block_k=64),
        )
    ),
]
UNBALANCED = dict(balanced=False, block_q=128, max_block_q=128)  # the ablation: 128-row blocks, natural order


def prefill_check_inputs(key, layout, batch, seq_len, dtype, page_size=32):
    """``prefill_attention``'s positional arguments for one check case: random prompts and pages, a shuffled table."""
    ks = jax.random.split(key, 6)
    q = randn(ks[0], (batch, seq_len, layout.q_cols), dtype)
    k = randn(ks[1], (batch, seq_len, layout.k_cols), dtype)
    v = randn(ks[2], (batch, seq_len, layout.v_cols), dtype)
    pps = -(-seq_len // page_size)
    n = batch * pps + 1
    seed = int(jax.random.randint(ks[3], (), 0, 2**31 - 1))
    table = jnp.asarray(np.random.default_rng(seed).permutation(np.arange(1, n)).reshape(batch, pps).astype(np.int32))
    kp = randn(ks[4], (n, page_size, layout.k_cols), dtype)
    vp = randn(ks[5], (n, page_size, layout.v_cols), dtype)
    return q, k, v, layout, jnp.full((batch,), seq_len, jnp.int32), kp, vp, table


def check_prefill(args, config: PrefillConfig = PREFILL, interpret=False):
    """(error against the float32 reference, whether the pages hold the prompts' K/V, (worst group's error, head))."""
    q, k, v, layout, _, _, _, table = args
    batch, seq_len = q.shape[:2]
    out, kp, vp = prefill_attention(*args, config=config, interpret=interpret)
    ref = highest(lambda q, k, v, lay: causal_attention(q, k, v, lay), q, k, v, layout)
    pages_ok = bool(
        jnp.array_equal(kp[table].reshape(batch, -1, layout.k_cols)[:, :seq_len], k)
        & jnp.array_equal(vp[table].reshape(batch, -1, layout.v_cols)[:, :seq_len], v)
    )
    return rel_err(out, ref), pages_ok, worst_head(out, ref, layout, layout.v_widths)


def prefill_checks(key, match="", config: DecodeConfig = DECODE, interpret=False):
    """Check rows of prefill (and its page writes) on the cases whose name contains ``match``."""
    # the rate-0.5 plan's layer (heads ordered for ``config``'s decode runs), odd and wide widths in bf16 and
    # float32, and a G=1 sliding window
    keys = iter(jax.random.split(key, 16))
    bf, f32 = jnp.bfloat16, jnp.float32
    cases = [
        ("llama r0.5 B1 2K", pick_layer(rank_plan(0.5, config=config), 0.5), 1, 2048, bf),
        ("odd widths B2 1000", ODD, 2, 1000, f32),
        ("odd widths B1 1000", ODD, 1, 1000, bf),
        ("wide classes B1 1000", WIDE, 1, 1000, bf),
        ("G1 window 300", WINDOWED, 2, 700, bf),
    ]
    cases = [
        (name, dt, prefill_check_inputs(next(keys), lay, b, t, dt)) for name, lay, b, t, dt in cases if match in name
    ]
    compile_ahead([lambda a=args: prefill_attention.lower(*a, interpret=interpret) for _, _, args in cases])
    rows = []
    for name, dt, args in cases:
        err, pages_ok, (worst, head) = check_prefill(args, interpret=interpret)
        log(f"prefill check {name}: {err:.1e}")
        tol = 1e-2 if dt == bf else 1e-4
        rows.append(
            (
                "prefill",
                name + ("" if pages_ok else " PAGES WRONG"),
                jnp.dtype(dt).name,
                err,
                f"{worst:.1e} (kv head {head})",
                err < tol and pages_ok,
            )
        )
    print_checks(rows)
    log("prefill checks done")
    return rows


def prefill_sweep(
    key, flops_rate, batch=1, t=4096, rate=0.5, configs=PREFILL_SWEEP, decode: DecodeConfig = DECODE
) -> PrefillConfig:
    """Balanced prefill ``configs`` at rate 0.5: each checked against the reference, timed; the fastest correct."""
    print(f"\n| {' / '.join(PREFILL_SWEPT)} | rel. error | time ms | % of matmul rate |\n|---|---|---|---|")
    lay = pick_layer(rank_plan(rate, config=decode), rate)
    ks = jax.random.split(key, 4)
    qs = queries(ks[0], (batch, t, lay.q_cols), 4)
    k, v = randn(ks[1], (batch, t, lay.k_cols)), randn(ks[2], (batch, t, lay.v_cols))
    ref = highest(lambda q, k, v, lay: causal_attention(q, k, v, lay), qs[0][0], k, v, lay)
    flops = 2 * batch * t * (t + 1) / 2 * lay.group_size * (lay.k_cols + lay.v_cols)

    def attend(k, v, q, config):
        return prefill_attention(q, k, v, lay, config=config)

    jobs = [(functools.partial(attend, config=config), (k, v), qs) for config in configs]
    errors = compile_ahead([timing_job(*job) for job in jobs])
    best = None
    for config, job, error in zip(configs, jobs, errors, strict=True):
        if error is not None:
            print(f"| {knobs(config, PREFILL_SWEPT, PREFILL)} | does not compile: {str(error)[:80]} | | |")
            continue
        err = rel_err(batched(job[0])(job[1], job[2])[0], ref)
        tm = time_calls(*job)
        print(
            f"| {knobs(config, PREFILL_SWEPT, PREFILL)} | {err:.1e} | {tm * 1e3:.3f} | "
            f"{100 * flops / flops_rate / tm:.0f}% |",
            flush=True,
        )
        if err < 1e-2 and (best is None or tm < best[0]):
            best = (tm, config)
    log("prefill sweep done")
    return best[1] if best else PREFILL


def _prefill_fn(k, v, kp, vp, table, lengths, q, *, layout, config):
    """(out, k_pages, v_pages) of ``prefill_attention`` in ``time_calls``' argument order (the pages chained)."""
    return prefill_attention(q, k, v, layout, lengths, kp, vp, table, config=config)


def print_prefill(r) -> None:
    """One row of the prefill table."""
    ratio = r["time_ms"] / r["floor_ms"]
    vs = f"{r['vs_cudnn']:.2f}x" if r.get("vs_cudnn") else ""
    print(
        f"| {r['kernel']} | {r['batch']} | {r['t']} | {r['rate']} | {r['time_ms']:.3f} | {r['floor_ms']:.3f} | "
        f"{ratio:.2f} | {100 / ratio:.0f}% | {vs} |",
        flush=True,
    )


def prefill_table(key, flops_rate, cases, config: PrefillConfig = PREFILL, decode: DecodeConfig = DECODE):
    """Rows of prefill balanced (``config``) and unbalanced, and of cuDNN at rate 0, for (batch, T, rate variants)."""
    print(f"\nbalanced config: {config}")
    print(
        "\n| kernel | batch | T | rate | time ms | floor ms | time/floor | % of matmul rate | vs cuDNN |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    specs = []  # (row without time, job): every kvjax job is compiled ahead, side by side
    for batch, t, rates in cases:
        pairs = t * (t + 1) / 2
        for rate, variants in rates:
            lay = pick_layer(rank_plan(rate, config=decode), rate)
            ks = jax.random.split(key, 4)
            if rate == 0:
                specs.append(
                    (
                        dict(
                            kernel="cudnn (uncompressed)",
                            batch=batch,
                            t=t,
                            rate=0.0,
                            floor_ms=2 * batch * pairs * lay.num_heads * 2 * lay.head_dim / flops_rate * 1e3,
                        ),
                        cudnn_prefill_call(key, batch, t),
                    )
                )
            k = randn(ks[1], (batch, t, lay.k_cols))
            v = randn(ks[2], (batch, t, lay.v_cols))
            pps = t // 32
            kp = randn(ks[3], (batch * pps + 1, 32, lay.k_cols))
            vp = randn(ks[3], (batch * pps + 1, 32, lay.v_cols))
            table = jnp.arange(1, batch * pps + 1, dtype=jnp.int32).reshape(batch, pps)
            lengths = jnp.full((batch,), t, jnp.int32)
            flops = 2 * batch * pairs * lay.group_size * (lay.k_cols + lay.v_cols)
            for balanced in variants:
                cfg = config if balanced else dataclasses.replace(config, **UNBALANCED)
                fn = functools.partial(_prefill_fn, layout=lay, config=cfg)
                specs.append(
                    (
                        dict(
                            kernel="kvjax " + ("balanced" if balanced else "unbalanced"),
                            batch=batch,
                            t=t,
                            rate=rate,
                            floor_ms=flops / flops_rate * 1e3,
                        ),
                        (fn, (k, v, kp, vp, table, lengths), queries(ks[0], (batch, t, lay.q_cols), 4), (2, 3)),
                    )
                )
    compile_ahead([timing_job(*job) for row, job in specs if row["kernel"].startswith("kvjax")])
    rows, cudnn = [], {}
    for row, job in specs:
        tm = time_calls(*job[:3], chain=job[3] if len(job) > 3 else None)
        if row["kernel"].startswith("cudnn"):
            cudnn[row["batch"], row["t"]] = tm
        base = cudnn.get((row["batch"], row["t"]))
        rows.append(dict(row, time_ms=tm * 1e3, vs_cudnn=base / tm if base else None))
        print_prefill(rows[-1])
    del specs
    log("prefill table done")
    return rows
