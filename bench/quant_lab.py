"""Lab: formulations of the int4 decode kernel's inner loop, each as a standalone Pallas kernel (a program a
(sequence, KV head, split) streaming its whole pages, no schedule, no tail, partials merged in jnp), timed side by
side on a GPU (CUPTI) with the floor (the pages' bytes over the measured copy bandwidth) and checked against
``quantized_decode_attention``. Uniform heads of 128 + 128 (rate 0), G = 4, pages of 32 tokens, B32 x 8K by default.
What it found: bench/results/quantization.md "Quantized pages: decode kernel lab";
bench/notes/2026-11-27-quantized-kernel-lab.md.

Variants (``--variants``; a ``_pre`` suffix issues a step's loads one step ahead, held in registers):
  gather  the production kernel's arithmetic: each column's code read from byte ``c % 64`` and shifted, keys
          dequantized in float32 before one dot, value scales folded into the weights
  fold    the two nibble planes of contiguous bytes, key scales folded into q per page, biased codes (128 + c, exact
          in bf16, no conversion) straight into the dots, a row correction per page
  swap    fold with the dots' operands swapped: codes the left operand, q and the weights the small right one
  fma     fold's arithmetic on CUDA cores, the G real query rows only (no dots)
  load    the loads alone, each read summed (an ablation: what the memory system gives these loads)
  wide    fold reading the scales and zeros as float16 runs (a float16 view of the pool): every load of the loop
          at least 32 bits a lane, which Triton's pipeliner requires before it turns a load into an asynchronous
          copy (AssignLatencies.cpp, ``isSmallLoad``); the others read them as byte pairs, too narrow
  zdot    wide with no cross-warp reduction a page: exact codes, and the zero points' terms as dots against the
          zero rows broadcast over the page's tokens (float32: TF32)

``--interpret --timer host --shape 2x256`` checks every variant on a CPU (its times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import harness
from bench.harness import HKV, HQ, D, PagedCase, copy_bandwidth, count_arg, log, shape_arg
from kvjax.ops.decode.reference import quantized_decode_attention
from kvjax.ops.pallas_util import LOG2E, MASK, whole_block
from kvjax.ops.quant import PageFormat
from kvjax.ops.quant_paging import create_tail

R = 16  # query rows a tile: the GQA group padded to the tensor cores' smallest M
P = 32  # tokens a page
G = HQ // HKV
HALF = D // 2  # columns a nibble plane
VARIANTS = ("gather", "fold", "swap", "fma", "load", "wide", "zdot")


def _f16(lo, hi):
    """float16 from its two bytes (uint8 tiles), as float32."""
    word = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(word, jnp.float16).astype(jnp.float32)


def _biased(raw, shift):
    """128 + code as bf16: exact, no conversion instruction (the code in the mantissa of 128)."""
    code = (raw.astype(jnp.uint16) >> shift) & jnp.uint16(15)
    return lax.bitcast_convert_type(code | jnp.uint16(0x4300), jnp.bfloat16)


class Page(NamedTuple):
    """What a program reads of one page for its head, as loaded (no arithmetic yet: a prefetch can run ahead)."""

    k_meta: tuple  # the bytes of the key scales and zeros, low plane then high: 4 x (low byte, high byte) [1, 64]
    k_raw: jax.Array  # [P, 64] code bytes
    v_raw: jax.Array
    v_meta: tuple  # the bytes of the value scales and zeros [P]: 2 x (low byte, high byte)


def fetch(pool_ref, table_ref, fmt: PageFormat, seq, h, i, pps):
    """Page ``i`` of sequence ``seq`` for head ``h`` (``i`` clamped to the table: a prefetch past the end reads the
    last page again, unused)."""
    at, t, c = fmt.offsets, jnp.arange(P)[:, None], jnp.arange(HALF)[None, :]
    base = table_ref[seq, jnp.minimum(i, pps - 1)] * fmt.page_bytes
    km = base + at["k_meta"] + 2 * (h * D + c)
    k_meta = tuple(
        plgpu.load(pool_ref.at[a + byte])
        for a in (km, km + 2 * HALF, km + 2 * fmt.k_cols, km + 2 * fmt.k_cols + 2 * HALF)
        for byte in (0, 1)
    )
    k_raw = plgpu.load(pool_ref.at[base + t * (fmt.k_cols // 2) + h * HALF + c])
    v_raw = plgpu.load(pool_ref.at[base + at["v_codes"] + t * (fmt.v_cols // 2) + h * HALF + c])
    vm = base + at["v_meta"] + 2 * (h * P + jnp.arange(P))
    v_meta = tuple(plgpu.load(pool_ref.at[a + byte]) for a in (vm, vm + 2 * P * HKV) for byte in (0, 1))
    return Page(k_meta, k_raw, v_raw, v_meta)


def meta_view(pool):
    """The pool as float16 (its metadata's view; a bitcast in XLA, no copy): what ``fetch_wide`` reads."""
    return lax.bitcast_convert_type(pool.reshape(-1, 2), jnp.float16)


def fetch_wide(pool_ref, meta_ref, table_ref, fmt: PageFormat, seq, h, i, pps):
    """``fetch`` with the metadata as float16 runs of ``meta_ref`` (``meta_view``), the codes as bytes."""
    at, t, c = fmt.offsets, jnp.arange(P)[:, None], jnp.arange(HALF)[None, :]
    page = table_ref[seq, jnp.minimum(i, pps - 1)]
    base, half = page * fmt.page_bytes, page * (fmt.page_bytes // 2)
    km = half + at["k_meta"] // 2 + h * D + c
    k_meta = tuple(plgpu.load(meta_ref.at[a]) for a in (km, km + HALF, km + fmt.k_cols, km + fmt.k_cols + HALF))
    k_raw = plgpu.load(pool_ref.at[base + t * (fmt.k_cols // 2) + h * HALF + c])
    v_raw = plgpu.load(pool_ref.at[base + at["v_codes"] + t * (fmt.v_cols // 2) + h * HALF + c])
    vm = half + at["v_meta"] // 2 + h * P + jnp.arange(P)
    v_meta = (plgpu.load(meta_ref.at[vm]), plgpu.load(meta_ref.at[vm + HKV * P]))
    return Page(k_meta, k_raw, v_raw, v_meta)


def _metas(page: Page):
    """(key scale and zero of the low and high planes [1, 64], value scale and zero [P]) as float32, from either
    form ``Page`` holds them in: byte pairs (``fetch``) or float16 (``fetch_wide``)."""
    if len(page.k_meta) == 4:
        return (*(x.astype(jnp.float32) for x in page.k_meta), *(x.astype(jnp.float32) for x in page.v_meta))
    k = tuple(_f16(page.k_meta[2 * j], page.k_meta[2 * j + 1]) for j in range(4))
    return (*k, _f16(*page.v_meta[:2]), _f16(*page.v_meta[2:]))


def _row(x, r):
    """Row ``r`` of x [R, C] as [C] (no slicing in the Triton lowering: a masked sum)."""
    return jnp.sum(jnp.where(jnp.arange(R)[:, None] == r, x, 0.0), axis=0)


def use(page: Page, q_lo, q_hi, variant: str):
    """Scores of the page (log2 units; [R, P], or [P, R] for swap) and a function of its weights giving (outputs
    of the two planes, a row term to add to every column)."""
    ks_lo, ks_hi, kz_lo, kz_hi, vs, vz = _metas(page)
    qs_lo, qs_hi = (q_lo * ks_lo).astype(jnp.bfloat16), (q_hi * ks_hi).astype(jnp.bfloat16)
    corr = jnp.sum(q_lo * kz_lo + q_hi * kz_hi, axis=1)  # q . zero: the same for every token of the page
    if variant == "load":
        total = sum(x.astype(jnp.float32).sum() for x in (page.k_raw, page.v_raw, *page.k_meta, *page.v_meta))
        zeros = jnp.zeros((R, HALF), jnp.float32)
        return jnp.zeros((R, P), jnp.float32) + total * 1e-30 + corr[:, None], lambda p: (
            [zeros, zeros],
            jnp.zeros((R,), jnp.float32),
        )
    if variant == "fma":
        return _use_fma(page, qs_lo, qs_hi, vs, vz, corr)
    if variant == "zdot":
        return _use_zdot(page, q_lo, q_hi, qs_lo, qs_hi, kz_lo, kz_hi, vs, vz)
    corr = corr - 128.0 * jnp.sum(qs_lo.astype(jnp.float32) + qs_hi.astype(jnp.float32), axis=1)  # the bias's share
    lo, hi = _biased(page.k_raw, 0), _biased(page.k_raw, 4)
    vlo, vhi = _biased(page.v_raw, 0), _biased(page.v_raw, 4)
    if variant == "swap":
        scores = plgpu.dot(lo, qs_lo, trans_b=True) + plgpu.dot(hi, qs_hi, trans_b=True) + corr[None, :]

        def values(p):  # p [P, R]; outputs [64, R]
            ps = (p * vs[:, None]).astype(jnp.bfloat16)
            row = jnp.sum(p * vz[:, None] - 128.0 * ps.astype(jnp.float32), axis=0)
            return [plgpu.dot(vlo, ps, trans_a=True), plgpu.dot(vhi, ps, trans_a=True)], row

        return scores, values
    scores = plgpu.dot(qs_lo, lo, trans_b=True) + plgpu.dot(qs_hi, hi, trans_b=True) + corr[:, None]

    def values(p):
        ps = (p * vs[None, :]).astype(jnp.bfloat16)
        row = jnp.sum(p * vz[None, :] - 128.0 * ps.astype(jnp.float32), axis=1)
        return [plgpu.dot(ps, vlo), plgpu.dot(ps, vhi)], row

    return scores, values


def _use_zdot(page: Page, q_lo, q_hi, qs_lo, qs_hi, kz_lo, kz_hi, vs, vz):
    """``use`` with no cross-warp reduction a page: exact codes (no bias to correct), and the zero points' terms
    as dots against the zero rows broadcast over the page's tokens (float32 inputs: TF32 tensor cores)."""
    lo, hi = (_biased(page.k_raw, s) - jnp.bfloat16(128) for s in (0, 4))
    vlo, vhi = (_biased(page.v_raw, s) - jnp.bfloat16(128) for s in (0, 4))
    zeros = plgpu.dot(q_lo, jnp.broadcast_to(kz_lo, (P, HALF)), trans_b=True) + plgpu.dot(
        q_hi, jnp.broadcast_to(kz_hi, (P, HALF)), trans_b=True
    )
    scores = plgpu.dot(qs_lo, lo, trans_b=True) + plgpu.dot(qs_hi, hi, trans_b=True) + zeros

    def values(p):
        ps = (p * vs[None, :]).astype(jnp.bfloat16)
        base = plgpu.dot(p, jnp.broadcast_to(vz[:, None], (P, HALF)))  # each column: sum_t p_t zero_t
        return [plgpu.dot(ps, vlo) + base, plgpu.dot(ps, vhi) + base], jnp.zeros((R,), jnp.float32)

    return scores, values


def _use_fma(page: Page, qs_lo, qs_hi, vs, vz, corr):
    """``use`` on CUDA cores: a multiply-add a code and real query row, no dots."""
    rows = jnp.arange(R)[:, None]
    kc, vc = page.k_raw.astype(jnp.int32), page.v_raw.astype(jnp.int32)
    klo, khi = (kc & 15).astype(jnp.float32), (kc >> 4).astype(jnp.float32)
    vlo, vhi = (vc & 15).astype(jnp.float32), (vc >> 4).astype(jnp.float32)
    scores = jnp.full((R, P), MASK, jnp.float32)
    for r in range(G):
        ql, qh = _row(qs_lo.astype(jnp.float32), r), _row(qs_hi.astype(jnp.float32), r)
        scores = jnp.where(rows == r, jnp.sum(klo * ql[None, :] + khi * qh[None, :], axis=1)[None, :], scores)

    def values(p):
        ps = p * vs[None, :]
        outs = [jnp.zeros((R, HALF), jnp.float32)] * 2
        for r in range(G):
            pr = _row(ps, r)[:, None]
            outs = [jnp.where(rows == r, jnp.sum(pr * x, axis=0)[None, :], o) for o, x in zip(outs, (vlo, vhi))]
        return outs, jnp.sum(p * vz[None, :], axis=1)

    return scores + corr[:, None], values


def gather_page(pool_ref, table_ref, fmt: PageFormat, seq, h, i, q):
    """The production kernel's arithmetic on page ``i`` (``quant_kernel._Reader``): scores [R, P] and values."""
    at, t, c = fmt.offsets, jnp.arange(P)[:, None], jnp.arange(D)[None, :]
    base = table_ref[seq, i] * fmt.page_bytes
    shift = (c // HALF * 4).astype(jnp.uint32)

    def codes(first, row_bytes):
        raw = plgpu.load(pool_ref.at[base + first + t * row_bytes + h * HALF + c % HALF])
        return ((raw.astype(jnp.uint32) >> shift) & 15).astype(jnp.float32)

    km = base + at["k_meta"] + 2 * (h * D + c)
    scale = _f16(plgpu.load(pool_ref.at[km]), plgpu.load(pool_ref.at[km + 1]))
    zero = _f16(plgpu.load(pool_ref.at[km + 2 * fmt.k_cols]), plgpu.load(pool_ref.at[km + 2 * fmt.k_cols + 1]))
    k = (codes(0, fmt.k_cols // 2) * scale + zero).astype(jnp.bfloat16)
    v = codes(at["v_codes"], fmt.v_cols // 2).astype(jnp.bfloat16)
    vm = base + at["v_meta"] + 2 * (h * P + jnp.arange(P))
    vs = _f16(plgpu.load(pool_ref.at[vm]), plgpu.load(pool_ref.at[vm + 1]))
    vz = _f16(plgpu.load(pool_ref.at[vm + 2 * P * HKV]), plgpu.load(pool_ref.at[vm + 2 * P * HKV + 1]))

    def values(p):
        return [plgpu.dot((p * vs[None, :]).astype(jnp.bfloat16), v)], jnp.sum(p * vz[None, :], axis=1)

    return plgpu.dot(q, k, trans_b=True), values


def lab_kernel(table_ref, q_ref, pool_ref, meta_ref, acc_ref, m_ref, l_ref, *, variant, nc, pps, splits, fmt):
    """One program: its (sequence, head, split)'s pages, ``nc`` a loop step, into a partial (acc, max, sum)."""
    pid = pl.program_id(0)
    seq, h, split = pid // (HKV * splits), (pid // splits) % HKV, pid % splits
    kind, pre = variant.removesuffix("_pre"), variant.endswith("_pre")
    rows = jnp.arange(R)

    def load_q(first, width):
        at = seq * HQ * D + (h * G + rows[:, None]) * D + first + jnp.arange(width)[None, :]
        q = plgpu.load(q_ref.at[at], mask=(rows < G)[:, None], other=0).astype(jnp.float32)
        return q * (LOG2E / math.sqrt(D))  # scores in log2 units

    first = split * (pps // splits)
    if kind == "gather":
        q = load_q(0, D).astype(jnp.bfloat16)
        page = functools.partial(gather_page, pool_ref, table_ref, fmt, seq, h, q=q)
        accs = [jnp.zeros((R, D), jnp.float32)]
    else:
        q_lo, q_hi = load_q(0, HALF), load_q(HALF, HALF)
        if kind in ("wide", "zdot"):
            fetch_page = functools.partial(fetch_wide, pool_ref, meta_ref, table_ref, fmt, seq, h, pps=pps)
            kind = "fold" if kind == "wide" else kind
        else:
            fetch_page = functools.partial(fetch, pool_ref, table_ref, fmt, seq, h, pps=pps)
        page = lambda i: use(fetch_page(i), q_lo, q_hi, kind)  # noqa: E731
        accs = [jnp.zeros((HALF, R) if kind == "swap" else (R, HALF), jnp.float32)] * 2
    tok = 0 if kind == "swap" else 1  # the token axis of a score tile
    bc = (lambda x: x[None, :]) if kind == "swap" else (lambda x: x[:, None])

    def step(j, carry):
        if pre:
            *state, ahead = carry
            parts = [use(f, q_lo, q_hi, kind) for f in ahead]
            ahead = [fetch_page(first + (j + 1) * nc + c) for c in range(nc)]
        else:
            state = carry
            parts = [page(first + j * nc + c) for c in range(nc)]
        accs, m, l = state
        m_new = jnp.maximum(m, functools.reduce(jnp.maximum, [s for s, _ in parts]).max(axis=tok))
        alpha = jnp.exp2(m - m_new)
        ps = [jnp.exp2(s - bc(m_new)) for s, _ in parts]
        accs = [a * bc(alpha) for a in accs]
        total = 0.0
        for p, (_, values) in zip(ps, parts):
            outs, row = values(p)
            accs = [a + o for a, o in zip(accs, outs)]
            total = total + row
        state = ([a + bc(total) for a in accs], m_new, l * alpha + jnp.sum(functools.reduce(jnp.add, ps), axis=tok))
        return (*state, ahead) if pre else state

    carry = (accs, jnp.full((R,), MASK, jnp.float32), jnp.zeros((R,), jnp.float32))
    if pre:
        carry = (*carry, [fetch_page(first + c) for c in range(nc)])
    accs, m, l = lax.fori_loop(0, pps // splits // nc, step, carry)[:3]
    out = pid * R + rows
    for i, a in enumerate(accs):
        cols = i * HALF + jnp.arange(a.shape[0 if kind == "swap" else 1])
        at = out[None, :] * D + cols[:, None] if kind == "swap" else out[:, None] * D + cols[None, :]
        plgpu.store(acc_ref.at[at], a)
    plgpu.store(m_ref.at[out], m)
    plgpu.store(l_ref.at[out], l)


@functools.partial(jax.jit, static_argnames=("variant", "nc", "splits", "fmt", "num_warps", "num_stages", "interpret"))
def lab_decode(q, pool, meta, table, *, variant, nc, splits, fmt, num_warps, num_stages=2, interpret=False):
    """Attention output [B, HQ * D] of q against every whole page of the table, by the variant's kernel (``meta``:
    the pool's float16 view, ``meta_view``, read by ``wide`` only)."""
    b, pps = table.shape
    n = b * HKV * splits
    kernel = functools.partial(lab_kernel, variant=variant, nc=nc, pps=pps, splits=splits, fmt=fmt)
    args = [table, q.reshape(-1), pool.reshape(-1), meta.reshape(-1)]
    out_shape = [jax.ShapeDtypeStruct((n * R * s,), jnp.float32) for s in (D, 1, 1)]
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[whole_block(x) for x in args],
        out_specs=[whole_block(x) for x in out_shape],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*args)
    acc, m, l = acc.reshape(b, HKV, splits, R, D), m.reshape(b, HKV, splits, R), l.reshape(b, HKV, splits, R)
    w = jnp.exp2(m - m.max(axis=2, keepdims=True))
    o = (acc * w[..., None]).sum(2) / (l * w).sum(2)[..., None]
    return o[:, :, :G].reshape(b, HQ * D).astype(q.dtype)


def counts(text: str) -> list[int]:
    """A comma-separated list of positive integers (an argparse ``type``)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, comma-separated, got {text!r}")
    return values


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=shape_arg("--shape"), default=(32, 8192), help="BxCTX (default 32x8192)")
    ap.add_argument("--variants", default="gather,fold,fold_pre,swap", help="comma-separated (module docstring)")
    ap.add_argument("--nc", type=counts, default=[1, 2, 4], help="pages a loop step, comma-separated (default 1,2,4)")
    ap.add_argument("--warps", type=counts, default=[4], help="warps a program, comma-separated (default 4)")
    ap.add_argument("--stages", type=counts, default=[2], help="Triton pipeline stages, comma-separated (default 2)")
    ap.add_argument("--splits", type=count_arg("--splits"), default=2, help="programs a (sequence, head) (default 2)")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in interpret mode (CPU)")
    harness.timer_option(ap)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    for v in args.variants.split(","):
        if v.removesuffix("_pre") not in VARIANTS or (v.endswith("_pre") and v.startswith("gather")):
            ap.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}, with _pre for all but gather")
    harness.TIMER["name"] = args.timer
    batch, ctx = args.shape
    step = P * args.splits * math.lcm(*args.nc)  # every split reads whole loop steps of whole pages
    if ctx % step:
        ap.error(f"the context must be a multiple of {step} tokens (pages of {P}, --splits, --nc)")
    lay = harness.uniform(D)
    key = jax.random.key(0)
    case = PagedCase(lay, batch, np.full(batch, ctx), P, harness.copies_for(batch * ctx * 4 * HKV * D), key)
    fmt = PageFormat.for_layout(lay, P, 4)
    pool = jax.jit(fmt.encode)(case.k, case.v)
    del case.k, case.v
    meta = jax.jit(meta_view)(pool)
    lengths = jnp.asarray(case.lengths)
    per_call = [
        (q, case.tables[u % case.tables.shape[0]]) for u, (q,) in enumerate(harness.queries(key, (batch, lay.q_cols)))
    ]
    bandwidth = copy_bandwidth() if not args.interpret else 1e12
    nbytes = int((case.lengths // P).sum() * fmt.page_bytes)
    floor = nbytes / bandwidth
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor * 1e6:.0f} us for {nbytes / 1e6:.0f} MB")
    q0, table0 = per_call[0]
    tail = create_tail(fmt, batch, jnp.bfloat16)
    want = quantized_decode_attention(q0.astype(jnp.float32), pool, tail, fmt, table0, lengths, lay)
    rows = []
    print("| variant | pages a step | warps | stages | time us | floor us | % of copy bw | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, nc, warps, stages in itertools.product(args.variants.split(","), args.nc, args.warps, args.stages):
        opts = dict(variant=variant, nc=nc, splits=args.splits, fmt=fmt, num_warps=warps, num_stages=stages)
        shared = (pool, meta)

        def call(pool, meta, q, table, opts=opts):
            return lab_decode(q, pool, meta, table, interpret=args.interpret, **opts)

        label = f"| {variant} | {nc} | {warps} | {stages} |"
        try:
            got = call(*shared, q0, table0).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            t = harness.time_calls(call, shared, per_call)
        except Exception as e:  # a variant the compiler refuses: reported, the rest go on
            print(f"{label} failed: {str(e).splitlines()[0][:100]} |", flush=True)
            continue
        rows.append(dict(variant=variant, nc=nc, warps=warps, stages=stages, us=t * 1e6, floor_us=floor * 1e6, err=err))
        print(f"{label} {t * 1e6:.0f} | {floor * 1e6:.0f} | {100 * floor / t:.0f}% | {err:.2g} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
