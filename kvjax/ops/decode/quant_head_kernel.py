"""Decode attention over quantized per-head pages (``ops.quant_head_paging``: eviction with ``kv_bits``; issue 37,
item 5; Pallas, Triton lowering). ``quant_head_decode`` equals ``quant_head_paging.decode_attention``.

Two kernels' halves put together: ``head_kernel``'s work (one program per split of each live (sequence, KV head),
``head_kernel.live_work``'s list, the splits merged by ``item_merge``) and ``quant_kernel``'s reading of
quantized codes (``quant_kernel._Reader``: a key plane scored against its block of ``q * scale``, value scales folded
into the weights, no value or key ever rebuilt). A chunk is one of the head's full groups, found through its block
table: page ``table[g // groups a page]``, at byte ``(g % groups a page) x the group's bytes`` of it; the head's
partial group, exact in the layer's tail, is the last chunk of its first split.

Launches: the engine's is one a width pair of the layer, each kernel that pair's alone and one Triton module for
every layer (XLA compiles it once for the model); one launch switching between a layer's pairs makes a module a
layer, whose Triton compile grows faster than its pairs (bench/results/eviction.md "Eviction on quantized pages:
compile, a module a layer against a module a width pair": 1,083 s against 64 s for a rate-0.5 model, offline). Each
launch has its own work list over its own heads' rows (``launch_heads``), so that a pair of one head still gets a
GPU's worth of programs.

Constraints: q packed [B, q_cols]; at most 16 queries a KV head; widths multiples of 16; the pool [pages, bytes]
(indexed by (page, byte): a pool past 2 GiB needs no 64-bit flat offset), the tail under 2^31 elements.
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

from kvjax.layout import HeadLayout
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.head_kernel import (
    _counts,
    _work_of,
    check_heads,
    live_item,
    merge_at,
    packed_out,
    work_items,
)
from kvjax.ops.decode.item_merge import check_merge, merge_heads
from kvjax.ops.decode.quant_kernel import _both, _fills, _Reader, _update, empty_carry, side_class, tail_update
from kvjax.ops.pallas_util import LOG2E, MASK, NOWHERE, dot_precision, whole_block, width_pairs
from kvjax.ops.quant import check_bits
from kvjax.ops.quant_head_paging import groups_per_page, head_format
from kvjax.ops.tiles import tile

BLOCK_H = ROWS  # query rows a program: a GQA group (G <= 16) padded to the tensor cores' smallest M
# tokens a loop step reads: quant_kernel's (``QuantKernelConfig``: 128 for a head whose K and V tiles hold 256 columns
# or more, 64 for narrower ones, whose registers spill at more)
STEP_TOKENS, NARROW_STEP_TOKENS = 128, 64


def groups_a_step(reader: _Reader, group: int) -> int:
    """Groups (chunks of ``tile(group)`` rows) a program reads a loop step: ``STEP_TOKENS`` worth for a head whose K
    and V tiles hold 256 columns or more, ``NARROW_STEP_TOKENS`` for a narrower one, at least one."""
    tokens = STEP_TOKENS if reader.tile(True) + reader.tile(False) >= 256 else NARROW_STEP_TOKENS
    return max(1, tokens // tile(group))


def _reader(kw: int, vw: int, bits: int, dtype) -> _Reader:
    """``quant_kernel``'s reader of one head of widths (kw, vw)."""
    k_side, v_side = side_class(kw, bits), side_class(vw, bits, keys=False)
    n = 8 // bits
    return _Reader(k_side, v_side, bits, dtype, _fills(k_side, kw, bits), _fills(v_side, vw, bits), kw // n, vw // n)


def _attend(
    refs,
    head_split,
    seq,
    unit,
    head,
    item,
    active,
    *,
    kw,
    vw,
    per,
    nc,
    size,
    bits,
    queries,
    pages,
    scale,
    out_stride,
    interpret,
):
    """One program's work on KV head ``unit`` of sequence ``seq`` (``head``: its flat row of the counts and tables)
    for its split (``head_split``: the split and the number of splits): its share of the head's full groups of
    ``size`` slots, ``nc`` a loop step, and (split 0) the head's partial group from the tail; its partial softmax
    stored as work item ``item`` (rows ``out_stride`` wide). An inactive program stores an empty one (no weight).
    ``per``: the head's groups a pool page; ``queries``: query heads a KV head; ``pages``: a head's table entries.
    A q row's, a tail row's and its K columns are read from ``dims_ref`` (not static: see ``quant_head_decode``)."""
    g = queries
    (stored_ref, first_ref, table_ref, q_ref, pool_ref, meta_ref, tail_ref, _, qo_ref, ko_ref, vo_ref,
     dims_ref, _, _) = refs[:INPUTS]  # fmt: skip
    acc_ref, m_ref, l_ref = refs[-3:]  # the outputs (after the launch's aliased inputs, if any)
    q_cols, tail_cols, k_cols = dims_ref[0], dims_ref[1], dims_ref[2]
    split, splits = head_split
    dt = jnp.dtype(q_ref.dtype)
    precision = dot_precision(dt)
    n = 8 // bits
    fmt = head_format(kw, vw, size, bits)
    at = fmt.offsets
    reader = _reader(kw, vw, bits, dt)
    k_pieces, v_pieces = reader.pieces(True), reader.pieces(False)
    rows = jnp.arange(BLOCK_H)
    real = rows < g
    q_base = seq * q_cols + qo_ref[unit]

    def load_q(piece):
        q = plgpu.load(
            q_ref.at[q_base + rows[:, None] * kw + piece.own()], mask=_both(real[:, None], piece.ok()), other=0
        )
        return (q.astype(jnp.float32) * (scale * LOG2E)).astype(dt)  # scores in log2 units

    qs = [load_q(piece) for piece in k_pieces]
    stored = jnp.where(active, stored_ref[head], 0)
    seen_from = jnp.where(active, first_ref[head], 0)  # slots before it are out of the layer's window
    full = stored // size  # the head's full groups; its partial group is in the tail
    lo = seen_from // size  # its first group with a seen slot
    steps = pl.cdiv(jnp.maximum(full - lo, 0), nc)
    share = pl.cdiv(steps, splits)
    r = jnp.arange(max(16, tile(size)))  # a chunk's rows: a dot's dimension is at least 16
    k_byte, _, k_byte_ok = reader.bytes(True)
    v_byte, _, v_byte_ok = reader.bytes(False)

    def chunk(grp):
        """Scores [BLOCK_H, rows] of group ``grp``, and a function of its weights giving ``_Reader.values``."""
        ok = grp < full
        page = plgpu.load(table_ref.at[head * pages + jnp.where(ok, grp // per, 0)])
        base = (grp % per) * fmt.page_bytes  # the group's first byte in its page
        visible = ok & (r < size) & (grp * size + r >= seen_from)

        def load(ref, index, mask):
            return plgpu.load(ref.at[jnp.broadcast_to(page, index.shape), index], mask=mask, other=0)

        def codes(first_byte, row_bytes, byte, byte_ok):
            return load(pool_ref, base + first_byte + r[:, None] * row_bytes + byte, _both(visible[:, None], byte_ok))

        def key_meta(piece, row):  # the keys' scale (row 0) or zero (row 1) of the piece's columns, float16 units
            index = (base + at["k_meta"]) // 2 + row * kw + piece.at()
            return load(meta_ref, index, _both(jnp.full((1, piece.tile), ok), piece.ok())).astype(jnp.float32)

        meta = [(key_meta(piece, 0), key_meta(piece, 1)) for piece in k_pieces]
        s = reader.scores(qs, codes(0, kw // n, k_byte, k_byte_ok), meta, precision)
        v_raw = codes(at["v_codes"], vw // n, v_byte, v_byte_ok)
        v_at = (base + at["v_meta"]) // 2 + r  # the values' scales, then ``size`` later their zeros: one head
        v_scale = load(meta_ref, v_at, visible).astype(jnp.float32)
        v_zero = load(meta_ref, v_at + size, visible).astype(jnp.float32)
        return jnp.where(visible[None, :], s, MASK), lambda p: reader.values(v_raw, p, v_scale, v_zero, precision)

    def step(j, carry):
        return _update(carry, [chunk(lo + j * nc + c) for c in range(nc)])

    def tail_step(_, carry):
        slot = full * size + r
        visible = (r < size) & (slot < stored) & (slot >= seen_from)
        row = (seq * size + r)[:, None] * tail_cols
        cols = (ko_ref[unit], k_cols + vo_ref[unit])
        return tail_update(carry, qs, (k_pieces, v_pieces), tail_ref, row, cols, visible, precision)

    first = split * share
    carry = lax.fori_loop(first, jnp.minimum(first + share, steps), step, empty_carry(v_pieces))
    has_tail = (split == 0) & (stored % size > 0)
    accs, m, l = lax.fori_loop(0, has_tail.astype(jnp.int32), tail_step, carry)
    part = item * g + rows  # this split's rows of the partial results
    for acc, piece in zip(accs, v_pieces):
        mask = jnp.broadcast_to(_both(real[:, None], piece.ok()), acc.shape)
        index = part[:, None] * out_stride + piece.own()
        plgpu.store(acc_ref.at[jnp.where(mask, index, NOWHERE) if interpret else index], acc, mask=mask)
    index = jnp.where(real, part, NOWHERE) if interpret else part
    plgpu.store(m_ref.at[index], m, mask=real)
    plgpu.store(l_ref.at[index], l, mask=real)


INPUTS = 14  # the kernel's inputs before its outputs (and the outputs' aliased inputs): ``quant_head_decode``'s list


def _kernel(*refs, pairs, units, **static):
    """``head_kernel._live_kernel`` over quantized pages: program i does split i % S of live row i // S
    (``work_ref``: ``live_work``'s count, splits and rows over the launch's heads ``heads_ref``: row r is sequence r //
    n's head ``heads_ref[r % n]``, n = ``dims_ref[3]``), switching to its head's width pair (``pair_ref``; a launch a
    pair: its one branch, no switch), its item stored ``dims_ref[4]`` items into the outputs (where its launch's
    items start); programs past the live rows store empty items (as row 0's)."""
    pair_ref, dims_ref, heads_ref, work_ref = refs[7], refs[11], refs[12], refs[13]
    item, head_split, active, row = live_item(work_ref)
    n = dims_ref[3]
    seq, unit = row // n, heads_ref[row % n]
    args = (refs, head_split, seq, unit, seq * units + unit, dims_ref[4] + item, active)
    branches = [functools.partial(_attend, *args, kw=kw, vw=vw, per=per, nc=nc, **static) for kw, vw, per, nc in pairs]
    lax.switch(pair_ref[unit], branches)  # one pair: its branch alone, no switch


def _check(q, pool, tail, tables, stored, first, layout: HeadLayout, page_bytes: int, size: int) -> None:
    """``quant_head_decode``'s inputs, each refused in one line (``head_kernel.check_heads``, then the pool's and the
    tail's)."""
    check_heads(q, tables, stored, first, layout)
    b = q.shape[0]
    if pool.dtype != jnp.uint8 or pool.ndim != 2 or pool.shape[1] != page_bytes or page_bytes % 2:
        raise ValueError(f"pool must be uint8 [num_pages, {page_bytes}] (an even page), got {pool.dtype} {pool.shape}")
    if tail.ndim != 3 or tail.shape[0] < b or tail.shape[1:] != (size, layout.k_cols + layout.v_cols):
        raise ValueError(f"tail must be [>= {b}, {size}, {layout.k_cols + layout.v_cols}], got {tail.shape}")
    if tail.size >= 2**31:
        raise ValueError("the tail is addressed with int32 offsets: under 2^31 elements")


@functools.partial(
    jax.jit,
    static_argnames=(
        "layout",
        "page_bytes",
        "group",
        "bits",
        "splits",
        "step_groups",
        "num_warps",
        "num_stages",
        "pairs",
        "merge",
        "interpret",
    ),
)
def quant_head_decode(
    q,
    pool,
    tail,
    tables,
    stored,
    layout: HeadLayout,
    page_bytes: int,
    group: int,
    bits: int,
    *,
    first=None,
    work=None,
    splits=None,
    step_groups=None,
    num_warps=4,
    num_stages=2,
    pairs=None,
    merge="kernel",
    interpret=False,
):
    """One new query per sequence against each KV head's stored slots on quantized per-head pages; equal to
    ``quant_head_paging.decode_attention`` (float32 dots where q is float32).

    q [B, q_cols] packed; pool uint8 [num_pages, page_bytes] (``quant_head_paging.pool_page_bytes``); tail [>= B, group,
    k_cols + v_cols] (row i: sequence i's heads' partial groups); tables [B, Hkv, pages] int32; stored [B, Hkv] int32
    (slots each head stores, the new one included, already written); ``group``: slots a quantized group (the engine's
    page size); ``bits``: 4 or 2; ``first`` [B, Hkv] (sliding-window layers): each head's first slot its window sees.
    ``work``: the work lists built once for the step, ``head_kernel.live_work`` over B x n rows for each head count n of
    ``launch_heads`` (a mapping by n; one launch also takes its one list); default: each launch's from its heads'
    ``stored``; or ``splits`` fixed; ``step_groups``: groups a program reads a loop step (default ``groups_a_step``);
    ``num_warps``, ``num_stages``: Triton's. ``pairs`` (the engine's: every layer's (K width, V width) pairs): a launch
    for each of the layer's pairs, its kernel compiled for that pair alone and the same Triton module whatever the
    layer, which XLA compiles once for the model (its kernel cache is keyed by the module); each launch's splits chosen
    from its own rows (a launch of one head of 8 at B32: 16 splits, 512 programs; with the layer's 2 it had 64 working
    programs on 132 SMs, bench/results/eviction.md "Eviction on quantized pages: the engine's step through a kernel a
    width pair (H100)"), the launches' items in one buffer, merged once. Without it, one launch switching between the
    layer's pairs: a module a layer, whose compile grows faster than its pairs (7 pairs: 19 s of Triton offline at
    groups of 32, against 1-2 s for one; bench/notes/2026-12-06-quant-head-compile.md). ``merge``: how the items
    become the packed output: "kernel" (``item_merge.merge_heads``: each partial read once) or "xla" (``merge_at``'s
    butterfly, then ``packed_out``). Returns [B, out_cols] in q's
    dtype; a head storing nothing gives zeros. Bytes a page holds past what its head wrote (another head's, stale) are
    never read: every load of a group past the head's full groups is masked."""
    check_bits(bits)
    check_merge(merge)
    if step_groups is not None and not (isinstance(step_groups, int) and step_groups >= 1):
        raise ValueError(f"step_groups must be a positive integer, got {step_groups!r}")
    _check(q, pool, tail, tables, stored, first, layout, page_bytes, group)
    b, g, heads = q.shape[0], layout.group_size, layout.num_kv_heads
    first = jnp.zeros_like(stored) if first is None else first
    own = [pair for pair, _ in width_pairs(layout)]
    one_launch = pairs is None
    pairs = tuple(own) if one_launch else tuple(pairs)
    if missing := sorted(set(own) - set(pairs)):
        raise ValueError(f"pairs must hold each width pair of the layout; {missing} missing")
    if len(set(pairs)) < len(pairs):
        raise ValueError(f"pairs must be distinct, got {pairs}")
    pair_of = np.zeros(heads, np.int32)  # each head's branch; a launch a pair has one, 0
    for pair, members in width_pairs(layout) if one_launch else ():
        pair_of[members] = pairs.index(pair)
    branches = []
    for kw, vw in pairs:
        nc = groups_a_step(_reader(kw, vw, bits, q.dtype), group) if step_groups is None else step_groups
        branches.append((kw, vw, groups_per_page(page_bytes, kw, vw, group, bits), nc))
    width = max(tile(vw) for _, vw in pairs)
    offsets = [
        HeadLayout.offsets(layout.k_widths, g),
        HeadLayout.offsets(layout.k_widths),
        HeadLayout.offsets(layout.v_widths),
    ]
    inputs = [
        *_counts(stored, first),
        tables.astype(jnp.int32).reshape(-1),
        q.reshape(-1),
        pool,
        lax.bitcast_convert_type(pool.reshape(pool.shape[0], -1, 2), jnp.float16),  # the metadata's view: a bitcast
        tail.reshape(-1),
        jnp.asarray(pair_of),
        *[jnp.asarray(np.asarray(o, np.int32)) for o in offsets],
    ]
    dims = [layout.q_cols, layout.k_cols + layout.v_cols, layout.k_cols]  # the layer's, not static: one module
    static = dict(
        size=group,
        bits=bits,
        queries=g,
        pages=tables.shape[2],
        scale=1.0 / math.sqrt(layout.head_dim),
        out_stride=width,
        interpret=interpret,
    )
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    name = f"kvjax_quant_head_decode_int{bits}"
    if one_launch:
        heads_of = [list(range(heads))]
        lists = [_work_of(stored, _list_of(work, heads), splits)]
        kernels = [(functools.partial(_kernel, pairs=tuple(branches), units=heads, **static), name)]
    else:
        launched = _launch_order(layout, pairs)
        heads_of = [members for _, members in launched]
        lists = [_pair_work(stored, members, work, splits) for members in heads_of]
        kernels = [  # a pair's kernel: its one branch, named after it
            (
                functools.partial(_kernel, pairs=(branches[pairs.index(pair)],), units=heads, **static),
                f"{name}_k{pair[0]}_v{pair[1]}",
            )
            for pair, _ in launched
        ]
    # each launch's items in one buffer, from a multiple of 16 (``merge_items``' groups never cross launches)
    sizes = [_items(b * len(members), splits) for members in heads_of]
    starts = np.cumsum([0, *sizes])
    launches = [  # each launch's inputs: the layer's, then its dims (n, first item), heads and work list
        [*inputs, jnp.asarray([*dims, len(members), int(start)], jnp.int32), jnp.asarray(members, jnp.int32), w]
        for members, w, start in zip(heads_of, lists, starts)
    ]
    acc, m, l = _launches(kernels, launches, sizes, g, width, params, interpret)
    item_first = [_first_items(w, b, len(members), int(start)) for w, members, start in zip(lists, heads_of, starts)]
    order = np.argsort(np.concatenate([np.asarray(members) for members in heads_of]), kind="stable")
    first_items = jnp.concatenate(item_first, axis=1)[:, order].reshape(-1)  # [B x Hkv], heads in their order
    if splits is None:
        counts = jnp.concatenate([jnp.full((n,), w[1], jnp.int32) for n, w in zip(sizes, lists)])  # an item's launch's
    if merge == "kernel":
        head_splits = counts[jnp.maximum(first_items, 0)] if splits is None else splits
        return merge_heads(acc, m, l, first_items, head_splits, layout, q.dtype, interpret=interpret)
    if splits is None:
        got = merge_at(acc, m, l, first_items, counts, fixed=False)
    else:
        got = merge_at(acc, m, l, first_items, splits, fixed=True)
    return packed_out(got.reshape(b, heads, g, width), layout, q.dtype)


def _launch_order(layout: HeadLayout, pairs) -> list:
    """The layer's width pairs with their heads, in ``pairs``' order (the engine's: the model's, sorted)."""
    own = dict(width_pairs(layout))
    return [(pair, own[pair]) for pair in pairs if pair in own]


def launch_heads(layout: HeadLayout, pairs=None) -> tuple[int, ...]:
    """The KV-head counts n whose work lists (``live_work`` over B x n rows) ``quant_head_decode`` reads for
    ``layout``: Hkv for the one launch (``pairs`` None), each launch's heads with ``pairs``. The engine builds one a
    count a step, shared by every layer."""
    if pairs is None:
        return (layout.num_kv_heads,)
    return tuple(sorted({len(members) for _, members in _launch_order(layout, pairs)}))


def _list_of(work, n: int):
    """The work list for n heads a row from ``work``: None (build it), a mapping by n (the engine's), or an array
    (the one launch's, over Hkv)."""
    if work is None or not isinstance(work, dict):
        return work
    if n not in work:
        raise ValueError(f"work holds lists for {sorted(work)} heads a row; this launch needs {n} (launch_heads)")
    return work[n]


def _pair_work(stored, members, work, splits):
    """A pair's launch's work list over its heads' rows (B x len(members)): the engine's for that many heads (live
    slots, broadcast), else from the heads' stored counts."""
    w = _list_of(work, len(members))
    if w is not None and not isinstance(work, dict):
        raise ValueError("with pairs, work must map a head count to its list (launch_heads), not one list")
    return _work_of(stored[:, np.asarray(members)], w, splits)


def _items(rows: int, splits) -> int:
    """Work items of one launch over ``rows`` (sequence, head) rows: ``work_items``' (a multiple of 16, as
    ``merge_items`` needs), or rows x ``splits`` (fixed: every head's items ``splits`` apart, as ``merge_at`` reads
    them)."""
    return work_items(rows) if splits is None else rows * splits


def _first_items(work, b: int, n: int, start: int):
    """[B, n]: each row's first item in the shared buffer (``start`` on from its launch's), -1 where not live."""
    first = work[2 + b * n :].reshape(b, n)
    return jnp.where(first >= 0, first + start, -1)


def _launches(kernels, inputs, sizes, g: int, width: int, params, interpret):
    """(acc [items, G, width], m, l [items, G]) filled by ``kernels`` (one launch each, of ``sizes`` programs, with
    its own ``inputs``), each writing its items into the buffers the last one wrote (aliased, never copied)."""
    rows = int(sum(sizes)) * g
    out = [jnp.zeros((rows * width,), jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32)]
    for (kernel, name), ins, items in zip(kernels, inputs, sizes):
        n = len(ins)
        out = pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out],
            grid=(items,),
            in_specs=[whole_block(x) for x in [*ins, *out]],
            out_specs=[whole_block(x) for x in out],
            input_output_aliases={n: 0, n + 1: 1, n + 2: 2},
            interpret=interpret,
            compiler_params=params,
            name=name,
        )(*ins, *out)
    acc, m, l = out
    items = int(sum(sizes))
    return acc.reshape(items, g, width), m.reshape(items, g), l.reshape(items, g)
