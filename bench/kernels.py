"""Kernel benchmarks on the GPU: correctness against the jnp references, then timings beside their floors.

    PYTHONPATH=. python3 bench/kernels.py [--only SECTIONS] [--quick] [--json out.json]

Sections run in this order (default: check_decode, decode, schedule, check_prefill, prefill, lpt; the whole set
takes over 10 minutes on an H100, mostly compiling, so split it across calls with --only): compile (XLA's compile
time for modules calling the decode kernel), widths (decode bandwidth by head width, each head as one padded tile
or as exact pieces), classes (the rate-0.5 layer as one launch per width class), autotune (decode schedule and
kernel knobs per rate, at --tune-shape), check_decode, decode, schedules (planner options side by side),
schedule (host cost), check_prefill, prefill, sweep (with prefill: pick the prefill knobs first), lpt.
``--quick`` runs one shape per table. ``--profile uniform:16`` runs one decode call for ncu. Within a section,
the Pallas variants are compiled side by side in threads first (``compile_ahead``, into the persistent cache in
``--cache-dir``), then timed.

Measures, in the same run: the copy bandwidth (a 1 GiB elementwise pass, bytes read + written) and the bf16 matmul
rate (8192^3). Every timing is the median of several batches of jitted calls, divided by the calls: by default
the GPU's own kernel durations summed by CUPTI (``--timer cupti``; launch gaps and host noise drop out), or the
wall clock over batches queued back to back (``--timer host``). Each call's inputs differ (a fresh query per call,
and paged inputs rotate through block tables over disjoint pages when one call's bytes would fit in L2), so nothing is
merged, sliced away or served from L2 (contiguous baselines reuse one cache: rows under 2x L2 may read from it).
Floors: decode = bytes it must read (K/V rows of every visible token + q + out) / copy bandwidth; prefill = causal
FLOPs / matmul rate.

Shapes are Llama-3.1-8B / Mistral-7B attention (32 query heads, 8 KV heads, head_dim 128, bf16); rank plans come
from ``rank_plan`` (overall rate 0, 0.5, 0.7; per-head widths with a ~45% coefficient of variation).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import statistics
import sys
import time
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kvjax import attention  # noqa: E402
from kvjax import runs  # noqa: E402
from kvjax.layout import HeadLayout  # noqa: E402
from kvjax.runs import FLOOR_TILE, TOKEN_COST, permuted  # noqa: E402
from kvjax.pallas.common import width_classes  # noqa: E402
from kvjax.schedule import (ORDER, PACK_TILE, SLOT, TILE_WEIGHT, DecodePlanner, DecodeSchedule,  # noqa: E402
                            build_decode_schedule, load_balance, realized_loads)
from kvjax.pallas.decode import paged_decode  # noqa: E402
from kvjax.pallas.prefill import prefill_attention  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
HQ, HKV, D = 32, 8, 128
L2_BYTES = 50 << 20
TIMER = {"name": "cupti"}  # --timer: "cupti" (the kernels' own durations) or "host" (wall clock over queued calls)


# ---------------------------------------------------------------- inputs

PLAN_FORMS = ("ordered", "filled", "drawn")


@functools.lru_cache(maxsize=None)
def rank_plan(rate: float, num_layers: int = 32, cv: float = 0.45, seed: int = 0,
              form: str = "ordered") -> tuple[HeadLayout, ...]:
    """Per-layer layouts whose widths (multiples of 16 in [16, 128]) average (1 - rate) * 128 with the given spread.

    Widths are log-normal around a common scale (coefficient of variation ``cv`` before rounding), the scale
    bisected so the overall rate 1 - sum(k + v) / (2 * heads * 128 * layers) matches ``rate``. ``form``: as
    compression stores them by default ("ordered": heads ordered by ``kvjax.runs.order_heads`` for the decode
    defaults' tile), with its opt-in ``fill_tiles`` ("filled": widths first moved between heads so runs fill their
    tiles, ``kvjax.runs.fill_runs``), or as drawn ("drawn": the ablation).
    """
    if form not in PLAN_FORMS:
        raise ValueError(f"form must be one of {PLAN_FORMS}, got {form!r}")
    if rate == 0:
        return tuple(HeadLayout.uniform(HQ, HKV, D) for _ in range(num_layers))
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))
    z = rng.lognormal(-sigma * sigma / 2, sigma, (num_layers, 2, HKV))

    def widths(scale):
        return np.clip(np.round(scale * z / 16) * 16, 16, D).astype(int)

    lo, hi = 1.0, 2.0 * D
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if widths(mid).mean() < (1 - rate) * D else (lo, mid)
    w = widths(hi)
    layouts = [HeadLayout(HQ, HKV, D, tuple(map(int, w[i, 0])), tuple(map(int, w[i, 1]))) for i in range(num_layers)]
    tile = DECODE_DEFAULTS["pack_tile"]
    if form == "filled":  # no singular values here: the fill moves as few columns as it can
        layouts = [HeadLayout(HQ, HKV, D, *runs.fill_runs(lay, tile)) for lay in layouts]
    if form != "drawn":
        layouts = [permuted(lay, runs.order_heads(lay, tile)) for lay in layouts]
    return tuple(layouts)


def plan_rate(layouts) -> float:
    return 1 - sum(lay.k_cols + lay.v_cols for lay in layouts) / (2 * HKV * D * len(layouts))


def pick_layer(layouts, rate) -> HeadLayout:
    """The layer whose total width is closest to the plan's mean (a representative layer)."""
    target = (1 - rate) * 2 * HKV * D
    return min(layouts, key=lambda lay: abs(lay.k_cols + lay.v_cols - target))


def randn(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


class PagedCase:
    """A paged cache for one layer with ``copies`` disjoint sets of pages (rotated between calls)."""

    def __init__(self, layout, batch, lengths, page_size, copies, key, dtype=jnp.bfloat16):
        self.layout, self.batch, self.page_size = layout, batch, page_size
        self.lengths = np.asarray(lengths, np.int32)
        self.pps = int(-(-self.lengths.max() // page_size))
        n = batch * self.pps * copies + 1
        ks = jax.random.split(key, 4)
        self.k = randn(ks[0], (n, page_size, layout.k_cols), dtype)
        self.v = randn(ks[1], (n, page_size, layout.v_cols), dtype)
        self.q = randn(ks[2], (batch, layout.q_cols), dtype)
        seed = int(jax.random.randint(ks[3], (), 0, 2 ** 31 - 1))
        perm = np.random.default_rng(seed).permutation(np.arange(1, n)).astype(np.int32)
        self.tables = jnp.asarray(perm[: batch * self.pps * copies].reshape(copies, batch, self.pps))

    @property
    def bytes(self) -> int:
        lay = self.layout
        return int(self.lengths.sum()) * (lay.k_cols + lay.v_cols) * 2 + self.batch * (lay.q_cols + lay.out_cols) * 2


def copies_for(bytes_per_call: int) -> int:
    return max(1, min(16, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))


# ---------------------------------------------------------------- timing

def batched(fn, chain=None):
    """``fn`` over a list of argument sets in one jitted function (see ``time_calls``)."""
    def many(shared, calls):
        shared, outs = list(shared), []
        for c in calls:
            res = fn(*shared, *c)
            if chain:
                for i, x in zip(chain, res[1:]):
                    shared[i] = x
                res = res[0]
            outs.append(res)
        return outs
    return jax.jit(many)


def compile_ahead(lowerings, threads=16):
    """Compile side by side in threads, into JAX's persistent cache: ``lowerings`` are zero-argument functions that
    return a ``jax.stages.Lowered`` (``timing_job`` makes one for ``time_calls``). Returns each one's error (None
    when it compiled), so a sweep can skip a variant the GPU cannot run (e.g. too much shared memory).

    A width-mixed Triton kernel takes 20-90 s to compile, mostly in XLA/Triton/ptxas with the GIL released, so N
    variants cost far less than N compiles; the later calls load each from the cache."""
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(lower):
        try:
            lower().compile()
        except Exception as e:  # noqa: BLE001 - reported per variant
            return e

    if not jax.config.jax_compilation_cache_dir or not lowerings:
        return [None] * len(lowerings)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(threads, len(lowerings))) as pool:
        errors = list(pool.map(compile_one, lowerings))
    log(f"compiled {len(lowerings)} variants side by side in {time.perf_counter() - t0:.0f} s")
    return errors


def timing_job(fn, shared, per_call, chain=None):
    """The lowering ``time_calls(fn, shared, per_call, chain=chain)`` will compile, for ``compile_ahead``."""
    return lambda: batched(fn, chain).lower(shared, per_call)


def time_calls(fn, shared, per_call, min_total_s=0.05, reps=5, chain=None):
    """Median seconds per call of ``fn(*shared, *per_call[u])`` over the U argument sets, run in one jitted function.

    The U calls differ in their inputs (so none is merged with another) and all their outputs are returned (so
    nothing is sliced away). With the host timer, dispatches are queued back to back and only the last is waited
    for; with ``--timer cupti``, CUPTI sums the kernels' own durations (``jax.experimental.mosaic.gpu.profiler``),
    so launch gaps and host noise drop out: the timer for calls too short to time from the host (a single
    sequence's decode). ``chain``: the indices of ``shared`` that each call returns updated (after its first
    output) for the next call (pages).
    """
    f = batched(fn, chain)
    if TIMER["name"] == "cupti":
        from jax.experimental.mosaic.gpu import profiler

        _, ms = profiler.measure(f, iterations=reps)(shared, per_call)  # runs a warm-up call first
        return statistics.median(ms) / 1e3 / len(per_call)
    jax.block_until_ready(f(shared, per_call))
    t0 = time.perf_counter()
    jax.block_until_ready(f(shared, per_call))
    est = time.perf_counter() - t0
    n = max(1, min(50, int(min_total_s / max(est, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(shared, per_call)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (n * len(per_call)))
        del out
    return statistics.median(times)


def copy_bandwidth():
    """Bytes read + written per second by a 1 GiB elementwise pass (one call per dispatch: sibling calls on one
    input would be fused into a single read)."""
    x = randn(jax.random.key(0), (1 << 29,))  # 1 GiB bf16
    t = time_calls(lambda x: -x, (), [(x,)], min_total_s=0.1)
    return 2 * x.size * 2 / t


def matmul_rate():
    ks = jax.random.split(jax.random.key(1), 5)
    b = randn(ks[0], (8192, 8192))
    t = time_calls(lambda b, a: a @ b, (b,), [(randn(k, (8192, 8192)),) for k in ks[1:]])
    return 2 * 8192 ** 3 / t


def queries(key, shape, n=8, dtype=jnp.bfloat16):
    return [(randn(k, shape, dtype),) for k in jax.random.split(key, n)]


def rel_err(out, ref):
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


# ---------------------------------------------------------------- decode variants
# Each returns (fn, shared, per_call) for ``time_calls``; per-call inputs are fresh queries (and block tables
# rotating over disjoint pages).

def kvjax_decode_call(case, sched, key, **knobs):
    lay, lengths = case.layout, jnp.asarray(case.lengths)
    fn = lambda k, v, lengths, s, q, table: paged_decode(q, k, v, table, lengths, s, lay, **knobs)
    qs = queries(key, (case.batch, lay.q_cols))
    per_call = [(q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(qs)]
    return fn, (case.k, case.v, lengths, sched), per_call


def jax_paged_call(case, key, pages_per_block, splits):
    """JAX's Pallas paged_attention on the uncompressed cache (head-major pools, as it wants them)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    n = case.k.shape[0]
    k = case.k.reshape(n, case.page_size, HKV, D).transpose(2, 0, 1, 3)
    v = case.v.reshape(n, case.page_size, HKV, D).transpose(2, 0, 1, 3)
    fn = lambda k, v, lengths, q, table: paged_attention(q, k, v, table, lengths,
                                                         pages_per_compute_block=pages_per_block, k_splits=splits)
    qs = queries(key, (case.batch, HQ, D))
    per_call = [(q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(qs)]
    return fn, (k, v, jnp.asarray(case.lengths)), per_call


def cudnn_decode_call(case, key):
    ks = jax.random.split(key, 3)
    s = int(case.lengths.max())
    k = randn(ks[1], (case.batch, s, HKV, D))
    v = randn(ks[2], (case.batch, s, HKV, D))
    fn = lambda k, v, lengths, q: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                               implementation="cudnn")
    return fn, (k, v, jnp.asarray(case.lengths)), queries(ks[0], (case.batch, 1, HQ, D))


def palu_decode_call(case, layout, key):
    """Palu: K cached as a latent (rank r), rebuilt to full width each step, RoPE'd, full-width attention; V latent."""
    ks = jax.random.split(key, 5)
    s = int(case.lengths.max())
    r = 16 * round(layout.k_cols / HKV / 16)
    rv = 16 * round(layout.v_cols / HKV / 16)
    k_lat = randn(ks[0], (case.batch, s, HKV, r))
    v_lat = randn(ks[1], (case.batch, s, HKV, rv))
    up = randn(ks[2], (HKV, r, D)) / math.sqrt(r)
    inv = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    ang = np.arange(s)[:, None] * inv[None]
    cos = jnp.asarray(np.concatenate([np.cos(ang)] * 2, -1), jnp.float32)
    sin = jnp.asarray(np.concatenate([np.sin(ang)] * 2, -1), jnp.float32)

    def fn(k_lat, v_lat, cos, sin, q, up):
        k = jnp.einsum("bshr,hrd->bshd", k_lat, up, preferred_element_type=jnp.float32)
        rot = jnp.concatenate([-k[..., D // 2:], k[..., : D // 2]], -1)
        k = (k * cos[None, :, None] + rot * sin[None, :, None]).astype(jnp.bfloat16)
        sc = jnp.einsum("bhgd,bshd->bhgs", q, k, preferred_element_type=jnp.float32) / math.sqrt(D)
        p = jax.nn.softmax(sc, axis=-1).astype(jnp.bfloat16)
        return jnp.einsum("bhgs,bshr->bhgr", p, v_lat)
    nbytes = case.batch * s * HKV * (r + rv) * 2
    # each call gets its own up-projection too: a rebuild from shared inputs alone would be computed once per batch
    per_call = [(q, up * (1 + u / 64)) for u, (q,) in enumerate(queries(ks[3], (case.batch, HKV, HQ // HKV, D)))]
    return fn, (k_lat, v_lat, cos, sin), per_call, nbytes, r, rv


# ---------------------------------------------------------------- correctness

def highest(fn, *args):
    """The jnp reference in float32 with exact matmuls (XLA's GPU default for float32 is TF32), jitted as a whole:
    run op by op, the per-head reference of a 32-head layer spent about a minute compiling its many small ops."""
    arrays = [a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args[:-1]]
    with jax.default_matmul_precision("highest"):
        return jax.jit(fn, static_argnums=len(arrays))(*arrays, args[-1])


def worst_head(out, ref, layout, cols):
    """(error of the worst KV group, its index): localizes a wrong width class."""
    errs = []
    starts = HeadLayout.offsets(cols, layout.group_size)
    for g, (st, w) in enumerate(zip(starts, cols)):
        sl = slice(st, st + layout.group_size * w)
        errs.append(rel_err(out[..., sl], ref[..., sl]))
    return max(errs), int(np.argmax(errs))


def decode_check_inputs(key, layout, batch, lengths, page_size, dtype, num_programs=None, headroom=1,
                        pack_tile=PACK_TILE):
    """``paged_decode``'s arguments for one check case."""
    case = PagedCase(layout, batch, lengths, page_size, 1, key, dtype)
    plan = build_decode_schedule(case.lengths, layout, page_size, num_programs, headroom_pages=headroom,
                                 min_chunk_tokens=page_size, pack_tile=pack_tile)
    return case.q, case.k, case.v, case.tables[0], jnp.asarray(case.lengths), plan.schedule.layer(0), layout


def check_decode(args):
    out = paged_decode(*args)
    (q, k, v, table, lengths), layout = args[:5], args[-1]
    ref = highest(lambda q, k, v, lay: attention.paged_decode_attention(q, k, v, table, lengths, lay),
                  q, k, v, layout)
    return rel_err(out, ref), worst_head(out, ref, layout, layout.v_widths)


def prefill_check_inputs(key, layout, batch, seq_len, dtype, page_size=32):
    """``prefill_attention``'s arguments for one check case (random prompts and pages, a shuffled block table)."""
    ks = jax.random.split(key, 6)
    q = randn(ks[0], (batch, seq_len, layout.q_cols), dtype)
    k = randn(ks[1], (batch, seq_len, layout.k_cols), dtype)
    v = randn(ks[2], (batch, seq_len, layout.v_cols), dtype)
    pps = -(-seq_len // page_size)
    n = batch * pps + 1
    seed = int(jax.random.randint(ks[3], (), 0, 2 ** 31 - 1))
    table = jnp.asarray(np.random.default_rng(seed).permutation(np.arange(1, n)).reshape(batch, pps).astype(np.int32))
    kp = randn(ks[4], (n, page_size, layout.k_cols), dtype)
    vp = randn(ks[5], (n, page_size, layout.v_cols), dtype)
    return q, k, v, layout, jnp.full((batch,), seq_len, jnp.int32), kp, vp, table


def check_prefill(args):
    q, k, v, layout, _, _, _, table = args
    batch, seq_len = q.shape[:2]
    out, kp, vp = prefill_attention(*args)
    ref = highest(lambda q, k, v, lay: attention.causal_attention(q, k, v, lay), q, k, v, layout)
    pages_ok = bool(jnp.array_equal(kp[table].reshape(batch, -1, layout.k_cols)[:, :seq_len], k)
                    & jnp.array_equal(vp[table].reshape(batch, -1, layout.v_cols)[:, :seq_len], v))
    return rel_err(out, ref), pages_ok, worst_head(out, ref, layout, layout.v_widths)


ODD = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
# heads too wide for 128-key prefill steps (keys_per_step gives them 64) beside narrow ones
WIDE = HeadLayout(32, 8, 128, (112, 128, 16, 96, 112, 64, 128, 48), (112, 16, 128, 112, 80, 128, 96, 48))
WINDOWED = HeadLayout(8, 8, 64, (64, 16, 32, 48, 64, 16, 32, 48), (16,) * 4 + (64,) * 4, 300)


def print_checks(rows):
    print("\n| kernel | case | dtype | rel. error | worst group | ok |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1e} | {r[4]} | {'yes' if r[5] else 'NO'} |", flush=True)


def decode_checks(key, match=""):
    """Every decode shape class: GQA groups 1, 2, 4, 8; pages 16 and 32; ragged, 1-token and 32K sequences;
    a sliding window; split groups (merge); bf16 and float32; rate-0, rate-0.5 and odd (non power of two) widths;
    one head per unit, and runs of heads through 128- and 256-column tiles (the default: read in pieces where they
    save columns)."""
    keys = iter(jax.random.split(key, 16))
    bf, f32 = jnp.bfloat16, jnp.float32
    r05, r07 = pick_layer(rank_plan(0.5), 0.5), pick_layer(rank_plan(0.7), 0.7)
    cases = [
        ("llama r0.5 B32 4K p32", r05, 32, np.full(32, 4096), 32, bf, 0),
        ("llama r0 B8 ragged p16", HeadLayout.uniform(32, 8, 128), 8, np.linspace(100, 3000, 8).astype(int), 16, bf,
         0),
        ("odd widths B4 ragged p16", ODD, 4, [1, 17, 600, 2049], 16, f32, 0),
        ("G1 window 300 p16", WINDOWED, 3, [1000, 299, 5], 16, bf, 0),
        ("G8 B1 32K p32", HeadLayout(32, 4, 128, (32, 64, 96, 128), (128, 96, 64, 32)), 1, [32768], 32, bf,
         0),
        ("G2 p32", HeadLayout(4, 2, 64, (32, 64), (64, 16)), 5, [33, 64, 65, 700, 1], 32, f32, 0),
        # runs of adjacent heads read as one (kvjax.runs), at both run widths
        ("packed 128: llama r0.7 B32 4K p32", r07, 32, np.full(32, 4096), 32, bf, 128),
        ("packed 256: llama r0.5 B32 4K p32", r05, 32, np.full(32, 4096), 32, bf, 256),
        ("packed 256: llama r0.5 filled B32 4K p32", pick_layer(rank_plan(0.5, form="filled"), 0.5), 32,
         np.full(32, 4096), 32, bf, 256),
        ("packed 256: llama r0 B8 ragged p16", HeadLayout.uniform(32, 8, 128), 8, np.linspace(100, 3000, 8).astype(int),
         16, bf, 256),
        ("packed 128: odd widths B4 ragged p16", ODD, 4, [1, 17, 600, 2049], 16, f32, 128),
        ("packed 256: G1 window 300 p16", WINDOWED, 3, [1000, 299, 5], 16, bf, 256),
        ("packed 256: G8 B1 32K p32", HeadLayout(32, 4, 128, (32, 64, 96, 128), (128, 96, 64, 32)), 1, [32768], 32,
         bf, 256),
        ("packed 128: G2 p32", HeadLayout(4, 2, 64, (32, 64), (64, 16)), 5, [33, 64, 65, 700, 1], 32, f32, 128),
    ]
    cases = [(name, dt, decode_check_inputs(next(keys), lay, b, lengths, ps, dt, pack_tile=pack))
             for name, lay, b, lengths, ps, dt, pack in cases if match in name]
    compile_ahead([lambda a=args: paged_decode.lower(*a) for _, _, args in cases])
    rows = []
    for name, dt, args in cases:
        err, (worst, head) = check_decode(args)
        log(f"decode check {name}: {err:.1e}")
        tol = 1e-2 if dt == bf else 1e-4
        rows.append(("decode", name, jnp.dtype(dt).name, err, f"{worst:.1e} (kv head {head})", err < tol))
    print_checks(rows)
    log("decode checks done")
    return rows


def prefill_checks(key, match=""):
    """Prefill (default knobs) on the rate-0.5 plan, odd widths in float32 and a G=1 sliding window; pages too."""
    keys = iter(jax.random.split(key, 16))
    bf, f32 = jnp.bfloat16, jnp.float32
    cases = [
        ("llama r0.5 B1 2K", pick_layer(rank_plan(0.5), 0.5), 1, 2048, bf),
        ("odd widths B2 1000", ODD, 2, 1000, f32),
        ("odd widths B1 1000", ODD, 1, 1000, bf),
        ("wide classes B1 1000", WIDE, 1, 1000, bf),
        ("G1 window 300", WINDOWED, 2, 700, bf),
    ]
    cases = [(name, dt, prefill_check_inputs(next(keys), lay, b, t, dt)) for name, lay, b, t, dt in cases
             if match in name]
    compile_ahead([lambda a=args: prefill_attention.lower(*a) for _, _, args in cases])
    rows = []
    for name, dt, args in cases:
        err, pages_ok, (worst, head) = check_prefill(args)
        log(f"prefill check {name}: {err:.1e}")
        tol = 1e-2 if dt == bf else 1e-4
        rows.append(("prefill", name + ("" if pages_ok else " PAGES WRONG"), jnp.dtype(dt).name, err,
                     f"{worst:.1e} (kv head {head})", err < tol and pages_ok))
    print_checks(rows)
    log("prefill checks done")
    return rows


# ---------------------------------------------------------------- tables

def log(msg):
    print(f"[{time.perf_counter() - START:.0f}s] {msg}", file=sys.stderr, flush=True)


START = time.perf_counter()


def print_row(r):
    ratio = r["time_us"] / r["floor_us"]
    speedup = f"{r['speedup_vs_rate0']:.2f}x" if r.get("speedup_vs_rate0") else ""
    print(f"| {r['kernel']} | {r['batch']} | {r['ctx']} | {r['rate']} | {r['widths']} | {r['time_us']:.1f} | "
          f"{r['floor_us']:.1f} | {ratio:.2f} | {100 / ratio:.0f}% | {speedup} |", flush=True)


DECODE_DEFAULTS = dict(programs=264, order=ORDER, pack_tile=PACK_TILE, tile_weight=TILE_WEIGHT,
                       floor_tile=FLOOR_TILE, token_cost=TOKEN_COST, block_tokens=64, max_step_tokens=512,
                       fold_tokens=64, max_segments=2, num_warps=4, num_stages=3)  # the schedule's and the kernel's
SWEPT = ("order", "pack_tile", "tile_weight", "floor_tile", "token_cost", "programs", "num_warps", "num_stages",
         "block_tokens", "max_segments")
# the previous sweeps (warps, stages, pieces, folding; orders, packing, cost model, tokens per step, the cost
# floor, pieces x run width) are in RESULTS.md; this one: the schedule's unit costs, a floor or a large fixed cost
# per token (runs stay those of the default model)
DECODE_SWEEP = [dict(DECODE_DEFAULTS, floor_tile=f, token_cost=c) for f, c in ((FLOOR_TILE, TOKEN_COST), (0, 256),
                                                                               (FLOOR_TILE, 256))]
SCHEDULE_KNOBS = ("programs", "order", "pack_tile", "tile_weight", "floor_tile", "token_cost")


def knobs_of(cfg):
    """The kernel's keyword arguments in a config (everything but what the schedule fixes)."""
    return {k: v for k, v in cfg.items() if k not in SCHEDULE_KNOBS}


def schedule_of(case, cfg, **options):
    """The plan for a case under a config's schedule knobs (program count, order, head packing); ``options``
    override them."""
    options = dict({k: cfg[k] for k in SCHEDULE_KNOBS if k != "programs"}, **options)
    return build_decode_schedule(case.lengths, case.layout, case.page_size, cfg["programs"], **options)


def decode_autotune(key, bw, rates, batch=32, ctx=4096):
    """Per rate plan, the fastest of DECODE_SWEEP at one shape (batch 32, 4K unless --tune-shape; the table then
    uses it for every shape); every variant of every rate is compiled ahead, side by side."""
    print(f"\n{batch} x {ctx}:\n| rate | {' / '.join(SWEPT)} | time us | % of copy bw |\n|---|---|---|---|")
    jobs = []
    for rate in rates:
        lay = pick_layer(rank_plan(rate), rate)
        case = PagedCase(lay, batch, np.full(batch, ctx), 32, copies_for(batch * ctx * (lay.k_cols + lay.v_cols) * 2),
                         key)
        for cfg in DECODE_SWEEP:
            sched = schedule_of(case, cfg).schedule.layer(0)
            jobs.append((rate, cfg, case.bytes, kvjax_decode_call(case, sched, key, **knobs_of(cfg))))
    compile_ahead([timing_job(*job) for *_, job in jobs])
    best = {}
    for rate, cfg, nbytes, job in jobs:
        t = time_calls(*job)
        print(f"| {rate} | {' / '.join(str(cfg[n]) for n in SWEPT)} | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |",
              flush=True)
        if rate not in best or t < best[rate][0]:
            best[rate] = (t, cfg)
    del jobs
    log("decode autotune done")
    return {r: cfg for r, (t, cfg) in best.items()}


def decode_table(key, bw, shapes, rates, quick, tuned, orders=("lpt", "naive"), forms=("ordered",)):
    """kvjax (per-rate tuned knobs) vs naive order, JAX paged_attention, cuDNN and Palu, beside the floor.

    forms: of the rank plans (``rank_plan``): "ordered" (as compression stores them by default), "filled" (its
    opt-in fill of the runs' tiles) and "drawn" (heads in the drawn order: the ablation)."""
    print("\n| kernel | batch | ctx | rate | K+V cols | time us | floor us | time/floor | % of copy bw | vs rate 0 |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    variants = {r: [(o, f) for f in (forms if r > 0 else ("ordered",)) for o in (orders if r > 0 else
                                                                                  (tuned[r]["order"],))]
                for r in rates}
    layers = {(r, f): pick_layer(rank_plan(r, form=f), r) for r in rates for _, f in variants[r]}
    for batch, ctx in shapes:
        # every case, plan and kvjax call of the shape first, so their kernels compile side by side
        cases, calls = {}, {}
        for rate in rates:
            for order, form in variants[rate]:
                lay = layers[rate, form]
                nbytes = batch * ctx * (lay.k_cols + lay.v_cols) * 2
                if (rate, form) not in cases:
                    cases[rate, form] = PagedCase(lay, batch, np.full(batch, ctx), 32, copies_for(nbytes), key)
                case = cases[rate, form]
                t0 = time.perf_counter()
                plan = schedule_of(case, tuned[rate], order=order)
                host = time.perf_counter() - t0
                call = kvjax_decode_call(case, plan.schedule.layer(0), key, **knobs_of(tuned[rate]))
                calls[rate, order, form] = host, call
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
                rows.append(dict(kernel=f"kvjax {order}" + (f" ({form} plan)" if form != "ordered" else ""),
                                 batch=batch, ctx=ctx, rate=rate, widths=f"{lay.k_cols}+{lay.v_cols}",
                                 time_us=t * 1e6, floor_us=floor * 1e6,
                                 speedup_vs_rate0=(base / t) if base else None, host_ms=host * 1e3))
                print_row(rows[-1])
                del call
            case = cases.get((rate, "ordered")) or cases[rate, forms[0]]
            lay = case.layout
            floor = case.bytes / bw
            if rate == 0:
                best = None
                for ppb, splits in ((4, 16 if ctx >= 16384 else 8),):
                    if case.pps % splits or (case.pps // splits) % min(ppb, case.pps // splits):
                        continue
                    t = time_calls(*jax_paged_call(case, key, ppb, splits))
                    best = t if best is None else min(best, t)
                if best:
                    rows.append(dict(kernel="jax paged_attention", batch=batch, ctx=ctx, rate=0.0,
                                     widths="1024+1024", time_us=best * 1e6, floor_us=floor * 1e6,
                                     speedup_vs_rate0=base / best))
                    print_row(rows[-1])
                t = time_calls(*cudnn_decode_call(case, key))
                rows.append(dict(kernel="cudnn (contiguous)", batch=batch, ctx=ctx, rate=0.0, widths="1024+1024",
                                 time_us=t * 1e6, floor_us=floor * 1e6, speedup_vs_rate0=base / t))
                print_row(rows[-1])
            if rate == 0.5 and not quick and batch >= 32 and ctx >= 4096:
                fn, shared, per_call, pbytes, r, rv = palu_decode_call(case, lay, key)
                t = time_calls(fn, shared, per_call)
                rows.append(dict(kernel=f"palu (K rank {r}, V {rv})", batch=batch, ctx=ctx, rate=rate,
                                 widths=f"{HKV * r}+{HKV * rv}", time_us=t * 1e6, floor_us=pbytes / bw * 1e6,
                                 speedup_vs_rate0=base / t))
                print_row(rows[-1])
            del case
        del cases
        log(f"decode {batch}x{ctx} done")
    return rows


def pad_schedule(s: DecodeSchedule, rounds: int, groups: int, splits: int) -> DecodeSchedule:
    """One layer's schedule in larger fixed shapes (partial slots renumbered), so that differently built plans of
    one layout share one compiled kernel in a comparison."""
    S = s.merge_slots.shape[1]
    renumber = lambda slot: np.where(slot >= 0, slot // S * splits + slot % S, slot)  # noqa: E731
    items = np.zeros(s.items.shape[:1] + (rounds, 5), np.int32)
    items[:, : s.items.shape[1]] = s.items
    items[..., SLOT] = renumber(items[..., SLOT])
    dest = np.full((groups, 2), -1, np.int32)
    dest[: len(s.merge_dest)] = s.merge_dest
    slots = np.full((groups, splits), -1, np.int32)
    slots[: len(s.merge_slots), :S] = renumber(s.merge_slots)
    return DecodeSchedule(items, s.counts, dest, slots, s.pack_tile)


# the second session's LPT options (one head per unit, costs from widths), kept to rerun that table
SCHEDULE_VARIANTS = [dict(order="lpt", pack_tile=0, tile_weight=0, **v) for v in (
    dict(items_per_program=1, token_cost=0), dict(items_per_program=2, token_cost=0),
    dict(items_per_program=1, token_cost=32), dict(items_per_program=2, token_cost=32))]


def schedule_table(key, bw, cases, programs=264):
    """Planner options side by side on one compiled kernel per case: finer items (more to balance, more merges)
    and a per-token cost that weighs narrow heads above their bytes."""
    print("\n| plan | batch | ctx | items per program | token cost | items | planned balance | time us | "
          "% of copy bw |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for rate, batch, ctx in cases:
        lay = pick_layer(rank_plan(rate), rate)
        nbytes = batch * ctx * (lay.k_cols + lay.v_cols) * 2
        case = PagedCase(lay, batch, np.full(batch, ctx), 32, copies_for(nbytes), key)
        plans = [build_decode_schedule(case.lengths, lay, 32, programs, **v) for v in SCHEDULE_VARIANTS]
        shape = [max(p.schedule.layer(0).items.shape[1] for p in plans),
                 max(p.schedule.layer(0).merge_slots.shape[0] for p in plans),
                 max(p.schedule.layer(0).merge_slots.shape[1] for p in plans)]
        for v, plan in zip(SCHEDULE_VARIANTS, plans):
            t = time_calls(*kvjax_decode_call(case, pad_schedule(plan.schedule.layer(0), *shape), key))
            rows.append(dict(rate=rate, batch=batch, ctx=ctx, **v, items=int(plan.num_items[0]),
                             balance=plan.balance, time_us=t * 1e6, pct=100 * case.bytes / bw / t))
            print(f"| r{rate} | {batch} | {ctx} | {v['items_per_program']} | {v['token_cost']} | "
                  f"{rows[-1]['items']} | {plan.balance:.3f} | {t * 1e6:.1f} | {rows[-1]['pct']:.0f}% |", flush=True)
        del case
    log("schedule table done")
    return rows


def lpt_table(key, bw, cases, tuned, forms=("ordered",)):
    """Stream vs LPT vs naive order on ragged batches (lengths uniform in [ctx/8, ctx]) with per-head width
    variation (the tuned config otherwise), for each form of the rank plans (``rank_plan``)."""
    print("\n| plan | batch | max ctx | order | time us | floor us | % of copy bw | planned balance | host plan ms |"
          "\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (rate, batch, ctx), form in itertools.product(cases, forms):
        lay = pick_layer(rank_plan(rate, form=form), rate)
        name = f"r{rate}" + (f" {form}" if form != "ordered" else "")
        lengths = np.random.default_rng(batch * ctx).integers(ctx // 8, ctx + 1, batch)
        nbytes = int(lengths.sum()) * (lay.k_cols + lay.v_cols) * 2
        case = PagedCase(lay, batch, lengths, 32, copies_for(nbytes), key)
        floor = case.bytes / bw
        cfg = tuned[rate]
        knobs = knobs_of(cfg)
        for order in ("auto", "stream", "lpt", "naive"):
            t0 = time.perf_counter()
            plan = schedule_of(case, cfg, order=order)
            host = time.perf_counter() - t0
            t = time_calls(*kvjax_decode_call(case, plan.schedule.layer(0), key, **knobs))
            rows.append(dict(rate=rate, form=form, batch=batch, ctx=ctx, order=order, time_us=t * 1e6,
                             floor_us=floor * 1e6, host_ms=host * 1e3, balance=plan.balance))
            print(f"| {name} | {batch} | {ctx} | {order} | {t * 1e6:.1f} | {floor * 1e6:.1f} | "
                  f"{100 * floor / t:.0f}% | {plan.balance:.3f} | {host * 1e3:.2f} |", flush=True)
    return rows


def schedule_cost(decode_us_per_layer: float | None, bw: float, steps: int = 1024):
    """Host plan cost for a 32-layer rate-0.5 model at batch 256: per build, and over a run of decode steps (every
    sequence one token longer per step) kept by DecodePlanner; the balance that aged plans meet at the real lengths
    (``realized_loads``) beside fresh plans'; the headroom trade-off, rebuilds against aged balance; and what a step
    loses to planning with builds in the step or ahead on the planner's thread, beside sleeps standing in for the
    device steps (the host's wait)."""
    layouts, ps = rank_plan(0.5), 16
    lengths = np.random.default_rng(0).integers(256, 769, 256)  # mean 512: the shortest step measured, most share
    default = DecodePlanner(layouts, ps)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        default.build(lengths)
        times.append(time.perf_counter() - t0)
    build = statistics.median(times)
    weights = 16e9 / bw  # Llama-3.1-8B bf16 weights read once per step
    step_s = 32 * decode_us_per_layer * 1e-6 + weights if decode_us_per_layer else None

    def run(planner, steps, device_s=0.0, every=16):
        """Host seconds each step spends past ``device_s`` (in the planner, or waiting for the GIL after the sleep),
        and the balance of its plan at the real lengths every few steps. The first step always builds its plan:
        ``worst`` leaves it out."""
        spent, balance = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            planner(lengths + s)
            if device_s:
                time.sleep(device_s)
            spent.append(time.perf_counter() - t0 - device_s)
            if s % every == 0:
                balance.append(load_balance(realized_loads(planner.plan.schedule, lengths + s, layouts, ps)))
        return np.array(spent), np.array(balance)

    fresh = np.mean([load_balance(realized_loads(build_decode_schedule(lengths + s, layouts, ps).schedule,
                                                 lengths + s, layouts, ps)) for s in range(0, steps, 64)])
    print(f"\nschedule host cost, 32 layers of the rate-0.5 plan, batch 256, lengths 256..768 growing one token a "
          f"step, page 16, {default.num_programs} programs: {build * 1e3:.2f} ms per build (median of 20); balance "
          f"at the real lengths of a fresh plan every step {fresh:.3f}")
    print(f"\n| headroom tokens | rebuilds in {steps} steps | ms/step amortized | worst step ms | aged balance mean "
          f"| aged balance worst |\n|---|---|---|---|---|---|")
    sweep = []
    for headroom in sorted({16, 64, 128, 256, 512, default.headroom_tokens}):
        planner = DecodePlanner(layouts, ps, headroom_tokens=headroom, ahead=False)
        spent, balance = run(planner, steps)
        sweep.append(dict(headroom_tokens=headroom, rebuilds=planner.rebuilds, amortized_ms=spent.mean() * 1e3,
                          worst_ms=spent[1:].max() * 1e3, balance_aged=balance.mean(), balance_aged_min=balance.min()))
        print(f"| {headroom}{' (default)' if headroom == default.headroom_tokens else ''} | {planner.rebuilds} | "
              f"{spent.mean() * 1e3:.4f} | {spent[1:].max() * 1e3:.2f} | {balance.mean():.3f} | {balance.min():.3f} |")
    res = dict(build_ms=build * 1e3, steps=steps, balance_fresh=fresh, sweep=sweep,
               **next(row for row in sweep if row["headroom_tokens"] == default.headroom_tokens))

    device_s = step_s or 0.011
    print(f"\nhost time per step past a {device_s * 1e3:.1f} ms sleep standing in for the device step, {steps // 2} "
          f"steps, default planner:")
    for ahead in (False, True):
        planner = DecodePlanner(layouts, ps, ahead=ahead)
        spent, _ = run(planner, steps // 2, device_s, every=steps)
        name = "ahead" if ahead else "in_step"
        res.update({f"{name}_ms": np.median(spent) * 1e3, f"{name}_worst_ms": spent[1:].max() * 1e3})
        print(f"  built {'ahead' if ahead else 'in the step'}: {planner.rebuilds} plans ({planner.built_ahead} built "
              f"ahead), median {res[f'{name}_ms']:.3f} ms, worst after the first {res[f'{name}_worst_ms']:.2f} ms")
    if step_s:
        res.update(step_ms=step_s * 1e3, build_pct=100 * build / step_s,
                   amortized_pct=100 * res["amortized_ms"] * 1e-3 / step_s,
                   ahead_worst_pct=100 * res["ahead_worst_ms"] * 1e-3 / step_s)
        print(f"decode step estimate (32 x measured attention at batch 256, 512 tokens + 16 GB of weights at copy "
              f"bandwidth): {step_s * 1e3:.2f} ms -> plan {res['build_pct']:.2f}% per build, "
              f"{res['amortized_pct']:.3f}% amortized; built ahead, {res['ahead_worst_pct']:.2f}% of a step at worst")
    return res


PREFILL_DEFAULTS = dict(block_q=128, block_k=128, max_block_q=128, max_segments=3, num_warps=8, num_stages=3)
PREFILL_SWEPT = ("block_q", "block_k", "max_segments", "num_warps", "num_stages")
PREFILL_SWEEP = [dict(PREFILL_DEFAULTS, **dict(zip(PREFILL_SWEPT, v)))
                 for v in ((128, 128, 3, 8, 3), (128, 128, 1, 8, 3), (128, 128, 3, 4, 3), (64, 128, 3, 4, 3),
                           (128, 128, 3, 8, 4), (64, 64, 3, 4, 3), (128, 128, 3, 4, 2), (128, 64, 3, 8, 3))]


def prefill_sweep(key, flops_rate, batch=1, t=4096, rate=0.5):
    """Balanced prefill knobs at rate 0.5: each checked against the reference, timed; returns the fastest correct."""
    names = ("block_q", "block_k", "max_block_q", "max_segments", "num_warps", "num_stages")
    print(f"\n| {' / '.join(names)} | rel. error | time ms | % of matmul rate |\n|---|---|---|---|")
    lay = pick_layer(rank_plan(rate), rate)
    ks = jax.random.split(key, 4)
    qs = queries(ks[0], (batch, t, lay.q_cols), 4)
    k, v = randn(ks[1], (batch, t, lay.k_cols)), randn(ks[2], (batch, t, lay.v_cols))
    ref = highest(lambda q, k, v, lay: attention.causal_attention(q, k, v, lay), qs[0][0], k, v, lay)
    flops = 2 * batch * t * (t + 1) / 2 * lay.group_size * (lay.k_cols + lay.v_cols)
    jobs = [(functools.partial(lambda k, v, q, cfg: prefill_attention(q, k, v, lay, **cfg), cfg=cfg), (k, v), qs)
            for cfg in PREFILL_SWEEP]
    errors = compile_ahead([timing_job(*job) for job in jobs])
    best = None
    for cfg, job, error in zip(PREFILL_SWEEP, jobs, errors):
        if error is not None:
            print(f"| {' / '.join(str(cfg[n]) for n in names)} | does not compile: {str(error)[:80]} | | |")
            continue
        err = rel_err(batched(job[0])(job[1], job[2])[0], ref)
        tm = time_calls(*job)
        print(f"| {' / '.join(str(cfg[n]) for n in names)} | {err:.1e} | {tm * 1e3:.3f} | "
              f"{100 * flops / flops_rate / tm:.0f}% |", flush=True)
        if err < 1e-2 and (best is None or tm < best[0]):
            best = (tm, cfg)
    log("prefill sweep done")
    return best[1] if best else PREFILL_DEFAULTS


def prefill_table(key, flops_rate, cases, knobs):
    """Balanced (``knobs``) vs unbalanced (128-row blocks for every head, natural order) vs cuDNN."""
    print(f"\nbalanced knobs: {knobs}")
    print("\n| kernel | batch | T | rate | time ms | floor ms | time/floor | % of matmul rate | vs cuDNN |"
          "\n|---|---|---|---|---|---|---|---|---|")
    specs = []  # (row without time, job): every kvjax job is compiled ahead, side by side
    for batch, t, rates in cases:
        pairs = t * (t + 1) / 2
        for rate, variants in rates:
            lay = pick_layer(rank_plan(rate), rate)
            ks = jax.random.split(key, 4)
            if rate == 0:
                kf = randn(ks[1], (batch, t, HKV, D))
                vf = randn(ks[2], (batch, t, HKV, D))
                fn = lambda k, v, q: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
                specs.append((dict(kernel="cudnn (uncompressed)", batch=batch, t=t, rate=0.0,
                                   floor_ms=2 * batch * pairs * HQ * 2 * D / flops_rate * 1e3),
                              (fn, (kf, vf), queries(ks[0], (batch, t, HQ, D), 4))))
            k = randn(ks[1], (batch, t, lay.k_cols))
            v = randn(ks[2], (batch, t, lay.v_cols))
            pps = t // 32
            kp = randn(ks[3], (batch * pps + 1, 32, lay.k_cols))
            vp = randn(ks[3], (batch * pps + 1, 32, lay.v_cols))
            table = jnp.arange(1, batch * pps + 1, dtype=jnp.int32).reshape(batch, pps)
            lengths = jnp.full((batch,), t, jnp.int32)
            flops = 2 * batch * pairs * lay.group_size * (lay.k_cols + lay.v_cols)
            for balanced in variants:
                kn = knobs if balanced else dict(knobs, block_q=128, max_block_q=128)
                fn = functools.partial(_prefill_fn, layout=lay, balanced=balanced, knobs=kn)
                specs.append((dict(kernel="kvjax " + ("balanced" if balanced else "unbalanced"), batch=batch, t=t,
                                   rate=rate, floor_ms=flops / flops_rate * 1e3),
                              (fn, (k, v, kp, vp, table, lengths), queries(ks[0], (batch, t, lay.q_cols), 4),
                               (2, 3))))
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


def _prefill_fn(k, v, kp, vp, table, lengths, q, *, layout, balanced, knobs):
    return prefill_attention(q, k, v, layout, lengths, kp, vp, table, balanced=balanced, **knobs)


def print_prefill(r):
    ratio = r["time_ms"] / r["floor_ms"]
    vs = f"{r['vs_cudnn']:.2f}x" if r.get("vs_cudnn") else ""
    print(f"| {r['kernel']} | {r['batch']} | {r['t']} | {r['rate']} | {r['time_ms']:.3f} | {r['floor_ms']:.3f} | "
          f"{ratio:.2f} | {100 / ratio:.0f}% | {vs} |", flush=True)


def width_sweep(key, bw):
    """Decode at batch 32, 4K: bandwidth by head width (uniform layouts and the rate plans' layers), with each head
    read as one padded power-of-two tile or as exact power-of-two pieces (``max_segments``)."""
    print("\n| layout | pieces | time us | % of copy bw |\n|---|---|---|---|")
    uni = lambda w: HeadLayout(HQ, HKV, D, (w,) * HKV, (w,) * HKV)
    sweep = [("rate 0.5 layer", pick_layer(rank_plan(0.5), 0.5)), ("rate 0.7 layer", pick_layer(rank_plan(0.7), 0.7)),
             ("uniform 48", uni(48)), ("uniform 64", uni(64)), ("uniform 80", uni(80)), ("uniform 96", uni(96)),
             ("uniform 112", uni(112))]
    jobs = {}
    for name, lay in sweep:
        case = PagedCase(lay, 32, np.full(32, 4096), 32, 1, key)
        plan = build_decode_schedule(case.lengths, lay, 32, 264)
        for pieces in ((1, 3) if name != "uniform 64" else (1,)):
            jobs[name, pieces] = case.bytes, kvjax_decode_call(case, plan.schedule.layer(0), key, max_segments=pieces)
    compile_ahead([timing_job(*job) for _, job in jobs.values()])
    for (name, pieces), (nbytes, job) in jobs.items():
        t = time_calls(*job)
        print(f"| {name} | {'one tile' if pieces == 1 else 'exact'} | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |",
              flush=True)
    log("width sweep done")


def per_class_launches(key, bw, lay, batch=32, ctx=4096, programs=264):
    """The experiment behind a design question: the rate-0.5 layer as one launch per width class (each with its
    own schedule and its own compiled code) instead of one launch that switches between classes."""
    subs, inputs, nbytes = [], [], 0
    for cls in width_classes(lay)[0]:
        n = len(cls.heads)
        sub = HeadLayout(lay.group_size * n, n, D, (cls.k_width,) * n, (cls.v_width,) * n)
        case = PagedCase(sub, batch, np.full(batch, ctx), 32, 1, key)
        sched = build_decode_schedule(case.lengths, sub, 32, programs).schedule.layer(0)
        subs.append(sub)
        inputs.append((case.k, case.v, jnp.asarray(case.lengths), sched, case.tables[0]))
        nbytes += case.bytes
    qs = [tuple(randn(k, (batch, sub.q_cols)) for sub in subs) for k in jax.random.split(key, 8)]

    def fn(inputs, qs):
        return [paged_decode(q, k, v, table, lengths, s, sub)
                for sub, (k, v, lengths, s, table), q in zip(subs, inputs, qs)]
    t = time_calls(fn, (inputs,), [(q,) for q in qs])
    case = PagedCase(lay, batch, np.full(batch, ctx), 32, 1, key)
    plan = build_decode_schedule(case.lengths, lay, 32, programs)
    one = time_calls(*kvjax_decode_call(case, plan.schedule.layer(0), key))
    print(f"\n| rate-0.5 layer, batch {batch}, {ctx} tokens | time us | % of copy bw |\n|---|---|---|\n"
          f"| one launch, classes switched per item | {one * 1e6:.1f} | {100 * case.bytes / bw / one:.0f}% |\n"
          f"| one launch per width class ({len(subs)}) | {t * 1e6:.1f} | {100 * nbytes / bw / t:.0f}% |", flush=True)


def compile_times(key, match=""):
    """Seconds XLA takes to compile modules that call the decode kernel (persistent cache off): does a module pay
    once per call site, or once per distinct kernel, and is a kernel compiled earlier in the process reused?"""
    jax.config.update("jax_enable_compilation_cache", False)
    plan05 = rank_plan(0.5)
    layers = sorted(plan05, key=lambda lay: abs(lay.k_cols + lay.v_cols - 1024))  # distinct layers of the plan

    def module(layouts, calls_each=1):
        """A jitted function calling the kernel ``calls_each`` times on each layout (each call its own q)."""
        cases = [PagedCase(lay, 32, np.full(32, 4096), 32, 1, key) for lay in layouts]
        scheds = [schedule_of(c, DECODE_DEFAULTS).schedule.layer(0) for c in cases]

        def fn(qs, pages):  # the pages are arguments, as in the engine (closed over, they become constants)
            outs = []
            for c, sch, q, (k, v, table) in zip(cases, scheds, qs, pages):
                outs += [paged_decode(q * (i + 1), k, v, table, jnp.asarray(c.lengths), sch, c.layout)
                         for i in range(calls_each)]
            return outs
        return jax.jit(fn), ([c.q for c in cases], [(c.k, c.v, c.tables[0]) for c in cases])

    print("\n| module | kernel call sites | distinct kernels | compile s |\n|---|---|---|---|")
    rows = []
    for name, layouts, each in (("a rate-0.5 layer, 1 call (fresh)", [layers[0]], 1),
                                ("the same layer, 8 calls (compiled above, in another module)", [layers[0]], 8),
                                ("4 other rate-0.5 layers, 1 call each (fresh)", layers[1:5], 1),
                                ("all 32 layers of the rate-0.5 plan, 1 call each: a decode step (fresh)", layers,
                                 1)):
        if match not in name:
            continue
        fn, args = module(layouts, each)
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        t = time.perf_counter() - t0
        rows.append(dict(module=name, sites=len(layouts) * each, kernels=len(layouts), seconds=t))
        print(f"| {name} | {len(layouts) * each} | {len(layouts)} | {t:.1f} |", flush=True)
    jax.config.update("jax_enable_compilation_cache", True)
    return rows


def profile_one(spec: str):
    """Run one decode call (after a warm-up) for ``ncu``: spec "uniform:W", "rate:R" or "filled:R" (the rate-R
    plan with ``fill_tiles``) at batch 32, 4K."""
    kind, val = spec.split(":")
    lay = (HeadLayout(HQ, HKV, D, (int(val),) * HKV, (int(val),) * HKV) if kind == "uniform"
           else pick_layer(rank_plan(float(val), form="filled" if kind == "filled" else "ordered"), float(val)))
    key = jax.random.key(0)
    case = PagedCase(lay, 32, np.full(32, 4096), 32, 1, key)
    plan = build_decode_schedule(case.lengths, lay, 32)
    fn, shared, per_call = kvjax_decode_call(case, plan.schedule.layer(0), key)  # default knobs
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*shared, *per_call[0]))
    print(f"profiled {spec}: {lay.k_cols}+{lay.v_cols} cols, useful bytes {case.bytes}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: a few checks, one decode shape, one prefill")
    ap.add_argument("--profile", help="only run one decode call for ncu: uniform:W, rate:R or filled:R")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--timer", choices=("cupti", "host"), default="cupti",
                    help="cupti: the kernels' own durations, summed by CUPTI (default: host timing moves 20-30%% "
                         "between calls on 50-us single-sequence calls); host: wall clock over calls queued back "
                         "to back (launch gaps included)")
    ap.add_argument("--shapes", help="decode shapes BxCTX, comma-separated (default: 32x4096,128x4096,1x32768,"
                                     "256x512; --quick: 32x4096)")
    ap.add_argument("--tune-shape", default="32x4096", help="BxCTX the autotune section times its variants at")
    ap.add_argument("--rates", default="0,0.5,0.7", help="decode table rates, comma-separated")
    ap.add_argument("--orders", default="auto,stream,lpt,naive", help="decode table orders for compressed plans")
    ap.add_argument("--plans", default="ordered,filled",
                    help="forms of the rank plans for the decode and lpt tables, comma-separated: ordered (as "
                         "compression stores them by default: heads ordered for runs), filled (compression's opt-in "
                         "fill_tiles: widths also moved between heads so runs fill their tiles), drawn (the order "
                         "drawn: the ablation)")
    ap.add_argument("--pack-tile", type=int, default=PACK_TILE,
                    help="widest tile a run of several heads reads (the schedule's pack_tile, and the tile the "
                         "bench's plans order their heads for)")
    ap.add_argument("--match", default="",
                    help="only the correctness cases (and compile rows) whose name contains this")
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, ".jaxcache"),
                    help="JAX's persistent compilation cache (width-mixed kernels are slow to compile; a rerun of an "
                         "unchanged kernel loads it from here); '' turns it off")
    ap.add_argument("--only", default="check_decode,decode,schedule,check_prefill,prefill,lpt",
                    help="comma list of sections, run in this order: compile,widths,classes,autotune,check_decode,"
                         "decode,schedules,schedule,check_prefill,prefill (add sweep: pick prefill knobs first),lpt")
    args = ap.parse_args(argv)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    DECODE_DEFAULTS["pack_tile"] = args.pack_tile
    TIMER["name"] = args.timer
    if args.profile:
        return profile_one(args.profile)
    only = set(args.only.split(","))
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({getattr(dev, 'core_count', '?')} SMs), jax {jax.__version__}, "
          f"{datetime.date.today()}, timer {args.timer}, command: {' '.join(sys.argv)}")
    key = jax.random.key(int(time.time()))
    result = dict(device=dev.device_kind, date=str(datetime.date.today()), argv=sys.argv, timer=args.timer)
    bw = copy_bandwidth()
    rate = matmul_rate()
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    result.update(copy_bw=bw, matmul=rate)

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)

    if "compile" in only:
        result["compile"] = compile_times(key, args.match)
        dump()
    if "widths" in only:
        width_sweep(key, bw)
    if "classes" in only:
        per_class_launches(key, bw, pick_layer(rank_plan(0.5), 0.5))
    tuned = {r: DECODE_DEFAULTS for r in (0.0, 0.5, 0.7)}  # the defaults; --only autotune picks per rate
    if "autotune" in only:
        batch, ctx = map(int, args.tune_shape.split("x"))
        tuned.update(decode_autotune(key, bw, tuple(float(r) for r in args.rates.split(",")), batch, ctx))
    result["decode_knobs"] = tuned
    if "check_decode" in only:
        result["decode_checks"] = decode_checks(key, args.match)
        dump()
    if "decode" in only:
        shapes = ([(32, 4096)] if args.quick else [(32, 4096), (128, 4096), (1, 32768), (256, 512)])
        if args.shapes:
            shapes = [tuple(map(int, sh.split("x"))) for sh in args.shapes.split(",")]
        rates = tuple(float(r) for r in args.rates.split(","))
        result["decode"] = decode_table(key, bw, shapes, rates, args.quick, tuned, tuple(args.orders.split(",")),
                                        tuple(args.plans.split(",")))
        dump()
    if "schedules" in only:
        result["schedules"] = schedule_table(key, bw, [(0.5, 32, 4096), (0.7, 32, 4096), (0.5, 1, 32768),
                                                       (0.5, 128, 4096)])
        dump()
    if "schedule" in only:
        per_layer = next((r["time_us"] for r in result.get("decode", []) if r["kernel"] == "kvjax lpt"
                          and r["batch"] == 256 and r["ctx"] == 512 and r["rate"] == 0.5), None)
        result["schedule"] = schedule_cost(per_layer, bw)
        dump()
    if "check_prefill" in only:
        result["prefill_checks"] = prefill_checks(key, args.match)
        dump()
    if "prefill" in only:
        knobs = prefill_sweep(key, rate) if "sweep" in only else PREFILL_DEFAULTS
        cases = ([(1, 4096, ((0.0, (True,)), (0.5, (True, False))))] if args.quick else
                 [(1, 4096, ((0.0, (True,)), (0.5, (True, False)), (0.7, (True,)))),
                  (1, 16384, ((0.0, ()), (0.5, (True,))))])
        result["prefill"] = prefill_table(key, rate, cases, knobs)
        dump()
    if "lpt" in only:
        cases = [(0.5, 32, 4096)] if args.quick else [(0.5, 128, 4096), (0.7, 8, 16384)]
        result["lpt"] = lpt_table(key, bw, cases, tuned, tuple(args.plans.split(",")))
        dump()


if __name__ == "__main__":
    main()
