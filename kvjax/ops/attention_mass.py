"""What every query of a prompt gives each key, summed (Pallas, Triton lowering): the full-history eviction metrics
(H2O's accumulated attention, KV-Compress's squared form, Keyformer's Gumbel-softmax) without the [T, T]
probabilities ever in memory.

A key's mass for KV head h is the sum, over the query heads of h's group and the query rows that see it (causal, and
inside a sliding window if any), of each row's softmax weight on it (squared: KV-Compress, Rehg 2024, section 3.2;
plain: H2O, Zhang et al. 2023, section 3; of noisy scores: Keyformer, Adnan et al. 2024, section 3.3, the noise
hashed from the coordinates by ``ops.noise``). A row's weight needs its whole softmax denominator, so two passes run,
as flash attention's backward pass does: ``_lse_kernel`` (a program a block of query rows) streams the keys it
sees and keeps each row's running max and sum, then ``_mass_kernel`` (a program a block of keys) streams the query
rows that see its keys, recomputes their scores and adds up ``exp2(s - lse)``. A program takes one query head (the
group's heads are summed after) and each key block is one program's, so the sums need no atomics and come out the
same on every run. Both passes read q·k at the widths attention runs (ZACK's truncated heads, or a Palu latent
rebuilt by the caller); heads whose widths share a power-of-two tile share a call. The queries may be one prefill
chunk of each row (``starts``, ``lengths``): the engine adds each chunk's share to the prompt's sums.

``eviction.metrics.scores(kernel=True)`` and ``chunk_mass(kernel=True)`` run it; their jnp form is the reference
(tests/test_attention_mass.py). Cost: bench/results/eviction.md "Eviction on the H100 (2026-12-06)" (9.1x the jnp
form).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.layout import HeadLayout
from kvjax.ops import noise
from kvjax.ops.grouped import visible
from kvjax.ops.pallas_util import LOG2E, MASK, dot_precision, load_rows, whole_block
from kvjax.ops.tiles import tile

BLOCK_Q = 64  # query rows a step (the mass pass) or a program (the denominator pass)
BLOCK_K = 64  # keys a program (the mass pass) or a step (the denominator pass)


def attention_mass(
    q,
    k,
    layout: HeadLayout,
    *,
    starts=None,
    lengths=None,
    squared: bool = False,
    gumbel=None,
    lse=None,
    interpret: bool = False,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    num_warps: int = 4,
):
    """float32 [B, Hkv, S]: for each KV head and key, the softmax weight every query row that sees it gives it,
    summed over the rows and the group's query heads (each weight squared with ``squared``).

    q [B, T, q_cols] packed post-RoPE queries, k [B, S, k_cols] the keys attention reads (``layout``'s widths);
    scores are q·k / sqrt(head_dim), as ``ops.grouped.head_logits``. Without ``starts``, q and k are one whole
    prompt (T = S) and the result equals ``eviction.metrics.scores`` for ``h2o`` (plain) and ``kvcompress-full``
    (squared) to float32 rounding. With ``starts`` and ``lengths`` [B] (int32), q is one prefill chunk of each row:
    its first ``lengths[b]`` rows are positions ``starts[b]`` on, and k holds every key they may see (the chunk's own
    written; later slots, which causality hides, may hold anything finite): the chunk's share of the prompt's sum,
    ``eviction.metrics.chunk_mass``, which the engine adds up over a prompt's chunks. ``gumbel`` (seed, layer, tau):
    Keyformer's softmax instead, of (q·k + g) / tau with g ``metrics.gumbel_noise``'s draw for (seed, layer, query
    head, query position, key position), hashed in the kernel (``ops.noise``; the same bits as the jnp form).
    ``lse`` float32 [B, T, num_heads] (not with ``gumbel``): each row's log2 softmax denominator, as the prefill
    kernel gives it (``prefill_attention(lse=True)``), so only the second pass runs (half the work)."""
    b, t = q.shape[:2]
    s = k.shape[1]
    if starts is None:
        if t != s:
            raise ValueError(f"a whole prompt's queries and keys have one length, got {t} and {s}: give starts")
        starts, lengths = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)
    starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (b,))
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (b,))
    group, d = layout.group_size, layout.head_dim
    seed, layer, tau = gumbel if gumbel is not None else (0, 0, None)
    if lse is not None and gumbel is not None:
        raise ValueError("Keyformer's softmax is of noisy scores: attention's denominators are not its own")
    start_hash = noise.base(seed, layer).reshape(1)
    step = max(block_q, block_k)
    padded_q, padded_k = -(-t // step) * step, -(-s // step) * step
    q_off, k_off = HeadLayout.offsets(layout.k_widths, group), HeadLayout.offsets(layout.k_widths)
    by_tile: dict[int, list[int]] = {}  # heads whose widths share a power-of-two tile share a call
    for h, w in enumerate(layout.k_widths):
        by_tile.setdefault(tile(w), []).append(h)
    out: list = [None] * layout.num_kv_heads
    for wt, heads in by_tile.items():
        # [B, heads, G, T, tile]: each query head's rows, zero past its width (a zero column adds nothing to q·k)
        qh = jnp.stack([_padded(q, q_off[h], layout.k_widths[h], group, wt) for h in heads], 1)
        qh = jnp.pad(qh.transpose(0, 1, 3, 2, 4), ((0, 0), (0, 0), (0, 0), (0, padded_q - t), (0, 0))).reshape(-1)
        kh = jnp.stack([_padded(k, k_off[h], layout.k_widths[h], 1, wt)[:, :, 0] for h in heads], 1)
        kh = jnp.pad(kh, ((0, 0), (0, 0), (0, padded_k - s), (0, 0))).reshape(-1)  # [B, heads, S, tile]
        given = None
        if lse is not None:  # [B, heads, G, padded_q], as the first pass lays it out
            given = jnp.stack([lse[:, :, h * group : (h + 1) * group] for h in heads], 1).transpose(0, 1, 3, 2)
            given = jnp.pad(given.astype(jnp.float32), ((0, 0), (0, 0), (0, 0), (0, padded_q - t))).reshape(-1)
        got = _mass(
            starts,
            lengths,
            start_hash,
            jnp.asarray(heads, jnp.int32),
            qh,
            kh,
            given,
            programs=b * len(heads),
            group=group,
            tau=tau,
            per_batch=len(heads) * group,
            padded_q=padded_q,
            padded_k=padded_k,
            width=wt,
            scale=(1.0 / math.sqrt(d)) * LOG2E,  # as the prefill kernel scales: its denominators fit these scores
            window=layout.sliding_window,
            squared=squared,
            block_q=block_q,
            block_k=block_k,
            num_warps=num_warps,
            interpret=interpret,
        ).reshape(b, len(heads), padded_k)
        for j, h in enumerate(heads):
            out[h] = got[:, j, :s]
    return jnp.stack(out, axis=1)


def _padded(x, offset: int, width: int, count: int, wt: int):
    """``count`` heads of ``width`` columns from ``offset`` of packed rows x [B, S, cols], each zero-padded to ``wt``
    columns: [B, S, count, wt]."""
    b, s = x.shape[:2]
    heads = x[..., offset : offset + count * width].reshape(b, s, count, width)
    return jnp.pad(heads, ((0, 0), (0, 0), (0, 0), (0, wt - width)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "programs",
        "group",
        "per_batch",
        "tau",
        "padded_q",
        "padded_k",
        "width",
        "scale",
        "window",
        "squared",
        "block_q",
        "block_k",
        "num_warps",
        "interpret",
    ),
)
def _mass(
    starts,
    lengths,
    start_hash,
    kv_heads,
    qh,
    kh,
    lse,
    *,
    programs,
    group,
    per_batch,
    tau,
    padded_q,
    padded_k,
    width,
    scale,
    window,
    squared,
    block_q,
    block_k,
    num_warps,
    interpret,
):
    """Both passes over flat qh [programs, G, padded_q, width] and kh [programs, padded_k, width] (``per_batch``
    query heads a row of the batch), a program a query head and block: float32 [programs, padded_k], each key's mass
    summed over the group (0 where no real row sees it). ``kv_heads`` [per_batch / group]: the layout's KV head of
    each of a row's programs; ``start_hash`` [1] and ``tau`` (None: no noise): Keyformer's draws; ``lse`` [programs,
    G, padded_q] (None: the first pass computes it): each row's log2 denominator."""
    static = dict(
        group=group,
        per_batch=per_batch,
        tau=tau,
        padded_q=padded_q,
        padded_k=padded_k,
        width=width,
        scale=scale,
        window=window,
    )
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    heads = programs * group
    lse_shape = jax.ShapeDtypeStruct((heads * padded_q,), jnp.float32)
    scalars = [whole_block(x) for x in (starts, lengths, start_hash, kv_heads)]
    if lse is None:
        lse = pl.pallas_call(
            functools.partial(_lse_kernel, block_q=block_q, block_k=block_k, **static),
            grid=(heads, padded_q // block_q),
            in_specs=[*scalars, whole_block(qh), whole_block(kh)],
            out_specs=whole_block(lse_shape),
            out_shape=lse_shape,
            interpret=interpret,
            compiler_params=params,
            name="kvjax_attention_lse",
        )(starts, lengths, start_hash, kv_heads, qh, kh)
    mass_shape = jax.ShapeDtypeStruct((heads * padded_k,), jnp.float32)
    mass = pl.pallas_call(
        functools.partial(_mass_kernel, block_q=block_q, block_k=block_k, squared=squared, **static),
        grid=(heads, padded_k // block_k),
        in_specs=[*scalars, whole_block(qh), whole_block(kh), whole_block(lse)],
        out_specs=whole_block(mass_shape),
        out_shape=mass_shape,
        interpret=interpret,
        compiler_params=params,
        name="kvjax_attention_mass",
    )(starts, lengths, start_hash, kv_heads, qh, kh, lse)
    return mass.reshape(programs, group, padded_k).sum(axis=1)


def _queries(q_ref, head, rows, *, padded_q, width, scale):
    """Query head ``head``'s rows [rows, width], scaled to give scores in log2 units, in q's dtype (the same rounding
    in both passes, so each recomputed score is the one its denominator summed)."""
    q = load_rows(q_ref, head * padded_q + rows, width, 0, jnp.arange(width)[None, :])
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def _head_hash(h, hash_ref, heads_ref, group: int, per_batch: int):
    """Program h's query head (its layout number: its call's KV head times the group, plus its place in the group)
    hashed onto the (seed, layer) hash, as ``eviction.metrics.gumbel_noise`` orders them."""
    head = heads_ref[(h % per_batch) // group] * group + h % group
    return noise.mix(hash_ref[0] ^ head)


def _noisy(s, row_hash, keys, tau):
    """Scores ``s`` [R, K] (log2 units) as Keyformer's softmax takes them, (s + g) / tau with each (row, key)'s
    Gumbel draw g from the rows' hashes ``row_hash`` [R] and the key positions ``keys`` [K]; no noise: ``s``."""
    if tau is None:
        return s
    g = noise.gumbel(noise.mix(row_hash[:, None] ^ keys[None, :]))
    return (s + g * LOG2E) / tau


def _lse_kernel(
    starts_ref,
    lengths_ref,
    hash_ref,
    heads_ref,
    q_ref,
    k_ref,
    lse_ref,
    *,
    group,
    per_batch,
    tau,
    padded_q,
    padded_k,
    width,
    scale,
    window,
    block_q,
    block_k,
):
    """Program (h, i): chunk rows i * block_q ... of query head h (the (h // group)-th KV head's): log2 of each row's
    softmax denominator over the keys it sees. A block past the chunk's real rows reads nothing."""
    h, i = pl.program_id(0), pl.program_id(1)
    start, length = starts_ref[h // per_batch], lengths_ref[h // per_batch]
    local = i * block_q + jnp.arange(block_q)
    rows = start + local  # positions in the prompt
    cols = jnp.arange(width)[None, :]
    precision = dot_precision(q_ref.dtype)
    q = _queries(q_ref, h, local, padded_q=padded_q, width=width, scale=scale)
    row_hash = None if tau is None else noise.mix(_head_hash(h, hash_ref, heads_ref, group, per_batch) ^ rows)

    def body(j, carry, masked):
        m, l = carry
        keys = j * block_k + jnp.arange(block_k)
        k = load_rows(k_ref, (h // group) * padded_k + keys, width, 0, cols)
        s = _noisy(plgpu.dot(q, k, trans_b=True, precision=precision), row_hash, keys, tau)
        if masked:
            s = jnp.where(visible(rows[:, None], keys[None, :], window), s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        return m_new, l * jnp.exp2(m - m_new) + jnp.exp2(s - m_new[:, None]).sum(axis=1)

    # the keys up to the block's last real row; none for a block of padding rows
    last = jnp.where(i * block_q < length, pl.cdiv(start + jnp.minimum((i + 1) * block_q, length), block_k), 0)
    carry = (jnp.full((block_q,), MASK, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    if window:  # the window's lower edge cuts into blocks too: every step masked
        first = jnp.maximum(start + i * block_q - window + 1, 0) // block_k
        m, l = lax.fori_loop(first, jnp.maximum(last, first), functools.partial(body, masked=True), carry)
    else:  # key blocks every row sees whole (at or before the block's first position) skip the mask
        whole = jnp.clip((start + i * block_q + 1) // block_k, 0, last)
        carry = lax.fori_loop(0, whole, functools.partial(body, masked=False), carry)
        m, l = lax.fori_loop(whole, jnp.maximum(last, whole), functools.partial(body, masked=True), carry)
    # every real row sees its own key, so l > 0; the guard only keeps log2 finite in padding rows
    plgpu.store(lse_ref.at[h * padded_q + local], m + jnp.log2(jnp.where(l > 0, l, 1.0)))


def _mass_kernel(
    starts_ref,
    lengths_ref,
    hash_ref,
    heads_ref,
    q_ref,
    k_ref,
    lse_ref,
    out_ref,
    *,
    group,
    per_batch,
    tau,
    padded_q,
    padded_k,
    width,
    scale,
    window,
    squared,
    block_q,
    block_k,
):
    """Program (h, j): keys j * block_k ... of query head h's KV head, the weight each of h's real chunk rows that
    sees them gives them, summed over the rows (the group's heads are summed by the caller)."""
    h, j = pl.program_id(0), pl.program_id(1)
    start, length = starts_ref[h // per_batch], lengths_ref[h // per_batch]
    keys = j * block_k + jnp.arange(block_k)
    precision = dot_precision(q_ref.dtype)
    k = load_rows(k_ref, (h // group) * padded_k + keys, width, 0, jnp.arange(width)[None, :])
    head_hash = None if tau is None else _head_hash(h, hash_ref, heads_ref, group, per_batch)

    def body(i, total, masked):
        local = i * block_q + jnp.arange(block_q)
        q = _queries(q_ref, h, local, padded_q=padded_q, width=width, scale=scale)
        lse = plgpu.load(lse_ref.at[h * padded_q + local])
        row_hash = None if tau is None else noise.mix(head_hash ^ (start + local))
        s = _noisy(plgpu.dot(q, k, trans_b=True, precision=precision), row_hash, keys, tau)
        p = jnp.exp2(s - lse[:, None])
        if masked:
            seen = visible(start + local[:, None], keys[None, :], window) & (local < length)[:, None]
            p = jnp.where(seen, p, 0.0)
        return total + (p * p if squared else p).sum(axis=0)

    first = jnp.maximum(j * block_k - start, 0) // block_q  # the first chunk rows that can see these keys (causal)
    end = jnp.minimum((j + 1) * block_k - 1 + window - start, length) if window else length
    end = jnp.maximum(pl.cdiv(end, block_q), first)
    total = jnp.zeros((block_k,), jnp.float32)
    if window:  # rows past the window's edge stop seeing these keys: every step masked
        total = lax.fori_loop(first, end, functools.partial(body, masked=True), total)
    else:  # row blocks that see every key whole (at or after the last key, all real) skip the mask
        below = jnp.clip(pl.cdiv((j + 1) * block_k - 1 - start, block_q), first, end)
        inside = jnp.minimum(jnp.maximum(length // block_q, below), end)
        total = lax.fori_loop(first, below, functools.partial(body, masked=True), total)
        total = lax.fori_loop(below, inside, functools.partial(body, masked=False), total)
        total = lax.fori_loop(inside, end, functools.partial(body, masked=True), total)
    plgpu.store(out_ref.at[h * padded_k + keys], total)
