"""Decode over per-head pages (issue 37: "decode over ragged per-head lengths at % of copy bandwidth on bytes read"):
one layer of the random Llama-3.1-8B attention shape (32 query heads, 8 KV heads of 128) at ``--shape`` (default
B32 x 8K), per rank rate (``harness.rank_plan``'s representative layer), each KV head storing its own share of the
context (``--keep``: the mean share; each head draws its own from [keep/2, min(1, 3 keep/2)], as eviction leaves
them), read by ``ops.decode.head_kernel`` from one pool of fixed-size pages (``--page-tokens`` full-width tokens a
page). Every row: CUPTI time, the floor (the K and V bytes the heads store over the measured copy bandwidth), their
ratio, and the relative error against ``head_paging.decode_attention`` (float32). ``--interpret --timer host --shape
2x256`` runs the rows on a CPU (plumbing only). Table: bench/RESULTS.md "Per-head pages: decode kernel"."""

from __future__ import annotations

import argparse

import harness
import jax
import jax.numpy as jnp
import numpy as np
from files import write_json
from harness import D, copy_bandwidth, log, pick_layer, rank_plan, rates_arg, rel_err, shape_arg

from kvjax.ops import head_paging
from kvjax.ops.decode.head_kernel import head_paged_decode
from kvjax.runtime.head_pages import HeadPages


def case(layout, batch: int, context: int, keep: float, page_tokens: int, seed: int = 0):
    """(q, pool, tables, stored, bytes stored) for ``batch`` sequences whose heads store their own shares."""
    rng = np.random.default_rng(seed)
    page_elems = page_tokens * 2 * D
    share = rng.uniform(keep / 2, min(1.0, 1.5 * keep), (batch, layout.num_kv_heads))
    stored = np.maximum(1, (share * context).astype(np.int64))
    per = head_paging.layer_tokens_per_page(layout, page_elems)[None]
    need = int((-(-stored // per)).sum())
    pages = HeadPages(need + 1, per, int(-(-context // per.min())))
    for b in range(batch):
        assert pages.grow(b, stored[b][None]) is not None
    tables = jnp.asarray(np.stack([pages.table(b)[0] for b in range(batch)]))
    key = jax.random.key(seed)
    pool = harness.randn(key, (need + 1, page_elems))
    q = harness.randn(jax.random.fold_in(key, 1), (batch, layout.q_cols))
    widths = np.add(layout.k_widths, layout.v_widths)
    return q, pool, tables, jnp.asarray(stored, jnp.int32), int((stored * widths).sum()) * 2, page_elems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=shape_arg("--shape"), default=(32, 8192))
    p.add_argument("--rates", type=rates_arg(), default=[0.0, 0.5], help="comma-separated (default 0,0.5)")
    p.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--timer", choices=("cupti", "host"), default="cupti")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    harness.TIMER["name"] = args.timer
    batch, context = args.shape
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for rate in args.rates:
        layout = pick_layer(rank_plan(rate), rate)
        for keep in args.keep:
            q, pool, tables, stored, nbytes, page_elems = case(layout, batch, context, keep, args.page_tokens)

            def run(pool, tables, stored, q, layout=layout, page_elems=page_elems):
                return head_paged_decode(q, pool, tables, stored, layout, page_elems, interpret=args.interpret)

            got = run(pool, tables, stored, q)
            want = head_paging.decode_attention(
                q.astype(jnp.float32), pool.astype(jnp.float32), tables, stored, layout, page_elems, context
            )
            seconds = harness.time_calls(run, (pool, tables, stored), [(q,)])
            floor = nbytes / bandwidth
            rows.append(
                {
                    "rate": rate,
                    "keep": keep,
                    "batch": batch,
                    "context": context,
                    "us": 1e6 * seconds,
                    "floor_us": 1e6 * floor,
                    "pct_of_floor": 100 * floor / seconds,
                    "rel_err": rel_err(got, want),
                }
            )
            log(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    if args.json:
        write_json(args.json, {"args": vars(args), "bandwidth": bandwidth, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
