"""Decode over per-head pages (issue 37: "decode over ragged per-head lengths at % of copy bandwidth on bytes read"):
one layer of the random Llama-3.1-8B attention shape (32 query heads, 8 KV heads of 128) at ``--shape`` (default
B32 x 8K), per rank rate (``harness.rank_plan``'s representative layer), each KV head storing its own share of the
context (``--keep``: below 1 the mean share, each head drawing its own from [keep/2, min(1, 3 keep/2)], as eviction
leaves them; 1: every head the whole context), read by ``ops.decode.head_kernel`` from one pool of fixed-size pages
(``--page-tokens`` full-width tokens a page), under each combination of ``--pages-per-step``, ``--warps``,
``--stages`` and ``--splits`` (programs sharing a head's pages; 0: the default, ``default_splits`` of the slots, or
with ``--launches live`` or ``step`` ``live_work``'s from the heads that store tokens; ``step`` builds that list once
outside the timed call, as the engine's step does for all its layers). ``--live``: only
that many sequences hold tokens, the rest of the batch none (a lightly loaded engine's slots). Beside them
(``--per-sequence``) the engine's per-sequence kernel (``ops.decode.kernel``, its balanced schedule) over the whole
context: the same bytes as keep 1. Every row: CUPTI time, the floor (the K and V bytes the heads store over the
measured copy bandwidth), their ratio, and the relative error against ``head_paging.decode_attention`` (float32).
``--weights`` times each one-launch row twice more with the decode share of the full-history eviction sums:
``weights=True`` (the weights whole, over the context's slots as the engine asks: ``slots``) and ``sums`` (the
engine's: the weights added into per-slot sums by ``sums_kernel.add_weights``; the bench's sums are not donated, so
XLA copies them first: the kernel breakdown in the JSON separates it). ``--interpret --timer host --shape
2x256`` runs the rows on a CPU (plumbing only). Table: bench/results/eviction.md "Per-head pages: decode kernel"."""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.files import write_json
from bench.harness import (
    D,
    PagedCase,
    copies_for,
    copy_bandwidth,
    count_arg,
    log,
    log_row,
    pick_layer,
    print_table,
    rank_plan,
    rates_arg,
    rel_err,
    shape_arg,
)
from kvjax import validate
from kvjax.ops import head_paging
from kvjax.ops.decode.config import DECODE
from kvjax.ops.decode.head_kernel import NUM_STAGES, PAGES_PER_STEP, head_paged_decode, live_work
from kvjax.runtime.head_pages import HeadPages


def shares(layout, batch: int, context: int, keep: float, seed: int = 0):
    """Slots [batch, Hkv] each head stores: a mean share ``keep`` of ``context`` (drawn from [keep / 2, 1.5 keep],
    at most all of it; every head all of it at ``keep`` 1), at least one."""
    rng = np.random.default_rng(seed)
    share = rng.uniform(keep / 2, min(1.0, 1.5 * keep), (batch, layout.num_kv_heads)) if keep < 1 else 1.0
    return np.maximum(1, (np.broadcast_to(share, (batch, layout.num_kv_heads)) * context).astype(np.int64))


def head_tables(per, stored, context: int):
    """(tables [batch, Hkv, pages], pages used): each head's pages for its ``stored`` slots, ``per`` [1, Hkv] slots a
    page, from one ``HeadPages`` pool whose page 0 stays free."""
    need = int((-(-stored // per)).sum())
    pages = HeadPages(need + 1, per, int(-(-context // per.min())))
    for b in range(stored.shape[0]):
        assert pages.grow(b, stored[b][None]) is not None
    return np.stack([pages.table(b)[0] for b in range(stored.shape[0])]), need


def case(layout, batch: int, context: int, keep: float, page_tokens: int, seed: int = 0, live: int | None = None):
    """(q, pool, tables, stored, bytes stored) for ``batch`` sequences whose heads store their own shares; only the
    first ``live`` of them (default all) hold tokens, the others none (an idle slot)."""
    page_elems = page_tokens * 2 * D
    stored = shares(layout, batch, context, keep, seed)
    live = batch if live is None else live
    tables, need = head_tables(head_paging.layer_tokens_per_page(layout, page_elems)[None], stored, context)
    stored[live:] = 0
    key = jax.random.key(seed)
    pool = harness.randn(key, (need + 1, page_elems))
    q = harness.randn(jax.random.fold_in(key, 1), (batch, layout.q_cols))
    widths = np.add(layout.k_widths, layout.v_widths)
    return q, pool, jnp.asarray(tables), jnp.asarray(stored, jnp.int32), int((stored * widths).sum()) * 2, page_elems


def row(rate, keep, batch, context, seconds, floor, err, **knobs) -> dict:
    out = dict(rate=rate, keep=keep, batch=batch, context=context, **knobs)
    out |= dict(us=1e6 * seconds, floor_us=1e6 * floor, pct_of_floor=100 * floor / seconds, rel_err=err)
    log_row(out)
    return out


def per_sequence(layout, rate, batch, context, bandwidth) -> dict:
    """The engine's per-sequence kernel (its own pages: a page holds every head of ``page_size`` tokens) over
    ``batch`` sequences of ``context`` tokens: the bytes of keep 1."""
    from bench.decode import kvjax_decode_call, schedule_of

    lengths = np.full(batch, context)
    nbytes = int(lengths.sum()) * (layout.k_cols + layout.v_cols) * 2
    paged = PagedCase(layout, batch, lengths, 16, copies_for(nbytes), jax.random.key(2))
    fn, shared, per_call = kvjax_decode_call(paged, schedule_of(paged, DECODE).schedule.layer(0), jax.random.key(3))
    seconds = harness.time_calls(fn, shared, per_call)
    knobs = dict(
        kernel="per-sequence",
        pages_per_step=DECODE.block_tokens // 16,
        warps=DECODE.num_warps,
        stages=DECODE.num_stages,
    )
    return row(rate, 1.0, batch, context, seconds, nbytes / bandwidth, float("nan"), **knobs)


def kernel_us(run, *args) -> dict[str, float]:
    """Microseconds each kernel of one ``run(*args)`` took (CUPTI), summed by name."""
    per: dict[str, float] = {}
    for name, ms in harness.cupti_kernels(lambda: jax.block_until_ready(run(*args))):
        per[name] = per.get(name, 0.0) + ms * 1e3
    harness.log(f"  kernels (us): {per}")
    return {name: round(us, 2) for name, us in per.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_arg("--shape"), default=(32, 8192))
    p.add_argument("--rates", type=rates_arg(), default=[0.0, 0.5], help="comma-separated (default 0,0.5)")
    p.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--page-tokens", type=count_arg("--page-tokens"), default=16)
    p.add_argument("--pages-per-step", type=count_arg("--pages-per-step"), nargs="+", default=[PAGES_PER_STEP])
    p.add_argument("--warps", type=count_arg("--warps"), nargs="+", default=[4])
    p.add_argument("--stages", type=count_arg("--stages"), nargs="+", default=[NUM_STAGES])
    p.add_argument(
        "--launches",
        nargs="+",
        choices=("pair", "one", "live", "step"),
        default=["pair", "one"],
        help="a launch per (K, V) width pair, one for all over every slot, one over the live heads (schedule='live', "
        "its work list built by each call), the same with the work list built once a step outside the call (as the "
        "engine does); default pair and one",
    )
    p.add_argument(
        "--splits",
        type=validate.arg(lambda v: validate.integer("--splits", v, low=0), int),
        nargs="+",
        default=[0],
        help="programs a head's pages are split over (0: the default)",
    )
    p.add_argument("--live", type=count_arg("--live"), help="sequences holding tokens, the rest empty (default all)")
    p.add_argument("--per-sequence", action="store_true", help="time the per-sequence kernel beside (GPU only)")
    p.add_argument(
        "--weights",
        action="store_true",
        help="each one-launch row twice more: with weights=True (the decode share of the full-history eviction sums: "
        "the scores stored per slot and the epilogue that makes them weights) and with sums (the engine's: the weights "
        "added into per-slot sums by a kernel), beside the row without",
    )
    harness.timer_option(p)
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    harness.TIMER["name"] = args.timer
    batch, context = args.shape
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows: list[dict] = []
    kernels: list[dict] = []  # the weights rows' kernels, one by one (CUPTI)
    for rate in args.rates:
        layout = pick_layer(rank_plan(rate), rate)
        for keep in args.keep:
            q, pool, tables, stored, nbytes, page_elems = case(
                layout, batch, context, keep, args.page_tokens, live=args.live
            )
            live = slice(0, args.live)
            want = head_paging.decode_attention(
                q.astype(jnp.float32), pool.astype(jnp.float32), tables, stored, layout, page_elems, context
            )
            weighs = (False, True, "sums") if args.weights else (False,)
            sums = jnp.zeros((batch, layout.num_kv_heads, context), jnp.float32)
            combos = itertools.product(args.launches, args.pages_per_step, args.warps, args.stages, args.splits, weighs)
            for launches, step, warps, stages, splits, weights in combos:
                if weights and launches == "pair":
                    continue  # the weights come from the one launch only
                knobs = dict(pages_per_step=step, num_warps=warps, num_stages=stages, one_launch=launches != "pair")
                knobs |= dict(splits=splits or None, schedule="slots" if launches in ("pair", "one") else "live")
                knobs |= dict(weights=weights is True, slots=context if weights is True else None)  # the engine's
                knobs |= dict(sums=sums) if weights == "sums" else {}  # its sums: one per slot of max_seq_len
                if launches == "step" and splits:
                    raise SystemExit("--launches step builds live_work's own splits: give --splits 0")
                # "step": the work list built once a step from the live slots, outside the timed call (the engine's)
                work = live_work(stored) if launches == "step" else None

                def run(pool, tables, stored, work, q, layout=layout, page_elems=page_elems, knobs=knobs):
                    return head_paged_decode(
                        q, pool, tables, stored, layout, page_elems, **knobs, work=work, interpret=args.interpret
                    )

                got = run(pool, tables, stored, work, q)
                got = got[0] if weights else got
                seconds = harness.time_calls(run, (pool, tables, stored, work), [(q,)])
                label = dict(kernel=f"per-head ({launches})", pages_per_step=step, warps=warps, stages=stages)
                label |= dict(splits=splits or "default", live=args.live or batch, weights=weights)
                err = rel_err(got[live], want[live])
                rows.append(row(rate, keep, batch, context, seconds, nbytes / bandwidth, err, **label))
                if weights and harness.TIMER["name"] == "cupti":  # where the weights' time goes, kernel by kernel
                    kernels.append(dict(rate=rate, keep=keep, us=kernel_us(run, pool, tables, stored, work, q)))
        if args.per_sequence:
            rows.append(per_sequence(layout, rate, batch, context, bandwidth))
    print_table(rows)
    if args.json:
        write_json(args.json, {"args": vars(args), "bandwidth": bandwidth, "rows": rows, "kernels": kernels}, indent=1)


if __name__ == "__main__":
    main()
