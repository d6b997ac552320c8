"""The decode op's run step (Pallas, Triton lowering): paged attention of one new query per sequence over KV heads
of different widths. ``paged_decode`` equals ``reference.paged_decode_attention``.

One persistent program per row of the host-built ``schedule.DecodeSchedule`` walks its items (sequence, unit, chunk
of pages) with an online softmax and writes the output (a group's only chunk) or a partial that ``merge.merge``
combines. A unit is a run of adjacent KV heads in one padded tile, each score row masked to its own head's columns.
Widths and offsets come from the layer's tables at run time in multiples of 16, so layers whose runs fall in the same
classes run one compiled kernel (``tables.kernel_groups``). Where the time goes: bench/results/kernels.md "Decode:
where the time goes (Nsight Compute)".
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.ops import columns
from kvjax.ops.decode import tables
from kvjax.ops.decode.bands import band_queries
from kvjax.ops.decode.cost import ROWS
from kvjax.ops.decode.merge import merge
from kvjax.ops.decode.schedule import END_PAGE, FIRST_PAGE, SEQ, SLOT, UNIT, DecodeSchedule
from kvjax.ops.decode.tables import RunClass, folds, step_tokens
from kvjax.ops.pallas_util import LOG2E, MASK, dot_precision, load_rows, page_rows, store_rows, whole_block
from kvjax.ops.tiles import is_pow2, tile

BLOCK_H = ROWS  # query rows per item: a GQA group (G <= 8) padded to the tensor cores' smallest M
MIN_BAND = 16  # banded keys: a band's queries are G / W of its keys' bytes (Palu's kernel reads narrower bands)


def _class_pieces(tiles, exact: bool, last):
    """A class's pieces as (start, tile, columns): every piece full but the last, which is ``last`` columns wide
    (read from the unit table) unless every run of the class fills it (``exact``)."""
    starts = [sum(tiles[:i]) for i in range(len(tiles))]
    widths = [*tiles[:-1], tiles[-1] if exact else last]
    return tuple(zip(starts, tiles, widths))


def _cols_ok(t: int, width):
    """Which of a piece's ``t`` tile columns it owns; None when it fills its tile (the loads stay unmasked)."""
    return None if isinstance(width, int) and width == t else jnp.arange(t)[None, :] < width


def _attend_item(
    cls: RunClass, item, refs, *, group, page_size, window, scale, v_max, config, band, band_rows, interpret
):
    """Online-softmax attention of one item (its class's tiles are static; its widths and offsets come from the
    layer's tables) and the write of its result. With ``band``, each step reads its band's queries
    (``_item_queries``)."""
    units_ref, rows_ref, cols_ref, table_ref, q_ref, k_ref, v_ref = refs[:7]
    out_ref, acc_ref, m_ref, l_ref = refs[-4:]
    seq, unit, first, end, slot, length = item

    def unit_field(f):
        return units_ref[unit * tables.UNIT_FIELDS + f] * columns.UNIT

    # real rows of the score tile (head i of the run has rows i*G .. i*G+G-1): static where the class folds
    heads = cls.num_heads or units_ref[unit * tables.UNIT_FIELDS + tables.HEADS]
    run_rows = heads * group

    qo, ko, vo, oo = (unit_field(f) for f in (tables.Q_OFF, tables.K_OFF, tables.V_OFF, tables.O_OFF))
    q_cols, k_cols, v_cols, o_cols = columns.read_widths(cols_ref)
    k_pieces = _class_pieces(cls.k_tiles, cls.k_exact, unit_field(tables.K_LAST))
    v_pieces = _class_pieces(cls.v_tiles, cls.v_exact, unit_field(tables.V_LAST))
    kt, vt = cls.k_cols, cls.v_cols
    bt = step_tokens(kt, vt, config)
    nf = folds(run_rows, kt, bt, config.fold_tokens) if cls.num_heads else 1
    bc = bt // nf  # tokens per chunk
    precision = dot_precision(k_ref.dtype)

    rows = jnp.arange(BLOCK_H)
    chunk_of_row = (rows // run_rows)[:, None]
    run_row = rows % run_rows

    def row_field(f):  # [BLOCK_H, 1]: the field for each row's head and query
        return plgpu.load(rows_ref.at[(unit * tables.ROW_FIELDS + f) * BLOCK_H + run_row])[:, None] * columns.UNIT

    k_start, k_width, v_start, v_width, q_row, o_row = (row_field(f) for f in range(tables.ROW_FIELDS))
    seqs = jnp.full((BLOCK_H,), seq)

    def fold(x, c):  # rows of chunk c kept, the others zeroed
        return x if nf == 1 else jnp.where(chunk_of_row == c, x, 0).astype(x.dtype)

    def q_cols_ok(start, t):  # [BLOCK_H, t]: the columns of the row's own head, in the rows that hold queries
        cols = start + jnp.arange(t)[None, :]
        return (rows[:, None] < nf * run_rows) & (cols >= k_start) & (cols < k_start + k_width)

    lo, hi, visible_from = _token_span(first * page_size, end * page_size, length, window, bt if band else 0)
    queries = _item_queries(
        q_ref,
        (seqs, q_cols, qo + q_row),
        pieces=k_pieces,
        cols_ok=q_cols_ok,
        folds=[functools.partial(fold, c=c) for c in range(nf)],
        factor=scale * LOG2E,
        band=band and (band, chunk_of_row * bc, bc, length),
        band_rows=band_rows,
    )

    def load_chunk(tok, masked):
        """K and V pieces [bc, tile] of tokens ``tok`` through the block table, and which of them are visible."""
        valid = (tok < hi) & (tok >= visible_from) if masked else None
        row = page_rows(table_ref, seq, tok, page_size, valid)
        ks = [
            load_rows(k_ref, row, k_cols, ko + a, jnp.arange(t)[None, :], _cols_ok(t, w), valid) for a, t, w in k_pieces
        ]
        vs = [
            load_rows(v_ref, row, v_cols, vo + a, jnp.arange(t)[None, :], _cols_ok(t, w), valid) for a, t, w in v_pieces
        ]
        return ks, vs, valid

    def step(j, carry, masked):
        accs, m, l = carry
        chunks = [load_chunk(lo + j * bt + c * bc + jnp.arange(bc), masked) for c in range(nf)]
        subs = queries(lo + j * bt)  # [sub-band][piece][fold]
        s = functools.reduce(
            operator.add,
            [_in_sub_band(_scores(qs, chunks, precision), i, len(subs), bc) for i, qs in enumerate(subs)],
        )
        if masked:
            visible = functools.reduce(
                operator.or_, [(chunk_of_row == c) & valid[None, :] for c, (_, _, valid) in enumerate(chunks)]
            )
            s = jnp.where(visible, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        pv = p.astype(k_ref.dtype)
        p_folds = [fold(pv, c) for c in range(nf)]
        accs = tuple(
            acc * alpha[:, None]
            + functools.reduce(
                operator.add, [plgpu.dot(pf, vs[i], precision=precision) for pf, (_, vs, _) in zip(p_folds, chunks)]
            )
            for i, acc in enumerate(accs)
        )
        return accs, m_new, l * alpha + p.sum(axis=1)

    carry = (
        tuple(jnp.zeros((BLOCK_H, t), jnp.float32) for _, t, _ in v_pieces),
        jnp.full((BLOCK_H,), MASK, jnp.float32),
        jnp.zeros((BLOCK_H,), jnp.float32),
    )
    unmasked = config.unmasked_steps and not window and not band
    accs, m, l = _token_steps(step, carry, jnp.maximum(hi - lo, 0), bt, unmasked)
    if nf > 1:
        accs, m, l = _unfold(accs, m, l, run_rows, nf)

    out_at = (seqs, o_cols, oo + o_row, v_start, v_width)
    _store_result(accs, m, l, slot, run_rows, v_pieces, out_at, (out_ref, acc_ref, m_ref, l_ref), v_max, interpret)


def _token_span(lo, end, length, window: int, align: int):
    """(first token of the first step, end of the item's tokens, first visible token) of an item over tokens
    [lo, end) of a sequence of ``length``. ``align``: steps start at multiples of it, the step's tokens (banded
    keys: so a chunk narrower than a band lies in one, and a wider one starts at a band's edge), the tokens before
    ``lo`` in the first step masked."""
    hi = jnp.minimum(end, length)
    visible_from = jnp.maximum(length - window, 0) if window else 0
    if align:
        return lo // align * align, hi, jnp.maximum(visible_from, lo)
    return lo, hi, visible_from


def _scores(qs, chunks, precision):
    """[BLOCK_H, chunk]: each row's chunk of K (``chunks``: per fold, its K pieces first) scored by queries
    [piece][fold]."""
    return functools.reduce(
        operator.add,
        [
            plgpu.dot(qs[i][c], k, trans_b=True, precision=precision)
            for c, (ks, *_) in enumerate(chunks)
            for i, k in enumerate(ks)
        ],
    )


def _in_sub_band(s, sub: int, subs: int, chunk: int):
    """A chunk's scores ``s`` [BLOCK_H, chunk] kept in the columns of its ``sub``-th of ``subs`` equal bands."""
    return s if subs == 1 else jnp.where((jnp.arange(chunk) // (chunk // subs) == sub)[None, :], s, 0.0)


def _item_queries(q_ref, at, *, pieces, cols_ok, folds, factor, band, band_rows):
    """The function that gives a step of an item its queries [sub-band][piece][fold] from its first token (q at
    ``at``: rows, row width, offsets), each masked to its row's own head (``cols_ok``). Without a band, the row's
    packed or wide query, loaded once and scaled (``factor``) for log2 scores.

    With ``band`` (its width, each row's chunk offset in a step [BLOCK_H, 1], the chunk's tokens and the sequence's
    length) and ``band_rows`` (the batch and the bands of q, ``bands.band_queries``' rows, already scaled: band b
    of sequence s in row b * batch + s), each step loads each row's packed query of its chunk's band, fold c's rows
    alone (the others zero) so the loads feed the dots as they are; a chunk wider than the band loads one a band in
    it (its sub-bands). A chunk past the sequence's last band (its tokens all masked) reads the last band's queries,
    so no row ``band_queries`` left unwritten is read."""
    seqs, q_cols, q_at = at
    if not band:
        loaded = []
        for start, t, _ in pieces:
            q = load_rows(q_ref, seqs, q_cols, q_at, start + jnp.arange(t)[None, :], cols_ok(start, t))
            q = (q.astype(jnp.float32) * factor).astype(q.dtype)
            loaded.append([fold(q) for fold in folds])
        return lambda _: [loaded]
    width, row_offset, chunk, length = band
    batch, bands = band_rows
    fold_of = row_offset[:, 0] // chunk
    last = jnp.minimum(jnp.maximum(length - 1, 0) // width, bands - 1)  # bands past it were not made

    def read(first):
        out = []
        for sub in range(max(1, chunk // width)):
            rows = jnp.minimum((first + row_offset[:, 0] + sub * width) // width, last) * batch + seqs
            by_piece = []
            for a, t, _ in pieces:
                cols, ok = a + jnp.arange(t)[None, :], cols_ok(a, t)
                by_piece.append(
                    [load_rows(q_ref, rows, q_cols, q_at, cols, ok, fold_of == c) for c in range(len(folds))]
                )
            out.append(by_piece)
        return out

    return read


def _token_steps(step, carry, span, bt, unmasked):
    """Run ``step`` over the ``span`` tokens of an item, ``bt`` a step; ``unmasked``: the steps with every token
    visible first, in a loop of their own without masks (twice the loop code, so twice the compile time)."""
    full = span // bt if unmasked else 0
    if unmasked:
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full, pl.cdiv(span, bt), functools.partial(step, masked=True), carry)


def _store_result(accs, m, l, slot, run_rows, v_pieces, out_at, refs, v_max, interpret):
    """The group's only chunk (``slot`` < 0) writes its normalized output rows at ``out_at`` (rows, row width,
    offsets, each row's V start and width); a chunk of a split group writes its partial state to its slot.

    Masked lanes of the 1-D m and l stores point past the buffer: the GPU never touches them, and interpret mode
    drops them rather than letting a masked lane's write-back collide with a real lane's store."""
    out_ref, acc_ref, m_ref, l_ref = refs
    seqs, o_cols, o_offset, v_start, v_width = out_at
    rows = jnp.arange(BLOCK_H)
    direct = slot < 0
    part = jnp.maximum(slot, 0) * BLOCK_H + rows
    part_mask = (rows < run_rows) & ~direct
    part = jnp.where(part_mask, part, m_ref.shape[0])
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    for acc, (a, t, w) in zip(accs, v_pieces):
        cols = a + jnp.arange(t)[None, :]  # the run's V columns
        out_mask = (rows[:, None] < run_rows) & (cols >= v_start) & (cols < v_start + v_width) & direct
        store_rows(out_ref, seqs, o_cols, o_offset, cols, acc * inv_l[:, None], out_mask, interpret=interpret)
        store_rows(acc_ref, part, v_max, a, jnp.arange(t)[None, :], acc, _cols_ok(t, w), part_mask, interpret=interpret)
    plgpu.store(m_ref.at[part], m, mask=part_mask)
    plgpu.store(l_ref.at[part], l, mask=part_mask)


def _unfold(accs, m, l, group, nf):
    """Merge the softmax states of the folds: row ``c*G + g`` into row ``g`` (rows past G are left undefined)."""
    r = jnp.arange(BLOCK_H)
    head_of_row, real = r % group, r < nf * group
    m_head = jnp.full((BLOCK_H,), MASK, jnp.float32)
    for g in range(group):
        m_head = jnp.where(head_of_row == g, jnp.max(jnp.where(real & (head_of_row == g), m, MASK)), m_head)
    w = jnp.where(real, jnp.exp2(m - m_head), 0.0)
    l_head = jnp.zeros((BLOCK_H,), jnp.float32)
    for g in range(group):
        l_head = jnp.where(head_of_row == g, jnp.sum(jnp.where(head_of_row == g, l * w, 0.0)), l_head)
    same_head = (head_of_row[:, None] == head_of_row[None, :]).astype(jnp.float32)
    accs = tuple(plgpu.dot(same_head, acc * w[:, None], precision=lax.Precision.HIGHEST) for acc in accs)
    return accs, m_head, l_head


def _kernel(index_ref, items_ref, counts_ref, lengths_ref, *refs, classes, **static):
    pid, layer = pl.program_id(0), index_ref[0]
    units_ref = refs[0]
    branches = [functools.partial(_attend_item, cls, refs=refs, **static) for cls in classes]

    def run(i, carry):
        seq, unit = items_ref[layer, pid, i, SEQ], items_ref[layer, pid, i, UNIT]
        item = (
            seq,
            unit,
            items_ref[layer, pid, i, FIRST_PAGE],
            items_ref[layer, pid, i, END_PAGE],
            items_ref[layer, pid, i, SLOT],
            lengths_ref[seq],
        )
        if len(branches) == 1:
            branches[0](item)
        else:
            cls = units_ref[unit * tables.UNIT_FIELDS + tables.CLASS]
            lax.switch(cls, [lambda it, b=b: b(it) for b in branches], item)
        return carry

    lax.fori_loop(0, counts_ref[layer, pid], run, 0)


@functools.partial(jax.jit, static_argnames=("layout", "interpret", "shared", "band"))
def paged_decode(
    q,
    k_pages,
    v_pages,
    block_table,
    lengths,
    schedule: DecodeSchedule,
    layout: HeadLayout,
    *,
    interpret: bool = False,
    shared: tuple[HeadLayout, ...] | None = None,
    basis=None,
    inv_freq=None,
    band: int | None = None,
):
    """One new query per sequence against its paged cache; equal to ``reference.paged_decode_attention``.

    q [B, q_cols] packed, or wide [B, >= H, k_cols] (``models.rotation.QKRotation.wide``: row h is query head h on
    every packed K column; the kernel reads each head's own); k_pages [num_pages, page_size, k_cols], v_pages
    likewise; block_table [B, pages_per_seq] int32; lengths [B] int32 (the new token included); schedule: the
    ``DecodeSchedule`` of every layer, built for these lengths or any they do not exceed, set to this layer
    (``DecodeSchedule.layer``; its ``config`` says how units were cut and how the kernel runs). Returns
    [B, out_cols] in q's dtype. Rows with length 0 are unspecified. ``shared``: the layouts of every layer that
    runs these kernels (default: ``layout`` alone); their code depends on those, not on ``layout``, so XLA
    compiles one decode and one merge kernel for all of them (``tables``).

    Banded ZACK (``band``: its keys are cached in the frame of their band of ``band`` positions,
    ``models.latent.LatentK``): q is [B, H * head_dim], whole post-RoPE heads; ``basis`` [head_dim, k_cols] the
    layer's packed directions (``models.rotation.QKRotation.matrix``) and ``inv_freq`` [head_dim / 2] its RoPE
    frequencies. Every band's queries are made before the kernel (``bands.band_queries``, the bands each
    sequence reaches) and each step reads its band's (``_item_queries``). Equal to the reference with the layer's
    banded rebuild.
    """
    config = schedule.config
    shared = shared or (layout,)
    if layout not in shared:
        raise ValueError("layout must be one of the shared layouts")
    b = q.shape[0]
    num_pages, page_size, _ = k_pages.shape
    classes = tables.run_classes(shared, config)
    wide_rows = q.shape[1] if q.ndim == 3 else 0
    if wide_rows and (wide_rows < layout.num_heads or q.shape[2] != layout.k_cols):
        raise ValueError(f"a wide q must be [B, >= {layout.num_heads}, {layout.k_cols}], got {q.shape}")
    band_rows = None
    if band is not None:
        _check_banded(q, basis, inv_freq, band, layout)
        band_rows = (b, -(-block_table.shape[1] * page_size // band))
        scale = LOG2E / math.sqrt(layout.head_dim)
        q = band_queries(
            q,
            basis,
            inv_freq,
            band,
            layout,
            band_rows[1],
            scale,
            lengths=lengths,
            shared=shared,
            interpret=interpret,
            blocks=config.band_blocks,
            seqs=config.band_seqs,
        )
    layer = tables.layer_tables(layout, classes, config, tables.most_units(set(shared), config), wide_rows)
    units, rows_table, cols = (jnp.asarray(t) for t in (layer.units, layer.rows, layer.cols))
    v_max = max(c.v_cols for c in classes)  # partial rows hold a run's V tile columns
    kernel = functools.partial(
        _kernel,
        classes=classes,
        group=layout.group_size,
        page_size=page_size,
        window=layout.sliding_window,
        scale=1.0 / math.sqrt(layout.head_dim),
        v_max=v_max,
        config=config,
        band=band,
        band_rows=band_rows,
        interpret=interpret,
    )
    index = jnp.asarray(schedule.index, jnp.int32)
    args = [
        index,
        schedule.items,
        schedule.counts,
        lengths.astype(jnp.int32),
        units,
        rows_table,
        cols,
        block_table.astype(jnp.int32),
        q.reshape(-1),
        k_pages.reshape(-1),
        v_pages.reshape(-1),
    ]
    v_tile = max(tile(w) for lay in shared for w in lay.v_widths)
    out = launch_and_merge(
        kernel,
        args,
        schedule,
        jax.ShapeDtypeStruct((b * layout.out_cols,), q.dtype),
        (units, rows_table, cols),
        v_max=v_max,
        v_tile=v_tile,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="kvjax_paged_decode",
    )
    return out.reshape(b, layout.out_cols)


def _check_banded(q, basis, inv_freq, band: int, layout: HeadLayout) -> None:
    """A ValueError unless the banded inputs fit ``layout`` and the band the kernel."""
    d = layout.head_dim
    if q.ndim != 2 or q.shape[1] != layout.num_heads * d:
        raise ValueError(f"banded decode takes q as whole heads [B, {layout.num_heads * d}], got {q.shape}")
    if basis is None or basis.shape != (d, layout.k_cols) or inv_freq is None or len(inv_freq) != d // 2:
        raise ValueError(f"banded decode needs basis [{d}, {layout.k_cols}] and inv_freq [{d // 2}]")
    check_band(band)


def check_band(band) -> int:
    """``band`` if this kernel reads keys in bands of that many positions (a power of two, at least ``MIN_BAND``):
    else a ValueError, or a TypeError for a band that is no integer."""
    band = validate.integer("band", band)
    if not is_pow2(band, MIN_BAND):
        raise ValueError(f"band must be a power of two >= {MIN_BAND}, got {band}")
    return band


def launch_and_merge(kernel, args, schedule, out, merge_tables, *, v_max, v_tile, compiler_params, interpret, name):
    """Run a decode ``kernel`` on ``schedule``'s persistent programs (``args[0]`` its index; every input one whole
    flat block) writing the direct rows ``out`` (a ShapeDtypeStruct) and each partial slot's (acc, max, sum), a row
    per row of the score tile, then fold the split groups' partials into ``out`` (``merge.merge``, through the
    layer's ``merge_tables``: units, rows and cols of ``tables.layer_tables``). The bf16 and the quantized kernels
    both end so. ``kernel`` may be a list, run one after another on the same buffers (each later one takes them as
    inputs aliased to its outputs, after ``args``), each writing the rows of its own items: the quantized op runs a
    kernel a head class so, ``name`` then one name a kernel."""
    rows = BLOCK_H * schedule.num_slots
    out_shape = [
        out,
        jax.ShapeDtypeStruct((rows * v_max,), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
    ]
    buffers: list = []
    kernels = kernel if isinstance(kernel, (list, tuple)) else [kernel]
    names = [name] if isinstance(name, str) else list(name)
    if len(names) != len(kernels):
        raise ValueError(f"{len(names)} names for {len(kernels)} kernels")
    for k, kernel_name in zip(kernels, names):
        inputs = [*args, *buffers]
        buffers = pl.pallas_call(
            k,
            grid=(schedule.num_programs,),
            in_specs=[whole_block(x) for x in inputs],
            out_specs=[whole_block(x) for x in out_shape],
            out_shape=out_shape,
            input_output_aliases={len(args) + j: j for j in range(len(buffers))},
            interpret=interpret,
            compiler_params=compiler_params,
            name=kernel_name,
        )(*inputs)
    direct, acc, m, l = buffers
    units, rows_table, cols = merge_tables
    return merge(
        direct,
        acc,
        m,
        l,
        args[0],
        schedule.merge_dest,
        schedule.merge_range,
        units,
        rows_table,
        cols,
        v_max=v_max,
        v_tile=v_tile,
        interpret=interpret,
    )
