"""What eviction after prefill costs on the device (issue 37: "compaction time per evicted GiB", "metrics under 5% of
TTFT"), on the random Llama-3.1-8B shape (32 layers, 8 KV heads of 128; rate > 0: ``harness.rank_plan``'s widths).

Four parts, each a table:

- **compaction**: ``--batch`` sequences of ``--context`` tokens in per-head pages (``runtime.head_pages``, pages of
  16 full-width tokens), random scores, KV-Compress's global selection at each ``--ratios`` on the device
  (``eviction.select.device_keep``, CUPTI), then ``ops.head_paging.compact`` with the pool donated (host timer over
  repeated calls: each moves a GiB or more); on a GPU also ``ops.head_compact.compact`` (the Pallas copy,
  "kernel"). Beside it: the bytes evicted, seconds per evicted GiB, the floor (the sequences' pages read and written
  once over the copy bandwidth), and XLA's memory analysis of the compiled call:
  the bytes its output aliases (the whole pool: written in place, never copied) and its scratch (the sequences'
  pages, gathered once).
- **metrics**: each method's scores (``eviction.metrics.scores``) for one prompt of ``--context`` tokens, one
  representative layer (``harness.pick_layer``) timed with CUPTI and multiplied by 32 layers: a separate pass over
  the prompt's q and k, as ``eviction.reference`` runs it; on a GPU the full-history methods twice, through
  ``ops.attention_mass`` ("kernel") and the jnp form ("jnp").
- **continual**: continual eviction of one decoding sequence of ``--context`` tokens (``eviction.continual.compress``:
  each head halved, scored by 8 random queries a layer, compacted in place with the pool donated; host timer): what
  one cut costs the step it runs before, beside the pages it frees.
- **ttft**: the time to first token of one ``--context``-token prompt through the runner (``--chunk`` tokens a
  prefill step, host timer, second pass), and each method's metric, selection and compaction as a share of it.
- **engine**: the same TTFT through an engine that evicts each prompt by ``--engine-ratio`` with each method
  (``EngineConfig.eviction``: the windowed methods scored by the last chunk's queries, the full-history ones
  accumulated over every chunk, ``eviction.prompt.accumulate``), beside the plain engine's: what eviction adds to
  the time to first token as the engine runs it.

Table: bench/results/eviction.md "Eviction: device cost". ``--timer host --context 256 --batch 1 --no-ttft`` runs on a
CPU (plumbing only)."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.files import write_json
from bench.harness import HKV, D, copy_bandwidth, count_arg, log, log_row, pick_layer, print_table, rank_plan, rates_arg
from kvjax.eviction import Eviction, continual, metrics
from kvjax.eviction.select import device_keep
from kvjax.ops import head_compact, head_paging, quant_head_paging
from kvjax.ops.quant import GROUP  # quantized per-head pages' group: the engine's page size with kv_bits
from kvjax.runtime.head_pages import HeadPages

PAGE_ELEMS = 16 * 2 * D  # 16 full-width tokens
LAYERS = 32


def _host_seconds(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` (which blocks), after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _filled(rate: float, batch: int, context: int) -> dict:
    """``batch`` sequences of ``context`` tokens in per-head pages of the rate's layouts: pool, tables, stored,
    layouts, widths [L, Hkv] and one sequence's page bytes."""
    layouts = tuple(rank_plan(rate, LAYERS))
    per = np.stack([head_paging.layer_tokens_per_page(lay, PAGE_ELEMS) for lay in layouts])
    max_pages = int(-(-context // per.min()))
    need = batch * int((-(-context // per)).sum())
    pages = HeadPages(need + 1, per, max_pages)
    for b in range(batch):
        assert pages.grow(b, context) is not None
    tables = jnp.asarray(np.stack([pages.table(b) for b in range(batch)]))
    stored = jnp.asarray(np.stack([pages.stored(b) for b in range(batch)]), jnp.int32)
    widths = np.array([np.add(lay.k_widths, lay.v_widths) for lay in layouts])  # [L, Hkv]
    seq_bytes = int((-(-context // per) * PAGE_ELEMS).sum()) * 2  # a sequence's pages, bf16
    pool = harness.randn(jax.random.key(0), (need + 1, PAGE_ELEMS))
    return dict(pool=pool, tables=tables, stored=stored, layouts=layouts, widths=widths, seq_bytes=seq_bytes)


def compaction_rows(rate: float, batch: int, context: int, ratios: list[float], bandwidth: float) -> list[dict]:
    filled = _filled(rate, batch, context)
    pool, widths, seq_bytes = filled.pop("pool"), filled.pop("widths"), filled.pop("seq_bytes")
    case = dict(rate=rate, batch=batch, context=context, **filled)
    rows = []
    for form in ("jnp", "kernel") if jax.default_backend() == "gpu" else ("jnp",):
        for ratio in ratios:
            row, pool = _compaction_row(pool, ratio, widths, seq_bytes, bandwidth, form=form, **case)
            rows.append(row)
    return rows


def _filled_groups(rate: float, context: int, group: int, bits: int) -> dict:
    """``_filled`` on quantized per-head pages (``ops.quant_head_paging``): one sequence of ``context`` tokens, each
    head's full groups random values encoded on its pages, its partial group in its layer's tail: pool, tails,
    tables, stored, layouts, page_bytes and the sequence's stored bytes."""
    layouts = tuple(rank_plan(rate, LAYERS))
    page_bytes = quant_head_paging.pool_page_bytes(layouts, group, bits)
    per = np.stack([quant_head_paging.layer_tokens_per_page(lay, page_bytes, group, bits) for lay in layouts])
    need = int((-(-context // per)).sum())
    pages = HeadPages(need + 1, per, int(-(-context // per.min())))
    assert pages.grow(0, context) is not None
    tables = np.stack([pages.table(0)])  # [1, L, Hkv, pages]
    pool = jnp.zeros((need + 1, page_bytes), jnp.uint8)
    key, full, seq_bytes = jax.random.key(0), context // group, 0
    grp = np.arange(full)
    for layer, lay in enumerate(layouts):
        for h, (kw, vw) in enumerate(zip(lay.k_widths, lay.v_widths)):
            fmt = quant_head_paging.head_format(kw, vw, group, bits)
            gpp = quant_head_paging.groups_per_page(page_bytes, kw, vw, group, bits)
            k = harness.randn(jax.random.fold_in(key, 2 * (layer * HKV + h)), (full, group, kw), jnp.float32)
            v = harness.randn(jax.random.fold_in(key, 2 * (layer * HKV + h) + 1), (full, group, vw), jnp.float32)
            index = (grp % gpp)[:, None] * fmt.page_bytes + np.arange(fmt.page_bytes)  # [groups, bytes]
            at = np.broadcast_to(tables[0, layer, h, grp // gpp][:, None], index.shape)
            pool = pool.at[jnp.asarray(at), jnp.asarray(index)].set(fmt.encode(k, v))
            seq_bytes += full * fmt.page_bytes
    tails = [harness.randn(jax.random.fold_in(key, 10**6 + i), (1, group, lay.k_cols + lay.v_cols)) for i, lay in
             enumerate(layouts)]  # fmt: skip
    stored = jnp.full((1, LAYERS, HKV), context, jnp.int32)
    return dict(pool=pool, tails=tails, tables=jnp.asarray(tables), stored=stored, layouts=layouts,
                page_bytes=page_bytes, seq_bytes=seq_bytes)  # fmt: skip


def continual_rows(rate: float, context: int, bandwidth: float, bits: int | None = None) -> list[dict]:
    """One decoding sequence cut by continual eviction: every head halved (``continual.halved`` of KV-Compress at
    4x), 8 random queries a layer, the pool donated; host timer, median of 5 after a compiling call. ``bits``: on
    quantized per-head pages of that code width, cut by whole groups of 32 (``continual.compress_groups``; the floor
    its pages' bytes read and written)."""
    spec = Eviction("kvcompress", ratio=4.0)
    if bits is None:
        f = _filled(rate, 1, context)
        target = jnp.asarray(continual.halved(spec, np.asarray(f["stored"]), context), jnp.int32)

        def compress(pool, queries):
            args = (f["tables"], f["stored"], target, f["layouts"], PAGE_ELEMS, context)
            return continual.compress(spec, queries, pool, *args)[:2]

        freed_of = f["widths"] * 2
    else:
        f = _filled_groups(rate, context, GROUP, bits)
        target = continual.halved(spec, np.asarray(f["stored"]), context, group=GROUP)
        target = jnp.asarray(target, jnp.int32)

        def compress(pool, queries):
            args = (f["tables"], f["stored"], target, f["layouts"], f["page_bytes"], GROUP, bits, context)
            return continual.compress_groups(spec, queries, pool, f["tails"], *args)[:2]

        freed_of = np.array([[quant_head_paging.head_format(k, v, GROUP, bits).page_bytes / GROUP
                              for k, v in zip(lay.k_widths, lay.v_widths)] for lay in f["layouts"]])  # fmt: skip
    keys = jax.random.split(jax.random.key(1), LAYERS)
    queries = [harness.randn(k, (1, spec.window, lay.q_cols)) for k, lay in zip(keys, f["layouts"])]
    run = jax.jit(compress, donate_argnums=0)
    state = {"pool": f["pool"]}

    def call():
        state["pool"], kept = run(state["pool"], queries)
        return jax.block_until_ready(kept)

    kept = np.asarray(call())
    seconds = _host_seconds(call)
    freed = float(((np.asarray(f["stored"]) - kept)[0] * freed_of).sum())
    floor = 2 * f["seq_bytes"] / bandwidth
    row = dict(rate=rate, kv_bits=bits or "-", context=context)
    row |= dict(kept_share=float(kept.sum() / np.asarray(f["stored"]).sum()))
    row |= dict(compress_ms=1e3 * seconds, floor_ms=1e3 * floor, pct_of_floor=100 * floor / seconds)
    row |= dict(freed_gib=freed / 2**30, ms_per_freed_gib=1e3 * seconds / (freed / 2**30))
    log_row(row)
    return [row]


def _compaction_row(pool, ratio, widths, seq_bytes, bandwidth, *, form, rate, batch, context, tables, stored, layouts):
    """One ratio's row, and the pool (donated to each call) after it; ``form``: ``head_paging.compact`` ("jnp") or
    ``head_compact.compact`` ("kernel")."""
    spec = Eviction("kvcompress", ratio=ratio)
    scores = jax.random.uniform(jax.random.key(int(ratio * 100)), (batch, LAYERS, HKV, context))
    prompts = np.full(batch, context)
    per_head, protect = spec.sizes(prompts)

    def select(scores):
        return device_keep(spec, scores, prompts, per_head, protect, (None,) * LAYERS)

    select_s = harness.time_calls(select, (), [(scores,)])
    keep = jax.jit(select)(scores)
    run = jax.jit(
        head_paging.compact if form == "jnp" else head_compact.compact, static_argnums=(4, 5), donate_argnums=0
    )
    state = {"pool": pool}

    def compact():
        state["pool"], kept = run(state["pool"], tables, keep, stored, layouts, PAGE_ELEMS)
        return jax.block_until_ready(kept)

    kept = np.asarray(compact())
    seconds = _host_seconds(compact)
    memory = run.lower(state["pool"], tables, keep, stored, layouts, PAGE_ELEMS).compile().memory_analysis()
    evicted = int(((context - kept) * widths[None]).sum()) * 2
    floor = 2 * batch * seq_bytes / bandwidth
    row = dict(
        rate=rate,
        batch=batch,
        context=context,
        ratio=ratio,
        form=form,
        select_ms=1e3 * select_s,
        compact_ms=1e3 * seconds,
        floor_ms=1e3 * floor,
        pct_of_floor=100 * floor / seconds,
        evicted_gib=evicted / 2**30,
        ms_per_evicted_gib=1e3 * seconds / (evicted / 2**30),
        pages_gib=batch * seq_bytes / 2**30,
        pool_gib=state["pool"].nbytes / 2**30,
        aliased_gib=float("nan") if memory is None else memory.alias_size_in_bytes / 2**30,
        temp_gib=float("nan") if memory is None else memory.temp_size_in_bytes / 2**30,
    )
    log_row(row)
    return row, state["pool"]


def metric_rows(rate: float, context: int, methods: list[str]) -> list[dict]:
    layout = pick_layer(rank_plan(rate, LAYERS), rate)
    key = jax.random.key(1)
    q = harness.randn(key, (1, context, layout.q_cols))
    k = harness.randn(jax.random.fold_in(key, 1), (1, context, layout.k_cols))
    on_gpu = jax.default_backend() == "gpu"
    rows = []
    for method in methods:
        forms = ("kernel", "jnp") if method in metrics.ON_KERNEL and on_gpu else ("jnp",)
        for form in forms:

            def score(k, q, method=method, form=form):
                return metrics.scores(method, q, k, layout, kernel=form == "kernel")

            seconds = harness.time_calls(score, (k,), [(q,)])
            rows.append(
                dict(
                    rate=rate,
                    context=context,
                    method=method,
                    form=form,
                    layer_ms=1e3 * seconds,
                    model_ms=LAYERS * 1e3 * seconds,
                )
            )
            log_row(rows[-1])
    return rows


def ttft_seconds(model, context: int, chunk: int, eviction: str | None = None) -> float:
    """Seconds from a prompt's arrival to its first token through an engine of ``model``, one new prompt alone,
    median of the second and third passes (the first compiles); ``eviction``: an engine that evicts each prompt so."""
    from kvjax.runtime.engine import Engine
    from kvjax.runtime.runner import Runner
    from kvjax.runtime.scheduler import Request

    # no prefix caching: a repeated prompt would find its pages cached and skip the prefill this measures (and a
    # new prompt each pass as well); an evicting engine never shares prefixes
    settings = dict(max_batch=1, max_seq_len=context + 16, chunk_tokens=chunk)
    engine = Engine(model, **settings, **(dict(eviction=eviction) if eviction else dict(prefix_caching=False)))
    runner = Runner(engine)
    rng = np.random.default_rng(1)
    times = []
    for _ in range(3):
        runner.add(Request(rng.integers(0, model.config.vocab_size, context).tolist(), 1))
        t0 = time.perf_counter()
        list(runner.run())
        times.append(time.perf_counter() - t0)
    del engine, runner
    return float(np.median(times[1:]))


def engine_row(rate: float, model, context: int, chunk: int, plain: float, method: str, ratio: float) -> dict:
    """The TTFT of an engine of ``model`` (the rate's) evicting with ``method`` at ``ratio``, one prompt of
    ``context`` tokens (``ttft_seconds``), beside the plain engine's ``plain`` seconds."""
    spec = f"{method}:{ratio:g}x"
    ttft = ttft_seconds(model, context, chunk, eviction=spec)
    row = dict(
        rate=rate,
        context=context,
        eviction=spec,
        plain_ttft_ms=1e3 * plain,
        ttft_ms=1e3 * ttft,
        added_pct=100 * (ttft - plain) / plain,
    )
    log_row(row)
    return row


def ttft_rows(rate: float, context: int, ttft: float, out: dict) -> list[dict]:
    """Each method's metric, selection and compaction (one sequence) as a share of the measured TTFT ``ttft``
    (seconds)."""
    # the library's default compaction (jnp) of one sequence
    one = {r["ratio"]: r for r in out["compaction"] if r["rate"] == rate and r["batch"] == 1 and r["form"] == "jnp"}
    rows = []
    for m in (r for r in out["metrics"] if r["rate"] == rate):
        for ratio, c in one.items():
            cost = m["model_ms"] + c["select_ms"] + c["compact_ms"]
            rows.append(
                dict(
                    rate=rate,
                    context=context,
                    method=m["method"],
                    form=m["form"],
                    ratio=ratio,
                    ttft_ms=1e3 * ttft,
                    eviction_ms=cost,
                    pct_of_ttft=100 * cost / (1e3 * ttft),
                )
            )
    return rows


def device_tables(args, parts: set, bandwidth: float, out: dict, save) -> None:
    """The compaction, continual and metrics tables of ``parts`` (no model), each row saved as it comes."""
    for rate in args.rates:
        if "compaction" in parts:
            for batch in args.batch:
                out["compaction"] += compaction_rows(rate, batch, args.context, args.ratios, bandwidth)
                save()
        if "continual" in parts:
            for bits in args.continual_bits:
                out["continual"] += continual_rows(rate, args.context, bandwidth, None if bits == "none" else int(bits))
                save()
        if "metrics" in parts:
            out["metrics"] += metric_rows(rate, args.context, args.methods)
            save()


def model_tables(args, parts: set, out: dict, save) -> None:
    """The TTFT and engine tables of ``parts``: one 8B model and one plain TTFT a rate serve both."""
    if not parts & {"ttft", "engine"}:
        return
    from bench.engine import model_at

    for rate in args.rates:
        model = model_at(rate)
        plain = ttft_seconds(model, args.context, args.chunk)
        if "ttft" in parts:
            out["ttft"] += ttft_rows(rate, args.context, plain, out)
            save()
        if "engine" in parts:
            for method in args.methods:  # saved a method at a time: each builds and compiles an engine
                out["engine"].append(
                    engine_row(rate, model, args.context, args.chunk, plain, method, args.engine_ratio)
                )
                save()
        del model


PARTS = ("compaction", "continual", "metrics", "ttft", "engine")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=rates_arg(), default=[0.0, 0.5], help="comma-separated (default 0,0.5)")
    p.add_argument("--context", type=count_arg("--context"), default=8192)
    p.add_argument("--batch", type=count_arg("--batch"), nargs="+", default=[1, 4])
    p.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--methods", nargs="+", choices=metrics.METHODS, default=list(metrics.METHODS))
    p.add_argument("--chunk", type=count_arg("--chunk"), default=2048, help="prefill tokens a step for the TTFT")
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT and engine rows (they build the 8B model)")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="which tables to run (default all; the TTFT table's shares need the compaction and metrics tables)",
    )
    p.add_argument("--engine-ratio", type=float, default=4.0, help="the engine rows' eviction ratio (default 4)")
    p.add_argument(
        "--continual-bits",
        nargs="+",
        choices=("none", "4", "2"),
        default=["none"],
        help="the continual table's pages: none (bf16) and/or 4 or 2 bits, cut by whole groups of 32 (default none)",
    )
    harness.timer_option(p)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not all(r >= 1 for r in [*args.ratios, args.engine_ratio]):  # NaN too
        p.error("--ratios and --engine-ratio must be at least 1")
    harness.TIMER["name"] = args.timer
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out: dict = {"args": vars(args), "bandwidth": bandwidth, "compaction": [], "continual": [], "metrics": []}
    out["ttft"], out["engine"] = [], []

    def save():
        if args.json:
            write_json(args.json, out, indent=1)

    parts = set(args.parts) - ({"ttft", "engine"} if args.no_ttft else set())
    device_tables(args, parts, bandwidth, out, save)
    model_tables(args, parts, out, save)
    for name in ("compaction", "continual", "metrics", "ttft", "engine"):
        if out[name]:
            print(f"\n{name}")
            print_table(out[name])
    save()


if __name__ == "__main__":
    main()
