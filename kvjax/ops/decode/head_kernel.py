"""Decode attention over per-head pages (``kvjax.ops.head_paging``; issue 37, item 2; Pallas, Triton lowering): one
new query per sequence against each KV head's own stored tokens, whose count eviction may have made different for
every head. ``head_paged_decode`` equals ``head_paging.decode_attention``.

One program per (sequence, KV head, split) walks its share of the head's pages through the head's block table; the
splits' partial softmaxes are merged in jnp. ``schedule="live"``, the engine's default, gives the programs to the
heads that store tokens (``live_work``, built once a step): bench/results/eviction.md "The live schedule".

Constraints: q packed [B, q_cols]; at most 16 queries a KV head; widths multiples of 16; the pool is indexed by
(page, element), any size. A sliding-window layer's heads say which of their slots the window still sees (``first``:
a slot is not a position once a head has evicted, so it is counted from the eviction, ``head_paging.window_first``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.item_merge import MAX_SPLITS, check_merge, merge_heads
from kvjax.ops.decode.sums_kernel import add_weights, weights_of
from kvjax.ops.head_paging import tokens_per_page
from kvjax.ops.pallas_util import (
    LOG2E,
    MASK,
    NOWHERE,
    by_width_pair,
    dot_precision,
    load_rows,
    log_sum,
    merge_splits,
    online_update,
    store_rows,
    whole_block,
    width_pairs,
)
from kvjax.ops.tiles import tile

BLOCK_H = ROWS  # query rows a program: a GQA group (G <= 16) padded to the tensor cores' smallest M


def _attend_head(
    refs,
    head_split,
    head,
    q_base,
    out_stride,
    item,
    active,
    *,
    kw,
    vw,
    per,
    pages_per_step,
    page_elems,
    pages,
    group,
    scale,
    interpret,
    cap=0,
):
    """One program's work on KV head row ``head`` (of the stored counts and tables) for its split (``head_split``:
    the program's split and the number of splits, read outside any branch, where interpret mode can): the group's
    queries from ``q_base`` (rows ``kw`` apart), the head's share of its pages from the one holding its first seen
    slot, its partial softmax stored as work item ``item`` (rows ``out_stride`` wide); an inactive program stores an
    empty one (zeros, no weight). With a weights output (``refs``' last, ``cap`` slots a head): each seen slot's
    scores (log2 units), which ``sums_kernel.weights_of`` turns into softmax weights once the splits' denominators
    are known."""
    stored_ref, first_ref, table_ref, q_ref, pool_ref, acc_ref, m_ref, l_ref, *w_ref = refs
    split, splits = head_split
    t = jnp.arange(max(16, tile(per * pages_per_step)))
    in_page, nth = t % per, t // per  # each row's token in its page, and which of the step's pages
    kc, vc = jnp.arange(tile(kw)), jnp.arange(tile(vw))
    kc_ok, vc_ok = (kc < kw)[None, :], (vc < vw)[None, :]
    rows = jnp.arange(BLOCK_H)
    real = rows < group
    dt = jnp.dtype(q_ref.dtype)
    precision = dot_precision(dt)
    q = load_rows(q_ref, rows, kw, q_base, kc[None, :], kc_ok, real).astype(jnp.float32)
    q = (q * (scale * LOG2E)).astype(dt)
    stored = jnp.where(active, stored_ref[head], 0)
    seen_from = jnp.where(active, first_ref[head], 0)  # slots before it are out of the layer's window
    lo = seen_from // per  # the head's first page with a seen slot
    n_pages = jnp.maximum((stored + per - 1) // per - lo, 0)
    steps = (n_pages + pages_per_step - 1) // pages_per_step
    chunk = (steps + splits - 1) // splits  # this split's share of the head's steps

    def page_step(i, carry):
        page = lo + i * pages_per_step + nth
        slot = page * per + in_page
        ok = (nth < pages_per_step) & (slot < stored) & (slot >= seen_from)
        at = jnp.where(ok, head * pages + page, head * pages)  # a row past the head's pages reads its first entry
        page_of = plgpu.load(table_ref.at[at])[:, None]
        k = _load_page_rows(pool_ref, page_of, in_page, kw, 0, kc[None, :], kc_ok, ok).astype(dt)
        v = _load_page_rows(pool_ref, page_of, in_page, vw, per * kw, vc[None, :], vc_ok, ok).astype(dt)
        s = plgpu.dot(q, k, trans_b=True, precision=precision)
        if w_ref:  # the scores [rows, slots] at (head, row, slot), each row's slots contiguous as the tile's are
            mask = (ok & (slot < cap))[None, :] & real[:, None]  # 4 bytes a row a slot beside the K and V read
            index = (head * group + rows[:, None]) * cap + slot[None, :]
            plgpu.store(w_ref[0].at[jnp.where(mask, index, NOWHERE) if interpret else index], s, mask=mask)
        return online_update(carry, jnp.where(ok[None, :], s, MASK), v, None, precision)

    carry = (jnp.zeros((BLOCK_H, vc.shape[0]), jnp.float32), jnp.full((BLOCK_H,), MASK), jnp.zeros((BLOCK_H,)))
    first = split * chunk
    acc, m, l = lax.fori_loop(first, jnp.minimum(first + chunk, steps), page_step, carry)
    part = item * group + rows  # this split's rows of the partial results
    store_rows(acc_ref, part, out_stride, 0, vc[None, :], acc, vc_ok, real, interpret=interpret)
    at = jnp.where(real, part, NOWHERE) if interpret else part
    plgpu.store(m_ref.at[at], m, mask=real)
    plgpu.store(l_ref.at[at], l, mask=real)


def _load_page_rows(pool_ref, page, rows, stride, offset, cols, cols_ok, rows_ok):
    """``pool[page, rows * stride + offset + cols]`` [R, C] of the 2-D pool, 0 where a mask is false. Indexed by
    (page, element), Pallas computes the address in 64 bits when the pool passes 4 GiB (a flat int32 index of
    ``page * page_elems`` overflowed at 2**31 elements: a per-head pool for B32 x 8K is 17 GB)."""
    index = rows[:, None] * stride + offset + cols
    mask = cols_ok & rows_ok[:, None]
    return plgpu.load(pool_ref.at[jnp.broadcast_to(page, index.shape), index], mask=mask, other=0.0)


def _pair_kernel(stored_ref, first_ref, table_ref, q_ref, pool_ref, *outs, kw, vw, group, **static):
    """One width pair's launch: q holds the pair's heads' query columns, [B, heads, G * kw]."""
    seq, unit, units = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
    head = seq * units + unit
    refs = (stored_ref, first_ref, table_ref, q_ref, pool_ref, *outs)
    split, splits = pl.program_id(2), pl.num_programs(2)
    item = head * splits + split
    _attend_head(refs, (split, splits), head, head * group * kw, vw, item, True, kw=kw, vw=vw, group=group, **static)


def _one_kernel(
    stored_ref,
    first_ref,
    table_ref,
    q_ref,
    pool_ref,
    pair_ref,
    qo_ref,
    *outs,
    pairs,
    q_cols,
    out_stride,
    **static,
):
    """Every width pair in one launch over a grid of (slots, KV heads, splits): each program switches to its head's
    pair (``pair_ref``), reading the packed q [B, q_cols] from the head's column offset (``qo_ref``)."""
    seq, unit, units = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
    head = seq * units + unit
    refs = (stored_ref, first_ref, table_ref, q_ref, pool_ref, *outs)
    q_base = seq * q_cols + qo_ref[unit]
    split, splits = pl.program_id(2), pl.num_programs(2)
    args = (refs, (split, splits), head, q_base, out_stride, head * splits + split, True)
    lax.switch(pair_ref[unit], _branches(pairs, args, static))  # one pair: its branch alone, no switch


def _branches(pairs, args, static) -> list:
    """``_attend_head`` of ``args`` once per (K width, V width, tokens a page, pages a step) in ``pairs``."""
    return [
        functools.partial(_attend_head, *args, kw=kw, vw=vw, per=per, pages_per_step=n, **static)
        for kw, vw, per, n in pairs
    ]


def _live_kernel(
    stored_ref,
    first_ref,
    table_ref,
    q_ref,
    pool_ref,
    pair_ref,
    qo_ref,
    work_ref,
    *outs,
    pairs,
    q_cols,
    units,
    out_stride,
    **static,
):
    """``_one_kernel`` over the live heads (``work_ref``: ``live_work``'s count, splits and heads), a 1-D grid:
    program i does split i % S of live head i // S, switching to the head's pair (``pair_ref``) and reading the
    packed q [B, q_cols] from the head's column offset (``qo_ref``); programs past the live heads store empty items."""
    item, head_split, active, head = live_item(work_ref)
    seq, unit = head // units, head % units
    refs = (stored_ref, first_ref, table_ref, q_ref, pool_ref, *outs)
    q_base = seq * q_cols + qo_ref[unit]
    args = (refs, head_split, head, q_base, out_stride, item, active)
    lax.switch(pair_ref[unit], _branches(pairs, args, static))


def live_item(work_ref):
    """This program's place in ``live_work``'s list (``work_ref``), for a 1-D grid of its items: (its item, (its split,
    the splits), whether it has a live head, the head's flat (sequence, KV head) row: row 0 when it has none)."""
    item = pl.program_id(0)
    live, splits = work_ref[0], work_ref[1]
    nth = item // splits
    active = nth < live
    return item, (item % splits, splits), active, work_ref[2 + jnp.where(active, nth, 0)]


TARGET_PROGRAMS = 264  # twice an H100's or H200's 132 SMs


def default_splits(programs: int, target: int = TARGET_PROGRAMS) -> int:
    """Splits of each head's pages so that a launch has about ``target`` programs (twice an H100's or H200's 132
    SMs), at most 16: a launch has only B x (its heads) programs otherwise."""
    return int(min(MAX_SPLITS, max(1, -(-target // programs))))


def work_items(heads: int) -> int:
    """Programs of the one launch for ``heads`` (sequence, KV head) rows: room for every live head at
    ``live_work``'s splits (fewer than 2 x ``TARGET_PROGRAMS`` items when a head has more than one split, one a head
    otherwise), a multiple of ``MAX_SPLITS`` so that items group by any power-of-two split count."""
    return -(-max(heads, 2 * TARGET_PROGRAMS) // MAX_SPLITS) * MAX_SPLITS


def live_work(live, splits=None, target: int = TARGET_PROGRAMS) -> jax.Array:
    """int32 [2 + 2 x B x Hkv]: the heads that store tokens (a count, live), the splits each gets, the live heads'
    flat rows in order (padded with 0), then each flat row's first work item (-1 where it stores nothing). A head is
    live where ``live`` [B, Hkv] is above 0: a layer's stored counts, or the engine's live slots broadcast over the
    heads, so that one list built per step serves every layer (``head_paged_decode(work=)``). Splits: ``splits`` if
    given, else the smallest power of two (at most 16) giving the live heads about ``target`` programs (at most
    ``TARGET_PROGRAMS``, which ``work_items`` makes room for), computed on the device, so the compiled step serves any
    load."""
    target = validate.integer("target", target, low=1, high=TARGET_PROGRAMS)
    flat = live.reshape(-1) > 0
    count = flat.sum().astype(jnp.int32)
    if splits is None:
        want = -(-target // jnp.maximum(count, 1))
        options = 2 ** jnp.arange(MAX_SPLITS.bit_length(), dtype=jnp.int32)  # 1, 2, 4, ..., 16
        s = jnp.min(jnp.where((options >= want) | (options == MAX_SPLITS), options, MAX_SPLITS)).astype(jnp.int32)
    else:
        s = jnp.int32(splits)
    (rows,) = jnp.nonzero(flat, size=flat.shape[0], fill_value=0)
    first = jnp.where(flat, (jnp.cumsum(flat, dtype=jnp.int32) - 1) * s, -1)
    return jnp.concatenate([jnp.stack([count, s]), rows.astype(jnp.int32), first])


def merge_items(acc, m, l, splits, with_lse: bool = False):
    """[items, G, W]: each work item's group of ``splits`` consecutive items (S, traced, a power of two <= 16)
    merged as ``merge_splits`` merges them, the result at every item of the group. ``splits`` may also be one count
    an item [items] (launches of their own splits in one buffer, each's items starting at a multiple of 16). A
    butterfly: at step k (1, 2, 4, 8; taken while k < S) every item meets item ``i ^ k`` (the ``k``-blocks of a
    ``2k``-block swapped: a reversal, so XLA fuses it) for the group's maximum, then for the weighted sums. Only a
    group's own items ever meet, so a narrow head's unwritten columns stay in its own columns; no branch either (a
    conditional put XLA's predicate on the host and changed the step's kernels from call to call). ``with_lse``: also
    each item's group's whole denominator [items, G] (``log_sum``)."""
    items = acc.shape[0]
    s = jnp.asarray(splits)
    s_rows = s[:, None] if s.ndim else s  # against [items, G]
    s_acc = s[:, None, None] if s.ndim else s  # against [items, G, W]

    def partner(x, k):
        return jnp.flip(x.reshape(items // (2 * k), 2, k, *x.shape[1:]), axis=1).reshape(x.shape)

    steps = [k for k in (1, 2, 4, 8) if k < MAX_SPLITS and items % (2 * k) == 0]
    top = m
    for k in steps:
        top = jnp.where(k < s_rows, jnp.maximum(top, partner(top, k)), top)
    w = jnp.where(l > 0, jnp.exp2(m - top), 0.0)
    acc, total = acc * w[..., None], l * w
    for k in steps:
        acc = jnp.where(k < s_acc, acc + partner(acc, k), acc)
        total = jnp.where(k < s_rows, total + partner(total, k), total)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return (out, log_sum(top, total)) if with_lse else out


# Pages a program reads a step, and pipeline stages: the best of bench/results/eviction.md "Per-head pages: decode
# kernel"'s sweep on the H200 (4 pages = 64 full-width tokens or 128 of a half-width head).
PAGES_PER_STEP = 4
NUM_STAGES = 2
STEP_BYTES = 64 * 1024  # a step's K and V tiles times its stages: the measured best's (64 full-width bf16 tokens)


def pages_a_step(per: int, kw: int, vw: int, most: int, itemsize: int, stages: int) -> int:
    """Pages a program of a (kw, vw) head reads a step: at most ``most``, fewer where the step's K and V tiles
    (tokens rounded up to a power of two) times the pipeline's stages would pass ``STEP_BYTES``. A wide head's 4
    pages of 18 tokens round to 128 rows of 224 columns, and two stages of that asked the H200 for 256 KiB of
    shared memory (it has 227)."""
    n = most
    while n > 1 and tile(per * n) * (tile(kw) + tile(vw)) * itemsize * stages > STEP_BYTES:
        n -= 1
    return n


def _check(q, pool, tables, stored, first, layout: HeadLayout, page_elems: int, pages_per_step) -> None:
    """``head_paged_decode``'s inputs, each refused in one line."""
    check_heads(q, tables, stored, first, layout)
    if pool.ndim != 2 or pool.shape[1] != page_elems:
        raise ValueError(f"pool must be [num_pages, {page_elems}], got {pool.shape}")
    if not (isinstance(pages_per_step, int) and pages_per_step >= 1):
        raise ValueError(f"pages_per_step must be a positive integer, got {pages_per_step!r}")


def check_heads(q, tables, stored, first, layout: HeadLayout) -> None:
    """What every per-head kernel refuses in one line (this one's and ``quant_head_kernel``'s): q not packed [B,
    q_cols], tables or counts not per (row, KV head), a GQA group past ``BLOCK_H`` rows, ``first`` on a layer without
    a window or not shaped as ``stored``."""
    b, hkv = q.shape[0], layout.num_kv_heads
    if q.ndim != 2 or q.shape[1] != layout.q_cols:
        raise ValueError(f"q must be [B, {layout.q_cols}], got {q.shape}")
    if tables.ndim != 3 or tables.shape[:2] != (b, hkv) or stored.shape != (b, hkv):
        raise ValueError(f"tables must be [{b}, {hkv}, pages] and stored [{b}, {hkv}]")
    if layout.group_size > BLOCK_H:
        raise ValueError(f"per-head decode scores at most {BLOCK_H} queries a KV head, got {layout.group_size}")
    if first is not None and layout.sliding_window is None:
        raise ValueError("first (where a head's window starts) is for sliding-window layers only")
    if first is not None and first.shape != stored.shape:
        raise ValueError(f"first must be [{b}, {hkv}] as stored, got {first.shape}")


def packed_out(got, layout: HeadLayout, dtype) -> jax.Array:
    """The merged rows [B, Hkv, G, width] (each head's output in its first ``v_width`` columns) as the packed output
    [B, out_cols] in ``dtype``: what every per-head kernel returns."""
    b, g = got.shape[0], layout.group_size
    outs = [got[:, h, :, :vw].reshape(b, g * vw) for h, vw in enumerate(layout.v_widths)]
    return jnp.concatenate(outs, axis=-1).astype(dtype)


def _counts(stored, first) -> list[jax.Array]:
    """The kernels' first two inputs: each head's stored count and first seen slot, flat int32."""
    return [stored.astype(jnp.int32).reshape(-1), first.astype(jnp.int32).reshape(-1)]


def _work_of(stored, work, splits) -> jax.Array:
    """The live launch's work list: ``work`` as given (the step's, splits its own), else ``live_work`` of ``stored``."""
    if work is None:
        return live_work(stored, splits)
    if splits is not None or work.shape != (2 + 2 * stored.size,):
        raise ValueError(f"work must be live_work's [{2 + 2 * stored.size}] for B x Hkv heads, with splits None")
    return work


def _merge_live(acc, m, l, work, splits, with_lse: bool = False):
    """[B x Hkv, G, width]: each head's output from ``_live_kernel``'s items (``acc`` [items, G, width], ``m``, ``l``
    [items, G]) under ``work`` (``live_work``), zeros for a head that stores nothing. ``with_lse``: also each head's
    whole denominators [B x Hkv, G] (``log_sum``; MASK for a head that stores nothing)."""
    first = work[2 + (work.shape[0] - 2) // 2 :]  # each head's first item, -1 if not live
    return merge_at(
        acc, m, l, first, work[1] if splits is None else splits, fixed=splits is not None, with_lse=with_lse
    )


def merge_at(acc, m, l, first, splits, *, fixed: bool, with_lse: bool = False):
    """``_merge_live`` given each head's first item ``first`` [heads] (-1: not live) and ``splits``: a fixed count
    (``fixed``: every head's items ``splits`` apart from item 0), or ``merge_items``' traced count or counts."""
    items, g, width = acc.shape
    at = jnp.maximum(first, 0)
    if fixed:
        merged, lse = merge_splits(
            acc.reshape(-1, splits, g, width), m.reshape(-1, splits, g), l.reshape(-1, splits, g), with_lse=True
        )
        merged, lse = merged[at // splits], lse[at // splits]
    else:
        merged, lse = merge_items(acc, m, l, splits, with_lse=True)  # every item of a group holds its merge
        merged, lse = merged[at], lse[at]
    out = jnp.where((first >= 0)[:, None, None], merged, 0.0)
    return (out, jnp.where((first >= 0)[:, None], lse, MASK)) if with_lse else out


def _launch(kernel, n, s, inputs, width, name, grid=None, *, b, g, cap, heads, params, interpret):
    """(acc [B, n, S, G, width], m, l [B, n, S, G], raw) of ``kernel`` over a grid of (B, n heads, S splits), or
    over ``grid`` (n x s items: acc [items, G, width], m, l [items, G]); raw: with ``cap`` slots a head, the weights
    output's scores [B, Hkv, G, cap] (else None)."""
    rows = (b if grid is None else 1) * n * s * g
    shapes = [jax.ShapeDtypeStruct((rows * width,), jnp.float32), *[jax.ShapeDtypeStruct((rows,), jnp.float32)] * 2]
    if cap:
        shapes.append(jax.ShapeDtypeStruct((b * heads * cap * g,), jnp.float32))
    acc, m, l, *raw = pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=(b, n, s) if grid is None else grid,
        in_specs=[whole_block(x) for x in inputs],
        out_specs=[whole_block(x) for x in shapes],
        interpret=interpret,
        compiler_params=params,
        name=name,
    )(*inputs)
    raw_scores = raw[0].reshape(b, heads, g, cap) if raw else None
    if grid is not None:
        return acc.reshape(n * s, g, width), m.reshape(n * s, g), l.reshape(n * s, g), raw_scores
    return acc.reshape(b, n, s, g, width), m.reshape(b, n, s, g), l.reshape(b, n, s, g), raw_scores


def _one_launch(q, pool, tables, stored, first, layout, static, splits, schedule, work, launch, common, merge):
    """``head_paged_decode``'s one launch for every width pair (``static``: each pair's kw, vw, tokens a page, pages
    a step), on the slot grid or the live heads (their items merged as ``merge`` says); with ``common["cap"]`` also
    the weights."""
    interpret = common["interpret"]
    b, g, heads = q.shape[0], layout.group_size, layout.num_kv_heads
    pair_of = np.zeros(heads, np.int32)
    for i, (_, members) in enumerate(width_pairs(layout)):
        pair_of[members] = i
    width = max(layout.v_widths)
    qo = np.asarray(HeadLayout.offsets(layout.k_widths, g), np.int32)
    inputs = [*_counts(stored, first), tables.astype(jnp.int32).reshape(-1), q.reshape(-1), pool]
    inputs += [jnp.asarray(pair_of), jnp.asarray(qo)]
    if schedule == "slots":
        s = default_splits(b * heads) if splits is None else splits
        kernel = functools.partial(_one_kernel, pairs=tuple(static), q_cols=layout.q_cols, out_stride=width, **common)
        acc, m, l, raw = launch(kernel, heads, s, inputs, width, "kvjax_head_decode_all")
        got, lse = merge_splits(acc, m, l, with_lse=True)  # [B, H, G, width], [B, H, G]
    else:
        work = _work_of(stored, work, splits)
        items = work_items(b * heads) if splits is None else b * heads * splits
        kernel = functools.partial(
            _live_kernel, pairs=tuple(static), q_cols=layout.q_cols, units=heads, out_stride=width, **common
        )
        acc, m, l, raw = launch(kernel, items, 1, [*inputs, work], width, "kvjax_head_decode_live", (items,))
        if merge == "kernel":
            first_items, s = work[2 + b * heads :], work[1] if splits is None else splits
            out, lse = merge_heads(acc, m, l, first_items, s, layout, q.dtype, with_lse=True, interpret=interpret)
            return out if raw is None else (out, raw, lse.reshape(b, heads, g))
        got, lse = _merge_live(acc, m, l, work, splits, with_lse=True)
        got, lse = got.reshape(b, heads, g, width), lse.reshape(b, heads, g)
    out = packed_out(got, layout, q.dtype)
    return out if raw is None else (out, raw, lse)


@functools.partial(
    jax.jit,
    static_argnames=(
        "layout",
        "page_elems",
        "splits",
        "pages_per_step",
        "num_warps",
        "num_stages",
        "one_launch",
        "schedule",
        "weights",
        "slots",
        "square",
        "merge",
        "interpret",
    ),
)
def head_paged_decode(
    q,
    pool,
    tables,
    stored,
    layout: HeadLayout,
    page_elems: int,
    *,
    first=None,
    splits=None,
    pages_per_step=PAGES_PER_STEP,
    num_warps=4,
    num_stages=NUM_STAGES,
    one_launch=True,
    schedule="slots",
    work=None,
    weights=False,
    slots=None,
    sums=None,
    square=False,
    active=None,
    merge="kernel",
    interpret=False,
):
    """One new query per sequence against each KV head's stored tokens; equal to ``head_paging.decode_attention``.

    q [B, q_cols] packed; pool [num_pages, page_elems]; tables [B, Hkv, pages] int32 (each head's block table);
    stored [B, Hkv] int32 (tokens each head stores, the new one included, already written); ``first`` [B, Hkv] int32
    (sliding-window layers only): each head's first slot the window sees, the slots before it skipped. ``splits``:
    programs sharing one head's pages, their partial softmaxes merged after (None: ``default_splits`` of the slots,
    or with ``schedule="live"`` in one launch, ``live_work``'s from the heads that store tokens);
    ``pages_per_step``: pages a program reads a step, at most (fewer for wide heads: ``pages_a_step``);
    ``one_launch``: every width pair in one kernel, each program switching to its head's pair (the default:
    1.25-1.9x faster than a launch per pair at rate 0.5, bench/results/eviction.md "Per-head pages: decode kernel");
    ``schedule``: "slots" (a grid of every slot's heads) or "live" (one launch only: ``_live_kernel``); ``work``:
    with "live" and no ``splits``, a ``live_work`` built once for the step and shared by its layers (the engine's,
    from its live slots; default: from ``stored``, each layer again). Returns [B, out_cols] in q's dtype; a head
    storing nothing (or not live in ``work``) gives zeros. ``weights`` (one launch only): also float32 [B, Hkv, G,
    slots], each query row's softmax weight on each slot of its head (0 where it sees none), equal to
    ``head_paging.decode_weights``: the decode step's share of the full-history eviction sums, out of the kernel's own
    scores rather than a second pass over K. ``slots``: the most tokens a head stores (default: what its table
    addresses, the tables' pages times the most tokens a page holds, up to 8x more for ZACK's narrow heads); the
    weights cost bytes in proportion (bench/results/eviction.md "Eviction on the H100 (2026-12-06, second
    session)"). ``sums`` (float32 [B, Hkv, slots], instead of ``weights``): returned as (out, sums) with the weights
    summed over each group added (squared first where ``square``) by ``sums_kernel.add_weights``, on the rows
    ``active`` [B] allows (default every row): the engine's full-history sums, the weights never written whole.
    ``merge`` ("live" only): the items merged by "kernel" (``item_merge.merge_heads``) or "xla" (``merge_items``)."""
    check_merge(merge)
    if sums is not None:
        if weights:
            raise ValueError("give weights=True or sums, not both")
        slots, weights = sums.shape[-1], True
    _check(q, pool, tables, stored, first, layout, page_elems, pages_per_step)
    if weights and not one_launch:
        raise ValueError("the decode weights come from the one launch only (one_launch=True)")
    b, g = q.shape[0], layout.group_size
    first = jnp.zeros_like(stored) if first is None else first
    common: dict = dict(page_elems=page_elems, pages=tables.shape[2], group=g)
    itemsize = jnp.dtype(pool.dtype).itemsize

    def step_pages(kw: int, vw: int) -> int:
        return pages_a_step(tokens_per_page(page_elems, kw, vw), kw, vw, pages_per_step, itemsize, num_stages)

    common |= dict(scale=1.0 / math.sqrt(layout.head_dim), interpret=interpret)
    params, debug = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages), dict(interpret=interpret)
    if schedule not in ("slots", "live") or (schedule == "live" and not one_launch):
        raise ValueError(f"schedule must be 'slots', or 'live' with one_launch, got {schedule!r}")
    if one_launch:
        static = [
            (kw, vw, tokens_per_page(page_elems, kw, vw), step_pages(kw, vw)) for (kw, vw), _ in width_pairs(layout)
        ]
        cap = tables.shape[2] * max(per for _, _, per, _ in static) if weights else 0
        cap = min(cap, slots) if weights and slots is not None else cap
        launch = functools.partial(_launch, b=b, g=g, cap=cap, heads=layout.num_kv_heads, params=params, **debug)
        args = (q, pool, tables, stored, first, layout, static, splits, schedule, work, launch)
        got = _one_launch(*args, common | dict(cap=cap) if weights else common, merge)
        if not weights:
            return got
        out, raw, lse = got
        if sums is None:
            return out, weights_of(raw, lse, stored, first)
        adding = stored if active is None else jnp.where(active[:, None], stored, 0)
        return out, add_weights(raw, lse, first, adding, sums, square=square, interpret=interpret)
    launch = functools.partial(_launch, b=b, g=g, cap=0, heads=layout.num_kv_heads, params=params, **debug)

    def attend(kw, vw, heads, qh):
        n = len(heads)
        s = default_splits(b * n) if splits is None else splits
        inputs = [*_counts(stored[:, heads], first[:, heads]), tables[:, heads].astype(jnp.int32).reshape(-1)]
        inputs += [qh.reshape(-1), pool]
        per, step = tokens_per_page(page_elems, kw, vw), step_pages(kw, vw)
        kernel = functools.partial(_pair_kernel, kw=kw, vw=vw, per=per, pages_per_step=step, **common)
        got = merge_splits(*launch(kernel, n, s, inputs, vw, f"kvjax_head_decode_k{kw}_v{vw}")[:3])
        return got.reshape(b, n, g * vw).astype(q.dtype)

    return by_width_pair(q, layout, attend)
