"""What every kernel benchmark shares: the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128,
bf16) and its random rank plans (``rank_plan``, ``pick_layer``), random paged inputs (``PagedCase``), the timers
(``time_calls``: CUPTI's kernel durations or the host's wall clock over queued calls; ``compile_ahead`` compiles
variants side by side first), the ceilings the floors divide by (``copy_bandwidth``, ``matmul_rate``), error
measures against a float32 reference, and table printing. Why CUPTI by default: bench/results/kernels.md "Decode: CUPTI
timer against the host timer"."""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.models.config import ModelConfig
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.search import fill_runs, order_heads, permuted

HQ, HKV, D = 32, 8, 128
LLAMA_8B = ModelConfig(  # the whole model's shape, for engine benchmarks (random weights)
    arch="llama",
    num_layers=32,
    num_heads=HQ,
    num_kv_heads=HKV,
    head_dim=D,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    norm_eps=1e-5,
    rope_theta=5e5,
    max_position_embeddings=131072,
)
LLAMA_70B = dataclasses.replace(  # Llama-3.1-70B's shape: 141 GB in bf16, more than one GPU holds
    LLAMA_8B, num_layers=80, num_heads=64, hidden_size=8192, intermediate_size=28672
)
SHAPES = {"llama-8b": LLAMA_8B, "llama-70b": LLAMA_70B}
GEMMA3_270M = ModelConfig(  # Gemma 3 270M's shape (its GGUF's config), for engine benchmarks (random weights)
    arch="gemma3",
    num_layers=18,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    hidden_size=640,
    intermediate_size=2048,
    vocab_size=262144,
    norm_eps=1e-6,
    rope_theta=1e6,
    rope_local_theta=1e4,
    sliding_window=512,
    layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 3,
    query_pre_attn_scalar=256.0,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
L2_BYTES = 50 << 20
TIMER = {"name": "cupti"}  # "cupti" (the kernels' own durations) or "host" (wall clock over queued calls)
START = time.perf_counter()
# Forms of a rank plan: as compression stores it by default ("ordered": heads ordered by ``search.order_heads`` for
# the decode config's runs), with its opt-in ``fill_tiles`` ("filled": widths first moved between heads so runs fill
# their tiles, ``search.fill_runs``), or as drawn ("drawn": the ablation).
PLAN_FORMS = ("ordered", "filled", "drawn", "uniform")


def count_arg(flag: str):
    """An argparse ``type=`` for a positive integer flag."""
    return validate.arg(lambda v: validate.positive(flag, v), int)


def rates_arg(flag: str = "--rates"):
    """An argparse ``type=`` for comma-separated compression rates, each in [0, 1)."""
    return validate.arg(lambda text: [validate.rate(flag, float(r)) for r in text.split(",")])


def _shape(flag: str, text: str) -> tuple[int, int]:
    batch, _, ctx = text.partition("x")
    if not (batch.isdigit() and ctx.isdigit()):
        raise ValueError(f"{flag} must be BxCTX (32x2048, say), got {text!r}")
    return validate.positive(f"{flag}'s batch", int(batch)), validate.positive(f"{flag}'s context", int(ctx))


def shape_arg(flag: str):
    """An argparse ``type=`` for one BxCTX shape: two positive integers."""
    return validate.arg(functools.partial(_shape, flag))


def shapes_arg(flag: str):
    """An argparse ``type=`` for comma-separated BxCTX shapes."""
    return validate.arg(lambda text: [_shape(flag, s) for s in text.split(",")])


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def log_row(row: dict) -> None:
    """One result row on stderr as it is measured ("rate 0.5 | us 185.2 | ...")."""
    log(" | ".join(f"{k} {_cell(v)}" for k, v in row.items()))


def print_table(rows: list[dict]) -> None:
    """Rows of one shape as a Markdown table, their keys the header."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(_cell(v) for v in r.values()) + " |")


def log(msg: str) -> None:
    """Print ``msg`` to stderr with the seconds since the bench started."""
    print(f"[{time.perf_counter() - START:.0f}s] {msg}", file=sys.stderr, flush=True)


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


# ---------------------------------------------------------------- inputs


@functools.cache
def rank_plan(
    rate: float,
    num_layers: int = 32,
    cv: float = 0.45,
    seed: int = 0,
    form: str = "ordered",
    config: DecodeConfig = DECODE,
) -> tuple[HeadLayout, ...]:
    """Per-layer layouts at overall ``rate``: widths log-normal (spread ``cv``) in 16s within [16, 128], in ``form``."""
    if form not in PLAN_FORMS:
        raise ValueError(f"form must be one of {PLAN_FORMS}, got {form!r}")
    if rate == 0:
        return tuple(HeadLayout.uniform(HQ, HKV, D) for _ in range(num_layers))
    if form == "uniform":  # every head of every layer the same width (Palu's own setting), the rate's columns
        width = int(np.clip(16 * round((1 - rate) * D / 16), 16, D))
        return tuple(HeadLayout(HQ, HKV, D, (width,) * HKV, (width,) * HKV) for _ in range(num_layers))
    # log-normal around a common scale, bisected so 1 - sum(k + v) / (2 * heads * 128 * layers) matches the rate
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
    if form == "filled":  # no singular values here: the fill moves as few columns as it can
        layouts = [HeadLayout(HQ, HKV, D, *fill_runs(lay, config)) for lay in layouts]
    if form != "drawn":
        layouts = [permuted(lay, order_heads(lay, config)) for lay in layouts]
    return tuple(layouts)


def plan_rate(layouts) -> float:
    """The overall rate of a plan: 1 - its K + V columns over the uncompressed ones."""
    return 1 - sum(lay.k_cols + lay.v_cols for lay in layouts) / (2 * HKV * D * len(layouts))


def pick_layer(layouts, rate) -> HeadLayout:
    """The layer whose total width is closest to the plan's mean (a representative layer)."""
    target = (1 - rate) * 2 * HKV * D
    return min(layouts, key=lambda lay: abs(lay.k_cols + lay.v_cols - target))


def uniform(width: int) -> HeadLayout:
    """The Llama shape with every K and V head ``width`` columns wide."""
    return HeadLayout(HQ, HKV, D, (width,) * HKV, (width,) * HKV)


# Check layouts: odd (non power of two) widths, and a G=1 sliding window of odd widths.
ODD = HeadLayout(32, 8, 128, (128, 48, 16, 80, 112, 32, 64, 96), (16, 96, 128, 48, 64, 112, 80, 32))
WINDOWED = HeadLayout(8, 8, 64, (64, 16, 32, 48, 64, 16, 32, 48), (16,) * 4 + (64,) * 4, 300)


def randn(key, shape, dtype=jnp.bfloat16):
    """Standard normal values of ``shape`` in ``dtype``."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def queries(key, shape, n=8, dtype=jnp.bfloat16):
    """``n`` fresh random arrays of ``shape``, each as a one-element argument tuple (the per-call inputs)."""
    return [(randn(k, shape, dtype),) for k in jax.random.split(key, n)]


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
        seed = int(jax.random.randint(ks[3], (), 0, 2**31 - 1))
        perm = np.random.default_rng(seed).permutation(np.arange(1, n)).astype(np.int32)
        self.tables = jnp.asarray(perm[: batch * self.pps * copies].reshape(copies, batch, self.pps))

    @property
    def bytes(self) -> int:
        """Bytes decode must move: K/V rows of every visible token, q and out (bf16)."""
        lay = self.layout
        return int(self.lengths.sum()) * (lay.k_cols + lay.v_cols) * 2 + self.batch * (lay.q_cols + lay.out_cols) * 2


def copies_for(bytes_per_call: int) -> int:
    """Disjoint page sets to rotate through so calls together read over 4x L2 (at most 16)."""
    return max(1, min(16, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))


# ---------------------------------------------------------------- timing


def batched(fn, chain=None):
    """``fn`` over a list of argument sets in one jitted function (see ``time_calls``)."""

    def many(shared, calls):
        shared, outs = list(shared), []
        for c in calls:
            res = fn(*shared, *c)
            if chain:
                for i, x in zip(chain, res[1:], strict=False):
                    shared[i] = x
                res = res[0]
            outs.append(res)
        return outs

    return jax.jit(many)


def cupti_kernels(run) -> list[tuple[str, float]]:
    """The kernels (name, ms) CUPTI saw run while ``run()`` ran (it must finish its device work before returning)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        run()
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings)


def compile_ahead(lowerings, threads=16):
    """Compile what each of ``lowerings`` lowers, side by side, into the persistent cache; each one's error or None."""

    # A width-mixed Triton kernel takes 20-90 s to compile, mostly in XLA/Triton/ptxas with the GIL released, so N
    # variants cost far less than N compiles; the later calls load each from the cache. The errors let a sweep skip
    # a variant the GPU cannot run (e.g. too much shared memory).
    def compile_one(lower):
        try:
            lower().compile()
        except Exception as e:  # reported per variant
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
    """Median seconds per call of ``fn(*shared, *per_call[u])`` over the U argument sets, run in one jitted function."""
    # The U calls differ in their inputs (so none is merged with another) and all their outputs are returned (so
    # nothing is sliced away). ``chain``: the indices of ``shared`` that each call returns updated (after its first
    # output) for the next call (pages). CUPTI sums the kernels' own durations, so launch gaps and host noise drop
    # out: the timer for calls too short to time from the host (a single sequence's decode). The host timer queues
    # the dispatches back to back and waits for the last.
    f = batched(fn, chain)
    if TIMER["name"] == "cupti":
        if not on_gpu():
            raise SystemExit(f"the CUPTI timer needs a GPU (JAX backend: {jax.default_backend()}); use --timer host")
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


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB elementwise pass (one call: siblings on one input would fuse)."""
    x = randn(jax.random.key(0), (1 << 29,))  # 1 GiB bf16
    t = time_calls(lambda x: -x, (), [(x,)], min_total_s=0.1)
    return 2 * x.size * 2 / t


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 matmul (four calls, each its own left operand)."""
    ks = jax.random.split(jax.random.key(1), 5)
    b = randn(ks[0], (8192, 8192))
    t = time_calls(lambda b, a: a @ b, (b,), [(randn(k, (8192, 8192)),) for k in ks[1:]])
    return 2 * 8192**3 / t


# ---------------------------------------------------------------- correctness


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float32."""
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def highest(fn, *args):
    """``fn(*arrays, layout)`` in float32 with exact matmuls (XLA's GPU default for float32 is TF32), jitted whole."""
    # jitted as a whole: op by op, the reference of a 32-head layer spent about a minute compiling its many small ops
    arrays = [a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args[:-1]]
    with jax.default_matmul_precision("highest"):
        return jax.jit(fn, static_argnums=len(arrays))(*arrays, args[-1])


def worst_head(out, ref, layout, cols) -> tuple[float, int]:
    """(error of the worst KV group, its index): localizes a wrong width class."""
    errs = []
    starts = HeadLayout.offsets(cols, layout.group_size)
    for st, w in zip(starts, cols, strict=True):
        sl = slice(st, st + layout.group_size * w)
        errs.append(rel_err(out[..., sl], ref[..., sl]))
    return max(errs), int(np.argmax(errs))


# ---------------------------------------------------------------- printing


def print_checks(rows) -> None:
    """A markdown table of correctness rows (kernel, case, dtype, error, worst group, ok)."""
    print("\n| kernel | case | dtype | rel. error | worst group | ok |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1e} | {r[4]} | {'yes' if r[5] else 'NO'} |", flush=True)


def knobs(config, names, default) -> str:
    """``config``'s ``names`` fields joined by " / ", marked "(default)" where the config is ``default``."""
    return " / ".join(str(getattr(config, n)) for n in names) + (" (default)" if config == default else "")


def knob_option(ap, what: str = "a DecodeConfig field") -> None:
    """``--knob NAME=VALUE`` on ``ap`` (repeatable): fields of a config set for the run (``with_knobs``)."""
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE", help=f"{what} (repeatable)")


def timer_option(ap) -> None:
    """``--timer cupti|host`` on ``ap``: which clock ``time_calls`` reads (``TIMER``; the bench sets it)."""
    ap.add_argument(
        "--timer",
        choices=("cupti", "host"),
        default="cupti",
        help="cupti: the kernels' own durations, summed by CUPTI (default: host timing moves 20-30%% "
        "between calls on 50-us single-sequence calls); host: wall clock over calls queued back "
        "to back (launch gaps included), and the one that runs under Nsight Compute, which holds CUPTI itself",
    )


def with_knobs(config, pairs):
    """``config`` with each ``NAME=VALUE`` of ``pairs`` set (a Python literal, else the string; ``--knob`` on the
    command lines); exits naming the fields when one is not a field of the config."""
    fields = [f.name for f in dataclasses.fields(config)]
    knobs = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        try:
            knobs[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            knobs[name] = text
    if unknown := sorted(set(knobs) - set(fields)):
        raise SystemExit(f"unknown knob {', '.join(unknown)} for {type(config).__name__}: use {', '.join(fields)}")
    return dataclasses.replace(config, **knobs)
