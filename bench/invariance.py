"""Batch invariance measured: how often batching changes greedy tokens, where the changes come from (GEMM rows,
prefill padding, the decode plan), and what the batch-invariant mode (``kvjax.generate(..., batch_invariant=True)``)
costs in decode kernel time and prefill time; ``--help`` describes each section. Results: bench/results/engine.md "Batch
invariance"."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from bench.decode import kvjax_decode_call
from bench.harness import LLAMA_8B, PagedCase, copies_for, copy_bandwidth, pick_layer, rank_plan, time_calls
from kvjax.models.config import ModelConfig
from kvjax.ops import attention
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.kernel import paged_decode
from kvjax.ops.decode.schedule import bucket, build_decode_schedule, fixed_chunk_schedule
from kvjax.runtime.engine import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = {
    "count": "N random prompts (lengths 8-256, random ids) through a random Llama-shaped model, greedy; each "
    "prompt's tokens batched (--max-batch) against the same prompt alone, in the default and the invariant "
    "mode; a difference in the first token comes from prefill, a later one from decode",
    "probes": "the candidate sources one at a time, bitwise: a GEMM row computed in batches of 1 to 256 rows; a "
    "prompt's prefill logits padded to longer buckets; a sequence's decode attention (the kernels, on a "
    "GPU) planned with other sequences beside it against alone, with the default and the fixed-chunk plan",
    "cost": "(GPU) the decode kernel per layer with the default plan against the fixed-chunk plan, beside the floor "
    "(CUPTI), at rate 0 and 0.5 on Llama-3.1-8B attention shapes; and prefill of B prompts batched against "
    "one at a time on a 2-layer Llama-3.1-8B-shaped model (host timer, whole calls of tens of ms)",
}

SMALL = ModelConfig(
    arch="llama",
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=512,
    intermediate_size=1024,
    vocab_size=2048,
    norm_eps=1e-5,
    max_position_embeddings=1024,
)
LLAMA8B_2L = dataclasses.replace(LLAMA_8B, num_layers=2, max_position_embeddings=8192)


def count(args) -> dict:
    """Prompts whose greedy tokens differ batched vs alone, by mode, and whether the first token (prefill) differs."""
    model = kvjax.Model.random(SMALL, dtype=args.dtype, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, SMALL.vocab_size, int(n)).tolist() for n in rng.integers(8, 257, args.prompts)]
    opts = dict(max_new_tokens=args.new_tokens, max_seq_len=512, max_batch=args.max_batch)
    out = {}
    for mode, inv in (("default", False), ("batch_invariant", True)):
        t0 = time.perf_counter()
        batched = [r.tokens for r in kvjax.generate(model, prompts, batch_invariant=inv, **opts)]
        alone = [kvjax.generate(model, [p], batch_invariant=inv, **opts)[0].tokens for p in prompts]
        differ = [i for i, (a, b) in enumerate(zip(batched, alone, strict=True)) if a != b]
        first = sum(batched[i][0] != alone[i][0] for i in differ)
        out[mode] = dict(
            differ=len(differ), first_token=first, later=len(differ) - first, seconds=time.perf_counter() - t0
        )
    print(
        f"\n{args.prompts} prompts, {args.dtype}, {args.new_tokens} new tokens, max_batch {args.max_batch}, "
        f"backend {jax.default_backend()}:\n| mode | prompts whose tokens differ batched vs alone | first token "
        f"(prefill) | later (decode) |\n|---|---|---|---|"
    )
    for mode, r in out.items():
        print(f"| {mode} | {r['differ']} of {args.prompts} | {r['first_token']} | {r['later']} |")
    return out


def _bitwise(a, b) -> tuple[bool, float]:
    """(whether a and b are bitwise equal, their largest absolute difference)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.array_equal(a, b)), float(np.max(np.abs(a - b)))


def probes(args) -> dict:
    """Bitwise probes of each candidate source: GEMM rows, prefill padding, and (on a GPU) the decode plan."""
    dtype = jnp.dtype(args.dtype)
    key = jax.random.key(args.seed)
    k1, k2, k3 = jax.random.split(key, 3)
    out = {}
    # GEMM: row 0 of x @ w as the number of rows changes (what a batch bucket changes).
    w = jax.random.normal(k1, (4096, 14336), jnp.float32).astype(dtype)
    x = jax.random.normal(k2, (256, 4096), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, w: x @ w)
    ref = mm(x[:1], w)[0]
    out["gemm"] = {m: _bitwise(mm(x[:m], w)[0], ref) for m in (2, 8, 32, 64, 256)}
    # Prefill: a prompt's last-token logits as its padded length grows (what a longer prompt beside it does).
    model = kvjax.Model.random(SMALL, dtype=args.dtype, seed=args.seed)
    prompt = np.asarray(jax.random.randint(k3, (1, 40), 0, SMALL.vocab_size))
    engine = Engine(model, max_batch=1, max_seq_len=512, page_size=16)
    table = np.arange(1, 33, dtype=np.int32)[None]
    lengths = np.array([40], np.int32)
    step = jax.jit(lambda t: _prefill_logits(model, engine, t, lengths, table))
    base = step(np.pad(prompt, ((0, 0), (0, 24))))
    out["prefill_padding"] = {t: _bitwise(step(np.pad(prompt, ((0, 0), (0, t - 40)))), base) for t in (128, 256, 512)}
    if jax.default_backend() == "gpu":
        out["decode_kernel"] = _decode_probe(args)
    print("\nprobes (bitwise equal?, max |diff|):")
    for name, rows in out.items():
        print(f"  {name}: " + ", ".join(f"{k}: {'equal' if eq else f'differs {d:.3g}'}" for k, (eq, d) in rows.items()))
    return {name: {str(k): v for k, v in rows.items()} for name, rows in out.items()}


def _prefill_logits(model, engine, tokens, lengths, table):
    """Last-token logits of prompts ``tokens`` [B, T] of ``lengths`` run through the engine's prefill op."""
    module = nnx.merge(model.graphdef, model.state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ks, vs = list(engine.cache.k), list(engine.cache.v)

    def attend(i, q, k, v, rebuild=None, rotation=None):
        o, ks[i], vs[i] = attention.prefill(
            q,
            k,
            v,
            module.layouts[i],
            ks[i],
            vs[i],
            table,
            lengths,
            op=engine.prefill_op,
            rebuild=rebuild,
            rotation=rotation,
        )
        return o

    hidden = module.hidden(tokens, positions, attend)
    return module.logits(hidden[jnp.arange(b), lengths - 1])


def _decode_probe(args) -> dict:
    """Sequence 0's decode attention output: alone vs beside 31 others, default plan vs fixed-chunk plan."""
    rows = {}
    for rate in (0.0, 0.5):
        lay = rank_plan(rate)[0]
        ps, ctx, b = 16, 4096, 32
        pps = ctx // ps
        key = jax.random.key(args.seed + 7)
        kk, kv, kq = jax.random.split(key, 3)
        n = b * pps + 1
        k = jax.random.normal(kk, (n, ps, lay.k_cols), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (n, ps, lay.v_cols), jnp.float32).astype(jnp.bfloat16)
        q = jax.random.normal(kq, (b, lay.q_cols), jnp.float32).astype(jnp.bfloat16)
        table = jnp.asarray(1 + np.arange(b * pps, dtype=np.int32).reshape(b, pps))
        lengths = np.random.default_rng(args.seed).integers(ctx // 2, ctx + 1, b).astype(np.int32)
        lengths[0] = 3000
        inputs = (q, k, v, table, lengths, lay)
        for fixed in (False, True):
            rows[f"rate {rate} {'fixed' if fixed else 'default'} plan"] = _bitwise(
                _first_row(*inputs, batch=b, fixed=fixed), _first_row(*inputs, batch=1, fixed=fixed)
            )
    return rows


def _first_row(q, k, v, table, lengths, lay, *, batch, fixed):
    """Row 0 of decode attention over the first ``batch`` sequences, planned by default or in fixed chunks."""
    lens, ps = lengths[:batch], k.shape[1]
    if fixed:
        chunk = DECODE.fixed_chunk_tokens // ps
        plan = fixed_chunk_schedule(lens, lay, ps, chunk_pages=chunk, splits=table.shape[1] // chunk)
    else:
        plan = build_decode_schedule(lens, lay, ps)
    return paged_decode(q[:batch], k, v, table[:batch], jnp.asarray(lens), plan.schedule.layer(0), lay)[0]


def cost(args) -> dict:
    """Decode kernel per layer, default plan vs fixed-chunk plan (CUPTI), and prefill batched vs one at a time."""
    bw = copy_bandwidth()
    key = jax.random.key(args.seed)
    out = {"copy_bandwidth_GBps": bw / 1e9, "decode": [], "prefill": []}
    print(
        f"\ncopy bandwidth {bw / 1e9:.0f} GB/s\n| shape | rate | default plan us | fixed-chunk plan us | floor us | "
        f"fixed / default |\n|---|---|---|---|---|---|"
    )
    for b, ctx in ((32, 2048), (32, 4096), (128, 4096), (1, 32768)):
        for rate in (0.0, 0.5):
            lay = pick_layer(rank_plan(rate), rate)
            ps = 16
            case = PagedCase(lay, b, np.full(b, ctx), ps, copies_for(b * ctx * (lay.k_cols + lay.v_cols) * 2), key)
            chunk = DECODE.fixed_chunk_tokens // ps
            plans = {
                "default": build_decode_schedule(case.lengths, lay, ps),
                "fixed": fixed_chunk_schedule(
                    case.lengths, lay, ps, chunk_pages=chunk, splits=bucket(-(-ctx // DECODE.fixed_chunk_tokens))
                ),
            }
            t = {name: time_calls(*kvjax_decode_call(case, p.schedule.layer(0), key)) for name, p in plans.items()}
            floor = case.bytes / bw
            row = dict(
                batch=b,
                ctx=ctx,
                rate=rate,
                default_us=t["default"] * 1e6,
                fixed_us=t["fixed"] * 1e6,
                floor_us=floor * 1e6,
            )
            out["decode"].append(row)
            print(
                f"| B{b} x {ctx} | {rate} | {row['default_us']:.1f} | {row['fixed_us']:.1f} | "
                f"{row['floor_us']:.1f} | {t['fixed'] / t['default']:.2f}x |",
                flush=True,
            )
    model = kvjax.Model.random(LLAMA8B_2L, dtype="bfloat16", seed=args.seed, scale=0.02)
    print(
        "\nprefill, 2-layer Llama-3.1-8B shape (host timer):\n| prompts | batched ms | one at a time ms | ratio |"
        "\n|---|---|---|---|"
    )
    for b, t in ((8, 1024), (32, 512)):
        prompts = np.random.default_rng(args.seed).integers(0, LLAMA8B_2L.vocab_size, (b, t)).tolist()
        times = {}
        for inv in (False, True):
            opts = dict(max_new_tokens=1, max_batch=b, max_seq_len=t + 16, batch_invariant=inv)
            kvjax.generate(model, prompts, **opts)  # compile
            t0 = time.perf_counter()
            for _ in range(3):
                kvjax.generate(model, prompts, **opts)
            times[inv] = (time.perf_counter() - t0) / 3
        row = dict(prompts=b, tokens=t, batched_ms=times[False] * 1e3, alone_ms=times[True] * 1e3)
        out["prefill"].append(row)
        print(f"| {b} x {t} | {row['batched_ms']:.1f} | {row['alone_ms']:.1f} | {times[True] / times[False]:.2f}x |")
    return out


def main(argv=None):
    """Run the sections asked for, writing ``--out`` after each."""
    epilog = "sections (--only):\n" + "\n".join(
        textwrap.fill(what, 118, initial_indent=f"  {name:<8}", subsequent_indent=" " * 10)
        for name, what in SECTIONS.items()
    )
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default="count,probes,cost", help="comma list of sections: count, probes, cost (GPU)")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "invariance.json"),
        help="JSON of every section, rewritten after each",
    )
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.only.split(",")) - set(SECTIONS)):
        ap.error(f"unknown sections {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    result = {
        "date": datetime.date.today().isoformat(),
        "device": str(jax.devices()[0].device_kind),
        "args": vars(args),
    }
    sections = {"count": count, "probes": probes, "cost": cost}
    for name in args.only.split(","):
        if name == "cost" and jax.default_backend() != "gpu":
            print(
                f"cost: times the compiled decode kernel and needs a GPU (JAX backend: {jax.default_backend()}), "
                "skipped"
            )
            continue
        result[name] = sections[name](args)
        with open(args.out, "w") as f:  # after every section, so a cut-short run keeps what it measured
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
