"""Decode over quantized per-head pages (issue 37: eviction stacked with quantization; "decode over ragged per-head
lengths at % of copy bandwidth on bytes read"): one layer of the random Llama-3.1-8B attention shape at ``--shape``
(default B32 x 8K), per rank rate (``harness.rank_plan``'s representative layer), each KV head storing its own share
of the context (``--keep``, drawn as ``bench.head_decode`` draws it), read by ``ops.decode.quant_head_kernel`` from
one pool of int4 or int2 groups (``--bits``; groups of ``--group`` slots: the engine's page size, 16) with each head's
partial group exact in a bf16 tail, beside ``ops.decode.head_kernel`` over the same shares in bf16 per-head pages
(the work list built once outside the timed call, as the engine's step does). Every row: CUPTI time, the floor (the
bytes the heads store, every quantized byte counted, over the measured copy bandwidth), their ratio, and the relative
error against the float32 jnp reference of its own cache (``quant_head_paging.decode_attention``,
``head_paging.decode_attention``). ``--warps``, ``--stages`` and ``--step-groups`` sweep the quantized kernel's
knobs, ``--merges`` both kernels' merge. ``--interpret --timer host --shape 2x256`` runs the rows on a CPU (plumbing
only). Table: bench/results/eviction.md "Eviction on quantized pages: the decode kernel"."""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.files import json_folder, write_json
from bench.harness import (
    copy_bandwidth,
    count_arg,
    log,
    pick_layer,
    print_table,
    rank_plan,
    rates_arg,
    rel_err,
    shape_arg,
)
from bench.head_decode import case as bf16_case
from bench.head_decode import head_tables, row, shares
from kvjax import validate
from kvjax.ops import head_paging, quant_head_paging
from kvjax.ops.decode.head_kernel import TARGET_PROGRAMS, head_paged_decode, live_work
from kvjax.ops.decode.item_merge import MERGES
from kvjax.ops.decode.quant_head_kernel import LAUNCH_FORMS, launch_heads, quant_head_decode

BF16_PAGE = 16  # the bf16 rows' pages: full-width tokens a page, the engine's default


def quant_case(layout, batch: int, context: int, keep: float, group: int, bits: int, seed: int = 0):
    """(q, pool, tail, tables, stored, bytes stored, page bytes): ``batch`` sequences whose heads store their own
    shares (``bench.head_decode.case``'s draw), each head's full groups random values encoded in its own format on
    its own pages, its partial group in the tail."""
    stored = shares(layout, batch, context, keep, seed)
    page_bytes = quant_head_paging.pool_page_bytes([layout], group, bits)
    per = quant_head_paging.layer_tokens_per_page(layout, page_bytes, group, bits)[None]
    tables, need = head_tables(per, stored, context)
    pool = jnp.zeros((need + 1, page_bytes), jnp.uint8)
    key = jax.random.key(seed)
    nbytes = 0
    for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
        fmt = quant_head_paging.head_format(kw, vw, group, bits)
        gpp = quant_head_paging.groups_per_page(page_bytes, kw, vw, group, bits)
        full = stored[:, h] // group
        grp = np.arange(max(1, int(full.max())))
        k = harness.randn(jax.random.fold_in(key, 2 * h), (batch, len(grp), group, kw), jnp.float32)
        v = harness.randn(jax.random.fold_in(key, 2 * h + 1), (batch, len(grp), group, vw), jnp.float32)
        page = np.where(grp[None] < full[:, None], tables[:, h, grp // gpp], need + 1)  # past the pool: dropped
        index = (grp % gpp)[:, None] * fmt.page_bytes + np.arange(fmt.page_bytes)  # [groups, bytes]
        at = jnp.asarray(np.broadcast_to(page[..., None], (batch, *index.shape)))
        pool = pool.at[at, jnp.asarray(index)[None]].set(fmt.encode(k, v), mode="drop")
        nbytes += int(full.sum()) * fmt.page_bytes + int((stored[:, h] % group).sum()) * (kw + vw) * 2
    tail = harness.randn(jax.random.fold_in(key, 1000), (batch, group, layout.k_cols + layout.v_cols))
    q = harness.randn(jax.random.fold_in(key, 1001), (batch, layout.q_cols))
    return q, pool, tail, jnp.asarray(tables), jnp.asarray(stored, jnp.int32), nbytes, page_bytes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_arg("--shape"), default=(32, 8192))
    p.add_argument("--rates", type=rates_arg(), default=[0.0, 0.5], help="comma-separated (default 0,0.5)")
    p.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.25], help="each head's mean share (default 1 0.25)")
    p.add_argument("--bits", type=int, nargs="+", choices=(4, 2), default=[4], help="code widths (default 4)")
    p.add_argument(
        "--group", type=count_arg("--group"), nargs="+", default=[16], help="slots a quantized group (default 16)"
    )
    p.add_argument("--warps", type=count_arg("--warps"), nargs="+", default=[4], help="Triton warps (default 4)")
    p.add_argument("--stages", type=count_arg("--stages"), nargs="+", default=[2], help="pipeline stages (default 2)")
    p.add_argument(
        "--step-groups",
        type=validate.arg(lambda v: validate.integer("--step-groups", v, low=0), int),
        nargs="+",
        default=[0],
        help="groups a program reads a loop step (0: the kernel's default, groups_a_step)",
    )
    p.add_argument("--no-bf16", action="store_true", help="leave out the bf16 per-head kernel's rows")
    p.add_argument(
        "--targets",
        type=validate.arg(lambda v: validate.integer("--targets", v, low=1, high=TARGET_PROGRAMS), int),
        nargs="+",
        default=[TARGET_PROGRAMS],
        help=f"programs a launch's work list aims at (live_work's target; default {TARGET_PROGRAMS}, the engine's)",
    )
    p.add_argument(
        "--launches",
        nargs="+",
        choices=LAUNCH_FORMS,
        default=["k-class"],
        help="k-class: a launch a class of K planes, switching between its classes of heads (the engine's, default); "
        "class: a launch a class; layer: one launch switching between the layer's classes (each launch its own work "
        "list)",
    )
    p.add_argument(
        "--merges",
        nargs="+",
        choices=MERGES,
        default=["kernel"],
        help="how each kernel's split items become the output: kernel (item_merge, the default) or xla (the butterfly)",
    )
    harness.timer_option(p)
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--json", default=None, help="write the rows here (after every row; 'complete' false until the end)")
    return p


def quant_rows(args, layout, rate: float, keep: float, bits: int, bandwidth: float):
    """The quantized kernel's rows of one case, one a combination of ``--warps``, ``--stages`` and ``--step-groups``."""
    batch, context = args.shape
    for group in args.group:
        yield from _group_rows(args, layout, rate, keep, bits, group, bandwidth)


def _group_rows(args, layout, rate: float, keep: float, bits: int, group: int, bandwidth: float):
    batch, context = args.shape
    q, pool, tail, tables, stored, nbytes, page_bytes = quant_case(layout, batch, context, keep, group, bits)
    want = quant_head_paging.decode_attention(
        q.astype(jnp.float32), pool, tail.astype(jnp.float32), tables, stored, layout, page_bytes, group, bits, context
    )
    combos = itertools.product(args.warps, args.stages, args.step_groups, args.launches, args.targets, args.merges)
    for warps, stages, step, launches, target, merge in combos:
        knobs = dict(
            num_warps=warps, num_stages=stages, step_groups=step or None, interpret=args.interpret, merge=merge
        )
        knobs |= dict(launches=launches)
        # the work lists once, outside the timed call, from the live slots: the engine's step builds them once
        live = {n: jnp.ones((batch, n), bool) for n in launch_heads(layout, bits, launches)}
        work = {n: live_work(x, target=target) for n, x in live.items()}

        def run(pool, tail, tables, stored, work, q, knobs=knobs):
            return quant_head_decode(q, pool, tail, tables, stored, layout, page_bytes, group, bits, work=work, **knobs)

        err = rel_err(run(pool, tail, tables, stored, work, q), want)
        seconds = harness.time_calls(run, (pool, tail, tables, stored, work), [(q,)])
        label = dict(kernel=f"int{bits} per-head", group=group, warps=warps, stages=stages)
        label |= dict(step_groups=step or "default", launches=launches, target=target, merge=merge)
        yield row(rate, keep, batch, context, seconds, nbytes / bandwidth, err, **label, bytes=nbytes)


def bf16_rows(args, layout, rate: float, keep: float, bandwidth: float):
    """``head_kernel``'s rows over the same shares in bf16 per-head pages (the live schedule, as the engine runs it),
    one a ``--merges``."""
    for merge in args.merges:
        yield bf16_row(args, layout, rate, keep, bandwidth, merge)


def bf16_row(args, layout, rate: float, keep: float, bandwidth: float, merge: str) -> dict:
    """``head_kernel``'s row over the same shares in bf16 per-head pages (the live schedule, as the engine runs it)."""
    batch, context = args.shape
    q, pool, tables, stored, nbytes, page_elems = bf16_case(layout, batch, context, keep, BF16_PAGE)
    want = head_paging.decode_attention(
        q.astype(jnp.float32), pool.astype(jnp.float32), tables, stored, layout, page_elems, context
    )
    work = live_work(stored)

    def run(pool, tables, stored, work, q):
        return head_paged_decode(
            q,
            pool,
            tables,
            stored,
            layout,
            page_elems,
            schedule="live",
            work=work,
            merge=merge,
            interpret=args.interpret,
        )

    err = rel_err(run(pool, tables, stored, work, q), want)
    seconds = harness.time_calls(run, (pool, tables, stored, work), [(q,)])
    label = dict(
        kernel="bf16 per-head",
        group="-",
        warps=4,
        stages=2,
        step_groups="-",
        launches="-",
        target=TARGET_PROGRAMS,
        merge=merge,
        bytes=nbytes,
    )
    return row(rate, keep, batch, context, seconds, nbytes / bandwidth, err, **label)


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    json_folder(p, args.json)
    harness.TIMER["name"] = args.timer
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows: list[dict] = []
    result = {"args": vars(args), "bandwidth": bandwidth, "rows": rows, "complete": False}

    def add(r: dict) -> None:
        """A row kept, and the JSON rewritten whole: a run cut short keeps what it measured."""
        rows.append(r)
        if args.json:
            write_json(args.json, result, indent=1)

    for rate in args.rates:
        layout = pick_layer(rank_plan(rate), rate)
        for keep in args.keep:
            for bits in args.bits:
                for r in quant_rows(args, layout, rate, keep, bits, bandwidth):
                    add(r)
            for r in () if args.no_bf16 else bf16_rows(args, layout, rate, keep, bandwidth):
                add(r)
    print_table(rows)
    result["complete"] = True
    if args.json:
        write_json(args.json, result, indent=1)


if __name__ == "__main__":
    main()
