"""Decode attention over quantized per-head pages (``ops.quant_head_paging``: eviction with ``kv_bits``; issue 37,
item 5; Pallas, Triton lowering). ``quant_head_decode`` equals ``quant_head_paging.decode_attention``.

Two kernels' halves put together: ``head_kernel``'s work (one program per split of each live (sequence, KV head),
``head_kernel.live_work``'s list, the splits merged by ``item_merge``) and ``quant_kernel``'s reading of
quantized codes (``quant_kernel._Reader``), in the form that keeps a program's warps apart: each key plane
dequantized in registers before its dot (``k_dequant``: q as loaded, no rescaled copy of it a chunk), value scales
folded into the weights, and the softmax sums and the values' zero terms kept elementwise to the loop's end
(``quant_kernel.empty_carry``'s deferred carry), so a loop step reduces across warps once, for its maximum
(bench/results/eviction.md "Eviction on quantized pages: key scales on the codes"). A chunk is one of the head's full
groups, found through its block table: page ``table[g // groups a page]``, at byte ``(g % groups a page) x the
group's bytes`` of it; the head's partial group, exact in the layer's tail, is the last chunk of its first split.

Launches: a kernel has a branch a class of heads (``head_class``), each head's widths and group layout read at run
time, so a model's layers share its modules. The engine's launch a K class (``"k-class"``) switches between the
model's classes of the same K planes (a module a K class), with its own work list over its own heads' rows
(``launch_heads``); a launch a class (``"class"``) and one launch a layer switching between every class
(``"layer"``: one module, slower to compile) are the other forms. A branch a width pair, static, made a module a
layer when one launch switched between them (1,083 s of compile for a rate-0.5 model, offline), and a launch a pair
cost 5-8 launches a layer (bench/results/eviction.md "Eviction on quantized pages: a work list a launch (H100)").

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
from kvjax.ops.decode.quant_kernel import (
    _both,
    _fills,
    _Reader,
    _update,
    empty_carry,
    finish,
    side_class,
    tail_update,
)
from kvjax.ops.pallas_util import LOG2E, MASK, NOWHERE, dot_precision, whole_block, width_pairs
from kvjax.ops.quant import ALIGN, check_bits
from kvjax.ops.quant_head_paging import groups_per_page, head_format
from kvjax.ops.tiles import tile

# one launch a layer switching between the model's classes; a launch a K class of the layer, switching between the
# model's classes of that K class; a launch a class of the layer (``_launch_groups``)
LAUNCH_FORMS = ("layer", "k-class", "class")
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


# A head's row of the layer's head table (``_head_table``): its K width, plane widths, groups a page, a group's bytes
# and where the group's value codes, key metadata and value metadata start. Each is stored divided by its
# ``_aligns`` entry and multiplied back in the kernel, so Triton knows the multiple (whole-vector loads) of a value
# it reads at run time: a kernel a class serves every width of the class.
K_W, K_PLANE, V_PLANE, PER, GROUP_BYTES, V_CODES, K_META, V_META = range(8)
FIELDS = 8


def _aligns(bits: int) -> tuple[int, ...]:
    """Each field's known multiple: widths of 16 (planes of 16 / codes a byte), byte offsets of ``quant.ALIGN``."""
    n = 8 // bits
    return (16, 16 // n, 16 // n, 1, ALIGN, ALIGN, ALIGN, ALIGN)


def _head_table(layout: HeadLayout, page_bytes: int, group: int, bits: int) -> np.ndarray:
    """int32 [Hkv x FIELDS]: each head's row (``K_W`` ...), each field over its ``_aligns`` entry."""
    n, aligns, rows = 8 // bits, _aligns(bits), []
    for kw, vw in zip(layout.k_widths, layout.v_widths):
        fmt = head_format(kw, vw, group, bits)
        at = fmt.offsets
        assert at["k_codes"] == 0
        per = groups_per_page(page_bytes, kw, vw, group, bits)
        values = (kw, kw // n, vw // n, per, fmt.page_bytes, at["v_codes"], at["k_meta"], at["v_meta"])
        assert all(v % a == 0 for v, a in zip(values, aligns)), values
        rows.append([v // a for v, a in zip(values, aligns)])
    return np.asarray(rows, np.int32).reshape(-1)


def head_class(kw: int, vw: int, bits: int) -> tuple:
    """The (K, V) ``quant_kernel.side_class`` pair of a head's widths: heads of one class run the same kernel code,
    their widths read at run time (a plane's width masked within its tile)."""
    return side_class(kw, bits), side_class(vw, bits, keys=False)


def _branches(pairs, bits: int, dtype, group: int, step_groups) -> list[tuple]:
    """The classes of ``pairs`` (the engine's: every layer's width pairs), sorted, each as a kernel branch: (class,
    whether every K plane of the class fills its tile, the same for V, groups a loop step)."""
    out = []
    for cls in sorted({head_class(kw, vw, bits) for kw, vw in pairs}):
        members = [(kw, vw) for kw, vw in pairs if head_class(kw, vw, bits) == cls]
        k_full = all(_fills(cls[0], kw, bits) for kw, _ in members)
        v_full = all(_fills(cls[1], vw, bits) for _, vw in members)
        nc = groups_a_step(_reader(*members[0], bits, dtype), group) if step_groups is None else step_groups
        out.append((cls, k_full, v_full, nc))
    return out


def _class_name(cls) -> str:
    """A branch's class in a kernel's name: ``kp32_vg16`` is K planes in 32-column tiles, V gathered 16 wide."""
    (kf, ks), (vf, vs) = cls
    return f"k{kf[0]}{ks}_v{vf[0]}{vs}"


def _attend(
    refs,
    head_split,
    seq,
    unit,
    head,
    item,
    active,
    *,
    cls,
    k_full,
    v_full,
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
    ``cls``: the head's ``head_class`` (``k_full``, ``v_full``: whether every plane of the class fills its tile),
    its widths, groups a pool page and a group's layout read from the head table (``_head_table``); ``queries``: query
    heads a KV head; ``pages``: a head's table entries. A q row's, a tail row's and its K columns are read from
    ``dims_ref`` (not static: see ``quant_head_decode``)."""
    g = queries
    (stored_ref, first_ref, table_ref, q_ref, pool_ref, meta_ref, tail_ref, _, qo_ref, ko_ref, vo_ref, fields_ref,
     dims_ref, _, _) = refs[:INPUTS]  # fmt: skip
    acc_ref, m_ref, l_ref = refs[-3:]  # the outputs (after the launch's aliased inputs, if any)
    q_cols, tail_cols, k_cols = dims_ref[0], dims_ref[1], dims_ref[2]
    split, splits = head_split
    dt = jnp.dtype(q_ref.dtype)
    precision = dot_precision(dt)
    aligns = _aligns(bits)

    def field(f, unit_bytes=1):  # a head table field (in float16 units where ``unit_bytes`` is 2)
        return fields_ref[unit * FIELDS + f] * (aligns[f] // unit_bytes)

    kw, per = field(K_W), field(PER)
    reader = _Reader(cls[0], cls[1], bits, dt, k_full, v_full, field(K_PLANE), field(V_PLANE), k_dequant=True)
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
        page = plgpu.load(table_ref.at[head * pages + jnp.where(ok, lax.div(grp, per), 0)])
        nth = lax.rem(grp, per)  # the group's place in its page: its first byte, its first float16
        base, half = nth * field(GROUP_BYTES), nth * field(GROUP_BYTES, 2)
        visible = ok & (r < size) & (grp * size + r >= seen_from)

        def load(ref, index, mask):
            return plgpu.load(ref.at[jnp.broadcast_to(page, index.shape), index], mask=mask, other=0)

        def codes(first_byte, row_bytes, byte, byte_ok):
            return load(pool_ref, base + first_byte + r[:, None] * row_bytes + byte, _both(visible[:, None], byte_ok))

        def key_meta(piece, row):  # the keys' scale (row 0) or zero (row 1) of the piece's columns, float16 units
            index = half + field(K_META, 2) + row * kw + piece.at()
            return load(meta_ref, index, _both(jnp.full((1, piece.tile), ok), piece.ok())).astype(jnp.float32)

        meta = [(key_meta(piece, 0), key_meta(piece, 1)) for piece in k_pieces]
        s = reader.scores(qs, codes(0, field(K_PLANE), k_byte, k_byte_ok), meta, precision)
        v_raw = codes(field(V_CODES), field(V_PLANE), v_byte, v_byte_ok)
        v_at = half + field(V_META, 2) + r  # the values' scales, then ``size`` later their zeros: one head
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
    carry = lax.fori_loop(first, jnp.minimum(first + share, steps), step, empty_carry(v_pieces, r.shape[0]))
    has_tail = (split == 0) & (stored % size > 0)
    accs, m, l = finish(lax.fori_loop(0, has_tail.astype(jnp.int32), tail_step, carry))
    part = item * g + rows  # this split's rows of the partial results
    for acc, piece in zip(accs, v_pieces):
        mask = jnp.broadcast_to(_both(real[:, None], piece.ok()), acc.shape)
        index = part[:, None] * out_stride + piece.own()
        plgpu.store(acc_ref.at[jnp.where(mask, index, NOWHERE) if interpret else index], acc, mask=mask)
    index = jnp.where(real, part, NOWHERE) if interpret else part
    plgpu.store(m_ref.at[index], m, mask=real)
    plgpu.store(l_ref.at[index], l, mask=real)


INPUTS = 15  # the kernel's inputs before its outputs (and the outputs' aliased inputs): ``quant_head_decode``'s list


def _kernel(*refs, branches, units, **static):
    """``head_kernel._live_kernel`` over quantized pages: program i does split i % S of live row i // S
    (``work_ref``: ``live_work``'s count, splits and rows over the launch's heads ``heads_ref``: row r is sequence r //
    n's head ``heads_ref[r % n]``, n = ``dims_ref[3]``), switching to its head's class (``branch_ref``; a launch a
    class: its one branch, no switch), its item stored ``dims_ref[4]`` items into the outputs (where its launch's
    items start); programs past the live rows store empty items (as row 0's)."""
    branch_ref, dims_ref, heads_ref, work_ref = refs[7], refs[12], refs[13], refs[14]
    item, head_split, active, row = live_item(work_ref)
    n = dims_ref[3]
    seq, unit = row // n, heads_ref[row % n]
    args = (refs, head_split, seq, unit, seq * units + unit, dims_ref[4] + item, active)
    fns = [
        functools.partial(_attend, *args, cls=cls, k_full=k_full, v_full=v_full, nc=nc, **static)
        for cls, k_full, v_full, nc in branches
    ]
    lax.switch(branch_ref[unit], fns)  # one class: its branch alone, no switch


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
        "launches",
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
    launches="k-class",
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
    ``num_warps``, ``num_stages``: Triton's.

    The kernel has a branch a class of heads (``head_class``: how its K and V planes are read), each head's widths and
    group layout read at run time from a head table, so a kernel serves every width of its classes. ``pairs`` (the
    engine's: every layer's (K width, V width) pairs; default the layer's own) names the classes, so that given the
    model's pairs every layer lowers to the same Triton module, which XLA compiles once for the model (its kernel
    cache is keyed by the module; a module a layer took 1,083 s to compile at rate 0.5,
    bench/notes/2026-12-06-quant-head-compile.md). ``launches`` (each launch with its own work list over its heads'
    rows, the launches' items in one buffer, merged once):
    - "k-class" (the engine's): a launch a K class of the layer (``side_class`` of its keys), switching between the
      model's classes of that K class: 165.6 us a rate-0.5 int4 layer on an H100, 4 modules of 18 s of Triton
      offline (5 of 48 s at int2);
    - "class": a launch a class (a class of one head of 8 at B32: 16 splits, 512 programs): 208.4 us, 11 modules of
      11-22 s; more launches, each with less work a split;
    - "layer": one launch switching between every class: 157.3 us, but one module of 137 s offline, which the
      engine did not finish compiling within 215 s on an H100's host.
    (bench/results/eviction.md "Eviction on quantized pages: a launch a K class (H100)").
    ``merge``: how the items become the packed output: "kernel" (``item_merge.merge_heads``: each partial read once)
    or "xla" (``merge_at``'s butterfly, then ``packed_out``). Returns [B, out_cols] in q's dtype; a head storing
    nothing gives zeros. Bytes a page holds past what its head wrote (another head's, stale) are
    never read: every load of a group past the head's full groups is masked."""
    check_bits(bits)
    check_merge(merge)
    if step_groups is not None and not (isinstance(step_groups, int) and step_groups >= 1):
        raise ValueError(f"step_groups must be a positive integer, got {step_groups!r}")
    _check(q, pool, tail, tables, stored, first, layout, page_bytes, group)
    b, g, heads = q.shape[0], layout.group_size, layout.num_kv_heads
    first = jnp.zeros_like(stored) if first is None else first
    own = [pair for pair, _ in width_pairs(layout)]
    pairs = tuple(own) if pairs is None else tuple(pairs)
    if missing := sorted(set(own) - set(pairs)):
        raise ValueError(f"pairs must hold each width pair of the layout; {missing} missing")
    if len(set(pairs)) < len(pairs):
        raise ValueError(f"pairs must be distinct, got {pairs}")
    if launches not in LAUNCH_FORMS:
        raise ValueError(f"launches must be one of {LAUNCH_FORMS}, got {launches!r}")
    branches = _branches(pairs, bits, q.dtype, group, step_groups)
    classes = [branch[0] for branch in branches]
    head_cls = [classes.index(head_class(kw, vw, bits)) for kw, vw in zip(layout.k_widths, layout.v_widths)]
    groups = _launch_groups(classes, head_cls, launches)
    branch_of = [0] * heads  # each head's branch: its class's place among its launch's
    for members, group_classes in groups:
        for h in members:
            branch_of[h] = group_classes.index(head_cls[h])
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
        jnp.asarray(np.asarray(branch_of, np.int32)),  # each head's branch in its launch's kernel
        *[jnp.asarray(np.asarray(o, np.int32)) for o in offsets],
        jnp.asarray(_head_table(layout, page_bytes, group, bits)),
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
    heads_of = [members for members, _ in groups]
    kernels = [  # a launch's kernel: a branch a class it may meet, named after them (one: the class)
        (
            functools.partial(_kernel, branches=tuple(branches[c] for c in cs), units=heads, **static),
            name if launches == "layer" else f"{name}_{_group_name([classes[c] for c in cs])}",
        )
        for _, cs in groups
    ]
    lists = [_launch_work(stored, members, work, splits, len(heads_of)) for members in heads_of]
    # each launch's items in one buffer, from a multiple of 16 (``merge_items``' groups never cross launches)
    sizes = [_items(b * len(members), splits) for members in heads_of]
    starts = np.cumsum([0, *sizes])
    calls = [  # each launch's inputs: the layer's, then its dims (n, first item), heads and work list
        [*inputs, jnp.asarray([*dims, len(members), int(start)], jnp.int32), jnp.asarray(members, jnp.int32), w]
        for members, w, start in zip(heads_of, lists, starts)
    ]
    acc, m, l = _launches(kernels, calls, sizes, g, width, params, interpret)
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


def _launch_key(cls, launches: str):
    """Which launch a head of class ``cls`` joins under ``launches`` (heads of one key share a launch)."""
    return {"layer": (), "k-class": cls[0], "class": cls}[launches]


def _launch_groups(classes, head_cls, launches: str) -> list[tuple[list[int], list[int]]]:
    """The layer's launches, each (its heads, the indices of ``classes`` its kernel has a branch for): one a
    ``_launch_key`` the layer's heads have, in the order of their classes; a launch's branches are every class of
    the model (``classes``, sorted) with its key, so a launch of a key is the same kernel in every layer."""
    keys = [_launch_key(cls, launches) for cls in classes]
    out = []
    for key in dict.fromkeys(keys[c] for c in sorted(set(head_cls))):
        members = [h for h, c in enumerate(head_cls) if keys[c] == key]
        out.append((members, [c for c, k in enumerate(keys) if k == key]))
    return out


def _group_name(classes) -> str:
    """A launch's kernel in its name: its one class (``_class_name``), or the K class its branches share."""
    if len(classes) == 1:
        return _class_name(classes[0])
    kf, ks = classes[0][0]
    return f"k{kf[0]}{ks}"


def launch_heads(layout: HeadLayout, bits: int, launches: str = "k-class") -> tuple[int, ...]:
    """The KV-head counts n whose work lists (``live_work`` over B x n rows) ``quant_head_decode`` reads for
    ``layout`` at ``bits``: Hkv for one launch a layer, each K class's heads with a launch a K class, each class's
    with a launch a class (``launches``). The engine builds one a count a step, shared by every layer."""
    if launches not in LAUNCH_FORMS:
        raise ValueError(f"launches must be one of {LAUNCH_FORMS}, got {launches!r}")
    keys = [_launch_key(head_class(kw, vw, bits), launches) for kw, vw in zip(layout.k_widths, layout.v_widths)]
    return tuple(sorted({keys.count(k) for k in keys}))


def _list_of(work, n: int):
    """The work list for n heads a row from ``work``: None (build it), a mapping by n (the engine's), or an array
    (the one launch's, over Hkv)."""
    if work is None or not isinstance(work, dict):
        return work
    if n not in work:
        raise ValueError(f"work holds lists for {sorted(work)} heads a row; this launch needs {n} (launch_heads)")
    return work[n]


def _launch_work(stored, members, work, splits, launches: int):
    """A launch's work list over its heads' rows (B x len(members)): the engine's for that many heads (live slots,
    broadcast), else from the heads' stored counts. One list (not a mapping) serves only a layer's one launch."""
    if work is not None and not isinstance(work, dict) and launches > 1:
        raise ValueError("with a launch a class, work must map a head count to its list (launch_heads), not one list")
    return _work_of(stored[:, np.asarray(members)], _list_of(work, len(members)), splits)


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
