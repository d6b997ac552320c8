"""The engine end to end on a random Llama-3.1-8B-shaped model (bf16): per rate and shape (batch x prompt length),
one request run first so every step is compiled (each step's first call reported as tracing, lowering and XLA's
compile), then prompts prefilled through the continuous-batching runner in chunks, then decode steps in steady
state timed twice, by the host's clock (wall per step, the runner's own loop) and by CUPTI (the step's kernels,
summed), beside the floor (weights + K/V bytes read per step over the measured copy bandwidth) and split into GEMMs,
attention and the rest; then the same step enqueued back to back without the runner (its span: kernels and the
gaps between them), which tells the host's share of wall over device from the gaps'. With ``--prefill-chunks``, then
prompt tokens per second at each chunk budget. Which kernels the gaps precede: bench/gaps.py. Tables:
bench/results/engine.md "Engine: decode step beside the floor", "Engine: prefill across chunk sizes"."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import dispatch

import kvjax
from bench.harness import (
    LLAMA_8B,
    PLAN_FORMS,
    SHAPES,
    copy_bandwidth,
    count_arg,
    cupti_kernels,
    knob_option,
    log,
    on_gpu,
    rank_plan,
    rates_arg,
    shape_arg,
    shapes_arg,
    with_knobs,
)
from kvjax import validate
from kvjax.compression import RankPlan
from kvjax.models.config import ModelConfig
from kvjax.models.transformer import Transformer
from kvjax.ops import kv_schemes
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.quant_head_paging import head_format
from kvjax.runtime import engine as engine_module
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.config import engine_eviction
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request


def model_at(
    rate: float,
    cfg: ModelConfig = LLAMA_8B,
    config: DecodeConfig = DECODE,
    form="ordered",
    method: str = "zack",
    band: int | None = None,
    shapes_only: bool = False,
    qk_basis: str | None = None,
) -> kvjax.Model:
    """Random bf16 weights of the 8B shape (or ``cfg``'s); rate > 0: compressed by ``method`` to the widths of
    ``harness.rank_plan`` (in ``form``, its heads ordered for the decode ``config``; ``band``: banded ZACK;
    ``qk_basis="pair"``: queries on directions of their own, ``RankPlan.qk_basis``).
    ``shapes_only``: the module's shapes without values, which a tensor-parallel engine fills with random shares on
    each device (``forward.shard``): a shape larger than one GPU holds is never built whole."""
    plan = None
    if rate > 0:
        layouts = rank_plan(rate, cfg.num_layers, form=form, config=config)
        k = np.array([lay.k_widths for lay in layouts])
        v = np.array([lay.v_widths for lay in layouts])
        ones = np.ones((*k.shape, cfg.head_dim))
        plan = RankPlan(method, cfg.head_dim, k, v, ones, ones, band=band, qk_basis=qk_basis)

    def build():
        module = Transformer(cfg, plan=plan, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        module.join()
        return module

    return kvjax.Model(nnx.eval_shape(build) if shapes_only else build(), plan=plan)


COMPILES: list[tuple[str, str, float]] = []  # (stage, function, seconds) of every trace, lowering and XLA compile
STAGES = {
    dispatch.JAXPR_TRACE_EVENT: "trace",
    dispatch.JAXPR_TO_MLIR_MODULE_EVENT: "lower",
    dispatch.BACKEND_COMPILE_EVENT: "compile",
}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in STAGES:
        COMPILES.append((STAGES[event], str(kwargs.get("fun_name", "")), duration))
        if duration > 1:
            log(f"{STAGES[event]} {COMPILES[-1][1]}: {duration:.1f} s")


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_times(since: int) -> dict:
    """Seconds each engine step took to trace (its jaxpr, inner functions included), lower (to MLIR, the Pallas
    kernels to Triton IR) and compile (XLA) since ``COMPILES[since]``, and how many variants XLA compiled."""
    out = {}
    for step in ("decode", "prefill"):
        events = [
            (what, s) for what, name, s in COMPILES[since:] if name.removeprefix("jit(").rstrip(")") == f"_{step}_step"
        ]
        for stage in ("trace", "lower", "compile"):
            out[f"{step}_{stage}_s"] = sum(s for what, s in events if what == stage)
        out[f"{step}_compiles"] = sum(what == "compile" for what, _ in events)
        out[f"{step}_first_call_s"] = sum(s for _, s in events)
    return out


def kind(name: str) -> str:
    """A CUPTI kernel's share of the split: GEMM, attention, communication (NCCL's collectives, under tensor
    parallelism) or rest."""
    low = name.lower()
    if "nccl" in low or "allreduce" in low or "all_reduce" in low or "allgather" in low:
        return "comm"
    if "kvjax" in low or "paged_decode" in low or "attention" in low:
        return "attention"
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "dot")):
        return "gemm"
    return "rest"


def cupti_steps(runner: Runner, steps: int) -> list[tuple[str, float]]:
    """The kernels (name, ms) of ``steps`` runner steps, as CUPTI saw them run."""

    def run():
        for _ in range(steps):
            runner.step()
        runner.drain()

    return cupti_kernels(run)


def floor_bytes(model: kvjax.Model, lengths: np.ndarray, engine: Engine | None = None) -> int:
    """Bytes a decode step must read: every weight but the embedding table, and each sequence's K/V; under tensor
    parallelism a device's: its share of the weights and its heads' columns at the padded local layout
    (``Engine.layouts``), what the slowest device reads."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.state))  # values or shapes only
    embed = model.config.vocab_size * model.config.hidden_size * jnp.dtype(model.dtype).itemsize
    devices = 1 if engine is None else engine.devices
    return (weights - embed + kv_bytes(model, lengths, engine)) // devices


def kv_bytes(model: kvjax.Model, lengths: np.ndarray, engine: Engine | None = None) -> int:
    """Bytes of K/V a decode step reads: each sequence's tokens at the cache's bytes a token (a quantized cache:
    its full pages' every byte, codes, scales, zeros and padding, and its tail's tokens in the cache's dtype); an
    evicting engine's: the tokens each head stores now, at its width (``lengths`` unused). Under tensor parallelism:
    every device's, each device's heads at its padded layout (``Engine.layouts``), so a device reads this over N."""
    if engine is not None and engine.eviction is not None:
        stored = np.asarray(engine.cache.heads.stored)  # [slots, L, Hkv]
        widths = np.array([[k + v for k, v in zip(lay.k_widths, lay.v_widths)] for lay in model.layouts])
        exact = jnp.dtype(model.dtype).itemsize
        if (bits := kv_schemes.served(engine.kv_bits)) is None:
            return int((stored * widths).sum()) * exact
        p = engine.page_size  # quantized groups of p slots, each head's partial one exact
        heads = [list(zip(lay.k_widths, lay.v_widths)) for lay in model.layouts]
        group = np.array([[head_format(k, v, p, bits).page_bytes for k, v in layer] for layer in heads])
        full = stored // p
        return int((full * group).sum() + ((stored - full * p) * widths).sum() * exact)
    layouts = model.layouts if engine is None else engine.layouts  # under tensor parallelism a device's, padded
    plain = bytes_per_token(layouts, model.dtype) * (1 if engine is None else engine.devices)
    if engine is None or engine.formats is None:
        return int(lengths.sum()) * plain
    p = engine.page_size
    full = lengths // p * p
    return int(full.sum() * sum(engine.token_bytes().values()) + (lengths - full).sum() * plain)


@dataclasses.dataclass
class Prefilled:
    """``prefilled``'s engine in steady state and what it took to get there."""

    engine: Engine
    runner: Runner
    requests: list[Request]
    warm_up_s: float  # the one-request run that compiles every step shape
    compiled: dict  # compile_times of that run
    since: int  # len(COMPILES) after it: what compiles later compiled while timed
    prefill_s: float  # the batch's prompts, through the runner in chunks


def prefilled(
    model,
    batch: int,
    ctx: int,
    new: int,
    chunk_tokens: int,
    config=DECODE,
    warm_steps: int = 8,
    kv_bits=None,
    eviction=None,
    slots: int | None = None,
    tensor_parallel: int = 1,
    placement: str = "bytes",
) -> Prefilled:
    """An engine whose ``batch`` random ``ctx``-token requests (``new`` tokens each) are prefilled and
    ``warm_steps`` decode steps in, every step shape compiled first by a one-request run of its own. ``kv_bits``:
    quantized pages (of the default 32 tokens; 16 tokens a page otherwise); ``eviction``: each prompt evicted once
    prefilled (``EngineConfig.eviction``); ``slots``: the engine's ``max_batch`` (default ``batch``), more than the
    batch to time a lightly loaded server's step; ``tensor_parallel``: devices the engine splits the model over."""
    engine = Engine(
        model,
        max_batch=max(batch, slots or batch),
        max_seq_len=ctx + new,
        page_size=None if kv_bits else 16,
        chunk_tokens=chunk_tokens,
        decode_config=config,
        kv_bits=kv_bits,
        eviction=eviction,
        tensor_parallel=tensor_parallel,
        head_placement=placement,
    )
    runner = Runner(engine)
    rng = np.random.default_rng(0)
    since = len(COMPILES)
    t0 = time.perf_counter()
    runner.add(Request(rng.integers(0, 32000, ctx).tolist(), 2))  # compiles every step the run takes
    list(runner.run())
    warm_up_s = time.perf_counter() - t0
    compiled, since = compile_times(since), len(COMPILES)
    requests = [runner.add(Request(rng.integers(0, 32000, ctx).tolist(), new)) for _ in range(batch)]
    t0 = time.perf_counter()
    while any(r.first_token_time is None for r in requests):
        runner.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(warm_steps):
        runner.step()
    runner.drain()
    return Prefilled(engine, runner, requests, warm_up_s, compiled, since, prefill_s)


def run_shape(model, rate, batch, ctx, args, bandwidth, kv_bits=None, eviction=None) -> dict:
    """Prefill ``batch`` random prompts of ``ctx`` tokens, then time decode steps in steady state, every request
    still running (each may sample a token per prefill step before, one per step after)."""
    new = batch * -(-ctx // args.chunk_tokens) + args.warm_steps + 2 * args.steps + 8
    state = prefilled(
        model,
        batch,
        ctx,
        new,
        args.chunk_tokens,
        args.config,
        args.warm_steps,
        kv_bits,
        eviction,
        args.max_batch,
        args.tensor_parallel,
        args.placement,
    )
    engine, runner, requests, since = state.engine, state.runner, state.requests, state.since
    t0 = time.perf_counter()
    for _ in range(args.steps):
        runner.step()
    runner.drain()
    wall = (time.perf_counter() - t0) / args.steps
    lengths = np.array([len(r.prompt) + len(r.tokens) for r in requests])
    kernels = cupti_steps(runner, args.steps)
    if any(r.finish_time is not None for r in requests):
        raise RuntimeError("a request finished while the steps were timed: the batch was not full")
    span = back_to_back(runner, requests, args.steps) if eviction is None else float("nan")
    split = {"gemm": 0.0, "attention": 0.0, "comm": 0.0, "rest": 0.0}
    by_name: dict[str, float] = {}
    per = args.steps * engine.devices  # CUPTI sees every device's kernels: a device's mean step
    for name, ms in kernels:
        split[kind(name)] += ms / 1e3 / per
        by_name[name] = by_name.get(name, 0.0) + ms / per
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    device = sum(split.values())
    mean_lengths = lengths + args.steps // 2  # over the CUPTI steps
    floor = floor_bytes(model, mean_lengths, engine) / bandwidth
    attention_floor = kv_bytes(model, mean_lengths, engine) / engine.devices / bandwidth
    slots, devices = engine.max_batch, engine.devices
    del engine, runner
    return dict(
        rate=rate,
        tensor_parallel=devices,
        placement=args.placement if devices > 1 else None,
        kv_bits=kv_bits,
        eviction=eviction,
        attention_floor_ms=attention_floor * 1e3,
        # no attention kernel (eviction on quantized pages decodes in jnp, counted in "rest"): no percentage
        attention_pct_of_floor=100 * attention_floor / split["attention"] if split["attention"] else float("nan"),
        batch=batch,
        slots=slots,
        ctx=ctx,
        wall_ms=wall * 1e3,
        device_ms=device * 1e3,
        floor_ms=floor * 1e3,
        pct_of_floor=100 * floor / device,
        wall_over_device=wall / device,
        span_ms=span * 1e3,
        span_over_device=span / device,
        wall_over_span=wall / span,
        tokens_per_s=batch / wall,
        gemm_ms=split["gemm"] * 1e3,
        attention_ms=split["attention"] * 1e3,
        comm_ms=split["comm"] * 1e3,
        rest_ms=split["rest"] * 1e3,
        kernels_per_step=len(kernels) / args.steps,
        prefill_tok_s=batch * ctx / state.prefill_s,
        prefill_s=state.prefill_s,
        warm_up_s=state.warm_up_s,
        chunk_tokens=args.chunk_tokens,
        xla_options=dict(engine_module.COMPILER_OPTIONS),
        knobs=args.knob,
        plan=args.plan,
        compiles_while_timed=sum(compile_times(since)[f"{s}_compiles"] for s in ("decode", "prefill")),
        top_kernels_ms=[(name[:80], ms) for name, ms in top],
        kernels_ms=by_name,
        **state.compiled,
    )


def step_inputs(runner: Runner, requests: list[Request]) -> tuple:
    """The decode step's host inputs (positions, active, rows) for the runner's requests as they stand."""
    engine, pages = runner.engine, runner.scheduler.pages
    meta = engine.rows(engine.max_batch)
    positions, active = np.zeros(engine.max_batch, np.int32), np.zeros(engine.max_batch, bool)
    for r in requests:
        meta.set(r.slot, pages.table(r.id), r.seed, r.stream, len(r.tokens), r.temperature, r.top_p)
        positions[r.slot], active[r.slot] = len(r.prompt) + len(r.tokens) - 1, True
    return positions, active, meta


def back_to_back(runner: Runner, requests: list[Request], steps: int) -> float:
    """Seconds per decode step when the same step (the requests' rows as they stand) is enqueued ``steps`` times
    with nothing else on the host: the device's span of a step, its kernels and the gaps between them. Wall over
    span is then what the runner's host work adds, span over CUPTI's sum what the gaps add."""
    engine, inputs = runner.engine, step_inputs(runner, requests)
    engine.decode(*inputs).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.decode(*inputs)
    engine.slot_tokens.block_until_ready()
    return (time.perf_counter() - t0) / steps


def prefill_sweep(model, rate, batch, ctx, chunks: list[int]) -> list[dict]:
    """Prompt tokens per second through the runner at each chunk budget: ``batch`` prompts of ``ctx`` tokens, one
    new token each (sampled by the prefill, so no decode step runs), timed on a second pass of the same prompts
    (the first compiles every call shape)."""
    rows = []
    for chunk in chunks:
        engine = Engine(model, max_batch=batch, max_seq_len=ctx + 16, page_size=16, chunk_tokens=chunk)
        runner = Runner(engine)
        rng = np.random.default_rng(1)
        since = len(COMPILES)
        for timed in (False, True):  # the first pass compiles every call shape the workload takes
            requests = [runner.add(Request(rng.integers(0, 32000, ctx).tolist(), 1)) for _ in range(batch)]
            t0 = time.perf_counter()
            list(runner.run())
            seconds = time.perf_counter() - t0
            if not timed:
                compiled = compile_times(since)
                since = len(COMPILES)
        if len(COMPILES) > since:
            raise RuntimeError("a prefill step compiled while timed")
        assert all(len(r.tokens) == 1 for r in requests)
        rows.append(
            dict(
                rate=rate,
                batch=batch,
                ctx=ctx,
                chunk_tokens=chunk,
                prefill_tok_s=batch * ctx / seconds,
                steps=runner.steps,
                **compiled,
            )
        )
        print(
            f"| {rate} | {batch} x {ctx} | {chunk} | {rows[-1]['prefill_tok_s']:.0f} | "
            f"{compiled['prefill_compile_s']:.1f} ({compiled['prefill_compiles']}) |",
            flush=True,
        )
        del engine, runner
    return rows


def print_rows(rows: list[dict]) -> None:
    print(
        "\n| rate | kv bits | B x ctx | wall ms/step | device ms/step | floor ms | % of floor | wall/device | tok/s | "
        "GEMM ms | attention ms (floor, %) | rest ms | kernels/step | prefill tok/s (chunk) | "
        "compile s: decode / prefill (variants) | decode trace + lower + compile s | compiles while timed | "
        "span/device | wall/span |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['rate']}{' palu' if r.get('method') == 'palu' else ''}"
        rate += f" TP {r['tensor_parallel']} {r.get('placement')}" if r.get("tensor_parallel", 1) > 1 else ""
        rest = f"{r['rest_ms']:.2f}" + (f" (NCCL {r['comm_ms']:.2f})" if r.get("comm_ms") else "")
        print(
            f"| {rate} | {r.get('kv_bits') or '-'}{(' evict ' + r['eviction']) if r.get('eviction') else ''} | "
            f"{r['batch']} x {r['ctx']} | {r['wall_ms']:.2f} | "
            f"{r['device_ms']:.2f} | "
            f"{r['floor_ms']:.2f} | {r['pct_of_floor']:.0f}% | {r['wall_over_device']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['gemm_ms']:.2f} | {r['attention_ms']:.2f} ({r['attention_floor_ms']:.2f}, "
            f"{r['attention_pct_of_floor']:.0f}%) | {rest} | {r['kernels_per_step']:.0f} | "
            f"{r['prefill_tok_s']:.0f} ({r['chunk_tokens']}) | "
            f"{r['decode_compile_s']:.1f} / {r['prefill_compile_s']:.1f} ({r['prefill_compiles']}) | "
            f"{r['decode_trace_s']:.1f} + {r['decode_lower_s']:.1f} + {r['decode_compile_s']:.1f} | "
            f"{r['compiles_while_timed']} | {r['span_over_device']:.3f} | {r['wall_over_span']:.3f} |",
            flush=True,
        )


def print_top_kernels(rows: list[dict]) -> None:
    """Each configuration's costliest kernels per decode step (CUPTI), to see what "rest" is made of."""
    for r in rows:
        print(f"\nrate {r['rate']}, {r['batch']} x {r['ctx']}: top kernels, ms per step")
        for name, ms in r["top_kernels_ms"]:
            print(f"  {ms:8.3f}  {name}")


def method_name(args) -> str:
    """The rows' name for how rates above 0 compress: zack, palu or zack-band<W>, then -pair for a score-aware
    pair."""
    name = args.method if args.band is None else f"{args.method}-band{args.band}"
    return name + ("-pair" if args.qk_basis == "pair" else "")


def decode_rows(args, bandwidth: float, rows: list[dict], save) -> None:
    """A decode row per rate, shape and cache format (``--kv-bits``), appended to ``rows``, ``save``d after each."""
    for rate in [] if args.no_decode else args.rates:
        model = model_at(
            rate,
            SHAPES[args.model],
            config=args.config,
            form=args.plan,
            method=args.method,
            band=args.band,
            shapes_only=args.tensor_parallel > 1,
            qk_basis=args.qk_basis,
        )
        for batch, ctx in args.shapes:
            for bits in args.kv_bits:
                for evict in args.evict:
                    log(f"rate {rate}, kv bits {bits}, eviction {evict}, {batch} x {ctx}")
                    row = run_shape(model, rate, batch, ctx, args, bandwidth, bits, evict)
                    rows.append(dict(row, method=method_name(args) if rate else "none"))
                    print_rows(rows[-1:])
                    save()
        del model


def _check_combinations(ap, args) -> None:
    """Flags that do not go together: refused in one line, before any GPU work."""
    if args.tensor_parallel > 1 and args.evict != [None]:
        ap.error("--evict is not timed under --tensor-parallel yet (its bytes are counted from one device's heads)")
    if args.band is not None and args.method != "zack":
        ap.error("--band applies to --method zack")
    if args.qk_basis == "pair" and args.method != "zack":
        ap.error("--qk-basis pair applies to --method zack")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rates",
        type=rates_arg(),
        default=[0.0, 0.5, 0.7],
        help="compression rates, comma-separated (default 0,0.5,0.7)",
    )
    ap.add_argument(
        "--shapes",
        type=shapes_arg("--shapes"),
        default=[(32, 2048), (32, 8192), (8, 32768)],
        help="BxCTX decode shapes, comma-separated (default 32x2048,32x8192,8x32768)",
    )
    ap.add_argument(
        "--chunk-tokens", type=count_arg("--chunk-tokens"), default=2048, help="prompt tokens per step (default 2048)"
    )
    ap.add_argument(
        "--max-batch",
        type=count_arg("--max-batch"),
        help="the engine's slots when more than a shape's batch: a lightly loaded server's step (default the batch)",
    )
    ap.add_argument(
        "--steps", type=count_arg("--steps"), default=32, help="decode steps timed, by each timer (default 32)"
    )
    ap.add_argument(
        "--warm-steps",
        type=validate.arg(lambda v: validate.integer("--warm-steps", v, low=0), int),
        default=4,
        help="decode steps run before timing (default 4)",
    )
    ap.add_argument(
        "--prefill-chunks",
        type=validate.arg(lambda text: [validate.positive("--prefill-chunks", int(c)) for c in text.split(",")]),
        help="also: prompt tokens/s at these chunk budgets (comma-separated) at --prefill-shape, after the decode rows",
    )
    ap.add_argument(
        "--prefill-shape",
        type=shape_arg("--prefill-shape"),
        default=(32, 2048),
        help="BxCTX of the prefill sweep (default 32x2048)",
    )
    ap.add_argument("--no-decode", action="store_true", help="skip the decode rows (with --prefill-chunks)")
    ap.add_argument(
        "--xla-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA option for the engine's steps over its own (repeatable), e.g. xla_gpu_autotune_level=4 "
        "(XLA's own default; the engine's is 0)",
    )
    knob_option(ap)
    ap.add_argument(
        "--method", choices=("zack", "palu"), default="zack", help="how rates above 0 compress (default zack)"
    )
    ap.add_argument(
        "--kv-bits",
        type=validate.arg(lambda text: [None if b == "none" else kv_schemes.served(b) for b in text.split(",")]),
        default=[None],
        help="cache formats per rate, comma-separated: none (the model's dtype), 4, 2 or a GEAR name such as "
        "gear2-r1-o0.01-p128 (default none)",
    )
    ap.add_argument(
        "--evict",
        type=validate.arg(lambda text: [None if e == "none" else engine_eviction(e).name for e in text.split(",")]),
        default=[None],
        help="eviction per rate and format, comma-separated: none, or a policy such as kvcompress:4x (the engine's "
        "--evict; default none). An evicting row's span is not measured: replaying one step would append past the "
        "pages its heads were given",
    )
    ap.add_argument(
        "--band",
        type=count_arg("--band"),
        help="banded ZACK: keys in bands of this many positions (rates above 0, --method zack)",
    )
    ap.add_argument(
        "--qk-basis",
        choices=("shared", "pair"),
        default="shared",
        help="zack: queries and keys on one rotation (default), or on a score-aware pair (a projection each)",
    )
    ap.add_argument("--plan", choices=PLAN_FORMS, default="ordered", help="the rank plan's form (harness.PLAN_FORMS)")
    ap.add_argument(
        "--tensor-parallel",
        type=count_arg("--tensor-parallel"),
        default=1,
        help="split the model over this many GPUs (the engine's tensor_parallel); times are a device's mean step, "
        "floors a device's bytes, comm_ms NCCL's share (default 1)",
    )
    ap.add_argument(
        "--placement",
        choices=("bytes", "even"),
        default="bytes",
        help="with --tensor-parallel: KV heads placed by bytes, or the same count a device in order (default bytes)",
    )
    ap.add_argument(
        "--model",
        choices=tuple(SHAPES),
        default="llama-8b",
        help="the random model's shape (default llama-8b; llama-70b needs --tensor-parallel: 141 GB of weights)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    _check_combinations(ap, args)
    args.config = with_knobs(DECODE, args.knob)
    if not on_gpu():
        raise SystemExit("bench/engine.py times the engine on a GPU (CUPTI)")
    for pair in args.xla_option:
        name, _, value = pair.partition("=")
        engine_module.COMPILER_OPTIONS[name] = ast.literal_eval(value)
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    result = dict(device=jax.devices()[0].device_kind, bandwidth=bandwidth, rows=[], prefill_rows=[])
    rows = result["rows"]

    def save():  # after every row: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    decode_rows(args, bandwidth, rows, save)
    if rows:
        print_rows(rows)
        print_top_kernels(rows)
    if args.prefill_chunks:
        batch, ctx = args.prefill_shape
        print(
            "\n| rate | B x ctx | chunk tokens | prefill tok/s | prefill compile s (variants) |\n|---|---|---|---|---|"
        )
        for rate in args.rates:
            model = model_at(
                rate, config=args.config, form=args.plan, method=args.method, band=args.band, qk_basis=args.qk_basis
            )
            swept = prefill_sweep(model, rate, batch, ctx, args.prefill_chunks)
            result["prefill_rows"] += [dict(r, method=method_name(args) if rate else "none") for r in swept]
            save()


if __name__ == "__main__":
    main()
