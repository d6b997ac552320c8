"""Jitted prefill-chunk and decode steps over a paged cache, and the device state between them.

The engine joins the model (which only calls ``attend``), the cache and the attention ops. It keeps every running
request's latest token on the device, one row per slot, so a decode step reads its inputs from the step before
without the host in between. Chunk shapes are bucketed to powers of two (rows and length), a decode step always
runs ``max_batch`` rows and the block table has a fixed width, so a new mix of requests rarely compiles a new step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pickle
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import machine, validate
from kvjax.compression.plan import check_kv_bits
from kvjax.eviction import metrics
from kvjax.eviction.continual import compress, compress_groups
from kvjax.eviction.prompt import accumulate, evict_prompts, select_prompts
from kvjax.eviction.select import Eviction, compacted
from kvjax.io.saved import restore_sharded
from kvjax.ops import attention, head_paging, quant_head_paging
from kvjax.ops.decode.gear_kernel import GearDecodeOp
from kvjax.ops.decode.head_kernel import live_work
from kvjax.ops.decode.kernel import MIN_BAND
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.quant_head_kernel import launch_heads
from kvjax.ops.grouped import full_width
from kvjax.ops.kv_schemes import AnyPageFormat, label, page_format, served
from kvjax.ops.paging import NULL_PAGE
from kvjax.ops.pallas_util import width_pairs
from kvjax.ops.palu import PaluDecodeOp
from kvjax.ops.prefill.op import PrefillOp
from kvjax.ops.quant import PageFormat
from kvjax.ops.tiles import is_pow2, pow2_ceil
from kvjax.parallel import forward
from kvjax.parallel.forward import local_heads, shard
from kvjax.parallel.shards import padded_imbalance
from kvjax.runtime import memory, step_cache
from kvjax.runtime.cache import (
    EvictingCache,
    HeadKVCache,
    PagedKVCache,
    QuantizedKVCache,
    block_table,
    bytes_per_token,
    pool_of,
    pool_windows,
    token_bytes,
    window_span,
)
from kvjax.runtime.config import EngineConfig

# XLA merges dots that share an operand when each weighs under a threshold (32 MB) by concatenating their weights,
# which are step inputs here, so a compressed layer's narrower K and V projections had Q, K and V copied into one
# matrix at every step (0.6 ms of a 10 ms step: bench/results/engine.md "Engine: decode step beside the floor"); the
# model now holds them joined once (``Transformer.join``). XLA's Triton GEMMs are off: cuBLAS ran the steps' GEMMs
# faster and compiled without autotuning tiles for every distinct shape of a compressed model's projections
# (bench/results/engine.md "Engine: GEMMs on cuBLAS"). cuBLAS's own algorithm autotuning is off too (level 0, its
# heuristic's pick): the steps run as fast or faster without it, and a compressed model, a GEMM shape per layer,
# compiles its steps ahead in 39 s instead of 58-97 s (bench/results/startup.md "Start-up: GEMM autotuning off").
COMPILER_OPTIONS = {
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_autotune_level": 0,
}


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), capped at ``maximum``."""
    size = max(minimum, pow2_ceil(n))
    return size if maximum is None else min(size, maximum)


def _jit(step, *, mesh, args: int, returns: tuple[bool, ...] | bool, cache: int = 1):
    """A step ``step(weights, cache, *inputs)`` (or ``step(cache, *inputs)``: ``cache=0``) jitted with the cache
    donated (updated in place); with a ``mesh`` (tensor parallelism) run inside one ``shard_map``
    (``forward.spmd``): the weights and cache per device, the other inputs (``args`` in all) the same everywhere,
    ``returns`` flagging the per-device outputs (the cache)."""
    if mesh is not None:
        stacked = (True,) * (cache + 1) + (False,) * (args - cache - 1)
        step = forward.spmd(step, mesh, stacked=stacked, returns=returns)
    return jax.jit(step, donate_argnums=(cache,), compiler_options=COMPILER_OPTIONS)


def _unjitted(step) -> Callable:
    """What a step of ``_jit`` traces: its function before ``jax.jit`` (for ``step_cache``, which jits its own)."""
    return step.__wrapped__


def _hidden(module, tokens, positions, attend, vocab: int | None) -> jax.Array:
    """The model's final hidden states: ``Transformer.hidden``, or under tensor parallelism (``vocab``: the whole
    vocabulary's size) a device's share of the forward joined by all-reduces (``forward.hidden``)."""
    if vocab is None:
        return module.hidden(tokens, positions, attend)
    return forward.hidden(module, tokens, positions, attend)


def _logits(module, hidden, vocab: int | None) -> jax.Array:
    """float32 logits of the whole vocabulary: ``Transformer.logits``, or the devices' shares gathered."""
    return module.logits(hidden) if vocab is None else forward.gathered_logits(module, hidden, vocab)


def prefill_groups(lengths, limit: int, min_length: int = 1, max_rows: int | None = None) -> list[list[int]]:
    """Chunks (given by their lengths) grouped into prefill calls, longest first, so that each call's padded rows x
    length (each a power of two, the length at least ``min_length``) stays within ``limit`` tokens and its rows
    within ``max_rows``: prefill activations are bounded by the step's chunk budget, not by how many requests
    share the step."""
    calls: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = calls and (max_rows is None or len(calls[-1]) < max_rows)
        if fits and bucket(len(calls[-1]) + 1) * bucket(lengths[calls[-1][0]], min_length) <= limit:
            calls[-1].append(i)
        else:
            calls.append([i])
    return calls


@dataclasses.dataclass
class Rows:
    """Per-row inputs of a step, host side: where each row's pages are and how it samples."""

    table: np.ndarray  # int32 [pools, rows, pages_per_seq]: each page pool's block table
    seeds: np.ndarray  # uint32 [rows, 2]: the request's seed as two words
    streams: np.ndarray  # int32 [rows]
    counters: np.ndarray  # int32 [rows]: index of the token sampled
    temperature: np.ndarray  # float32 [rows]; 0 is greedy
    top_p: np.ndarray  # float32 [rows]

    @classmethod
    def empty(cls, rows: int, pages_per_seq: int, pools: int = 1) -> Rows:
        return cls(
            np.stack([block_table([[]] * rows, pages_per_seq)] * pools),
            np.zeros((rows, 2), np.uint32),
            np.zeros(rows, np.int32),
            np.zeros(rows, np.int32),
            np.zeros(rows, np.float32),
            np.ones(rows, np.float32),
        )

    def set(self, row: int, pages, seed: int, stream: int, counter: int, temperature: float, top_p: float) -> None:
        """Row ``row``'s inputs; ``pages``: its page numbers in each pool, by logical page."""
        if len(pages) != self.table.shape[0]:
            raise ValueError(f"pages for {len(pages)} pools, the cache has {self.table.shape[0]}")
        self.table[:, row] = block_table([list(p) for p in pages], self.table.shape[2])
        self.seeds[row] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
        self.streams[row], self.counters[row] = stream, counter
        self.temperature[row], self.top_p[row] = temperature, top_p

    @property
    def greedy(self) -> bool:
        return not self.temperature.any()

    def sampling(self) -> tuple:
        return self.seeds, self.streams, self.counters, self.temperature, self.top_p


def sample(logits: jax.Array, seeds, streams, counters, temperature, top_p, greedy: bool) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V]: argmax where a row's temperature is 0, else temperature +
    nucleus (top-p) sampling; row i draws from its request's (seed, stream) folded with its token index alone, so
    a request samples the same whatever runs beside it."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return best
    keys = jax.vmap(lambda s, a, c: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(s), a), c))(
        seeds, streams, counters
    )
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]  # always keeps the most likely token
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.where(scaled >= threshold, scaled, -jnp.inf))
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), best)


def _prefill_step(
    graphdef,
    structure,
    weights,
    cache,
    slot_tokens,
    tokens,
    starts,
    lengths,
    table,
    slots,
    tail_rows,
    sampling,
    evicting,
    *,
    greedy,
    op,
    prefix,
    pools,
    formats,
    evict,
    vocab,
    history=None,
):
    """Run prompt chunks [B, T] (chunk b from position ``starts[b]``, ``lengths[b]`` tokens) through the model,
    writing their K/V; the token sampled after each chunk's last row goes to its ``slots`` row (a row past the end:
    nowhere, the chunk does not end its prompt). ``prefix`` False: every chunk starts at 0, and attention reads no
    pages (a kernel without the prefix loop, which compiles faster). ``pools``: each layer's page pool, the index
    of its block table in ``table``. ``formats`` (quantized caches): each layer's page format; the chunks continue
    the tails of rows ``tail_rows`` (their requests' slots). ``evict`` (an evicting engine's call in which chunks end
    their prompts; ``_Evict``): those prompts are evicted into per-head pages after the model has run
    (``_evicted``; ``evicting``: its inputs). ``vocab`` (tensor parallelism): the vocabulary's size, the step one
    device's share (``_hidden``). ``history`` (an evicting engine's full-history policy): every call adds what its
    chunks' queries give their keys to the cache's ``mass`` (``eviction.prompt.accumulate``; through the mass kernel
    where ``op`` runs kernels, its first pass the prefill kernel's denominators)."""
    module = nnx.merge(graphdef, jax.tree.unflatten(structure, weights))
    b, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    staging = cache.staging if isinstance(cache, EvictingCache) else cache
    ks, vs = _layers(staging)
    queries = []
    mass = cache.mass if isinstance(cache, EvictingCache) else None
    # the prefill kernel's softmax denominators serve the mass kernel's second pass (Keyformer's are of noisy scores)
    reuse = history is not None and op is not None and history.method != "keyformer"

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if evict is not None:
            queries.append(_last_queries(q, k, rotation, lengths, evict.spec.window))
        lay, pages, prefix_from = module.layouts[i], table[pools[i]], starts if prefix else None
        if formats is None:
            got = attention.prefill(
                q, k, v, lay, ks[i], vs[i], pages, lengths, prefix_from, op=op, rebuild=rebuild, rotation=rotation,
                lse=reuse,
            )  # fmt: skip
            out, ks[i], vs[i] = got[:3]
            if history is not None:
                nonlocal mass
                packed = q if rotation is None else rotation.packed(q, k)[0]
                keys = ks[i][pages].reshape(b, -1, lay.k_cols)
                kw = dict(kernel=op is not None, lse=got[3] if reuse else None)
                mass = accumulate(mass, i, history, packed, keys, pages, starts, lengths, lay, **kw)
        else:
            out, ks[i], vs[i] = attention.prefill_quantized(
                q, k, v, lay, ks[i], vs[i], formats[i], pages, tail_rows, lengths, prefix_from, op=op, rotation=rotation
            )
        return out

    hidden = _hidden(module, tokens, positions, attend, vocab)
    new = sample(_logits(module, hidden[jnp.arange(b), lengths - 1], vocab), *sampling, greedy=greedy)
    staged = _rebuilt(staging, ks, vs)
    if not isinstance(cache, EvictingCache):
        return slot_tokens.at[slots].set(new, mode="drop"), new, staged, None
    heads, kept = cache.heads, None
    if evict is not None:
        heads, kept = _evicted(evict, heads, queries, staged, table[0], slots, *evicting, module.layouts, mass=mass)
    return slot_tokens.at[slots].set(new, mode="drop"), new, EvictingCache(staged, heads, mass), kept


@dataclasses.dataclass(frozen=True)
class _Evict:
    """An evicting engine's static settings for its steps: the policy, the per-head pool's page (elements), the
    attention backend of its decode and the kernel's schedule (``DecodeConfig.head_schedule``); ``sharded``: its
    steps run a device's share, their per-head inputs from the host over every device's heads
    (``forward.local_heads``)."""

    spec: Eviction
    page_elems: int
    backend: str
    schedule: str
    sharded: bool = False  # tensor parallelism: the per-head arrays hold this device's heads (host ones: every head's)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window where it can pass a stored token, else None
    bits: int | None = None  # quantized per-head pages (``ops.quant_head_paging``; ``page_elems`` their bytes)
    group: int = 0  # with ``bits``: the slots a quantized group covers (the engine's page size)
    tokens: int = 0  # with ``bits``: the most slots a head stores (``max_seq_len``), what its jnp decode reads
    pairs: tuple = ()  # with ``bits``: every layer's (K, V) width pairs: the decode kernel's classes
    launches: str = "k-class"  # with ``bits``: the decode kernel's launches (``DecodeConfig.quant_head_launches``)

    @property
    def history(self) -> Eviction | None:
        """The policy where it scores with every query (its prefill steps accumulate ``EvictingCache.mass``), else
        None (the observation-window methods: a prompt's last queries)."""
        return None if self.spec.method in metrics.WINDOWED else self.spec

    @property
    def decoded(self) -> bool:
        """Whether decode adds to each stored slot's sum (``HeadKVCache.sums``; ``metrics.DECODED``: H2O,
        KV-Compress's full form, Keyformer), which continual eviction then ranks a head's slots by; not on quantized
        pages, whose cuts score by the last queries only (``continual.compress_groups``)."""
        return self.spec.method in metrics.DECODED and self.bits is None

    @property
    def widest(self) -> int:
        """The widest of ``windows`` (0: none): the last axis of ``HeadKVCache.before`` is one more."""
        return max(w or 0 for w in self.windows)


def _last_queries(q, k, rotation, lengths, window: int):
    """Each chunk's last ``window`` queries [B, W, q_cols], packed as the cache is (ZACK's rotated, truncated ones):
    what ``metrics.window_scores`` scores a prompt's keys with. Rows before a chunk's first are clipped to it; the
    scheduler ends every prompt with a chunk of at least ``window`` tokens (or the whole prompt), so clipped rows lie
    before position 0 and are ignored."""
    rows = jnp.clip(lengths[:, None] - window + jnp.arange(window)[None, :], 0, None)[..., None]
    q = jnp.take_along_axis(q, rows, axis=1)
    if rotation is not None:  # only the window's rows: the chunk's are packed by the attention
        q, _ = rotation.packed(q, jnp.take_along_axis(k, rows, axis=1))
    return q


def _evicted(
    evict: _Evict,
    heads: HeadKVCache,
    queries,
    staged,
    seq_table,
    slots,
    head_tables,
    prompts,
    per_head,
    protect,
    layouts,
    mass=None,
):
    """The call's ending prompts evicted from their staging pages into per-head pages (``evict_prompts``): rows with
    a ``slots`` entry take their ``head_tables`` (the host's ``HeadPages`` tables, grown by the whole prompt), their
    kept counts and, for sliding-window layers, where each head's window starts (``head_paging.window_before``) into
    that slot; other rows have null head tables and write nothing. ``mass``: the full-history methods' scores so
    far (``EvictingCache.mass``), whose survivors' sums go to ``HeadKVCache.sums`` in slot order where decode adds to
    them. Returns (heads, kept [B, L, Hkv])."""
    if evict.sharded:
        head_tables = local_heads(head_tables, 2)
    tails = heads.tails
    if evict.bits is None:
        pool, kept, keep, scores = evict_prompts(
            evict.spec,
            queries,
            staged.k,
            staged.v,
            seq_table,
            prompts,
            (per_head, protect),
            layouts,
            heads.pool,
            head_tables,
            evict.page_elems,
            sharded=evict.sharded,
            mass=mass,
        )
    else:  # the survivors' full groups quantized, each head's partial group to its slot's tail
        sizes = (per_head, protect)
        keep, scores = select_prompts(
            evict.spec, queries, staged.k, seq_table, prompts, sizes, layouts, evict.sharded, mass=mass
        )
        pool, tails, kept = quant_head_paging.admit(
            heads.pool,
            tails,
            head_tables,
            slots,
            staged.k,
            staged.v,
            seq_table,
            keep,
            layouts,
            evict.page_elems,
            evict.group,
            evict.bits,
        )
    tables = heads.tables.at[slots].set(head_tables, mode="drop")
    stored = heads.stored.at[slots].set(kept, mode="drop")
    before = heads.before
    if any(evict.windows):
        assert before is not None  # HeadKVCache.create makes it
        got = head_paging.window_before(keep, prompts, evict.windows, before.shape[-1] - 1)
        before = before.at[slots].set(got, mode="drop")
    w = evict.spec.window
    ring_rows = (prompts[:, None] - w + jnp.arange(w)[None, :]) % w  # position p's query in row p % W
    rings = tuple(
        ring.at[slots[:, None], ring_rows].set(q.astype(ring.dtype), mode="drop")
        for ring, q in zip(heads.queries, queries)
    )
    heads = HeadKVCache(pool, tables, stored, rings, before, heads.sums, tails)
    if heads.sums is not None:  # each survivor's prompt sum, in the slot its K and V moved to
        heads = heads.with_slot_sums(slots, compacted(scores, keep, heads.sums[0].shape[-1]))
    return heads, kept


def _compress_step(cache, slot, last, target, *, evict: _Evict, layouts, tokens: int):
    """Continual eviction of slot ``slot``: each of its KV heads cut to ``target`` [L, Hkv] tokens
    (``continual.halved``, which the host's pages already shrank to), scored by the slot's last W queries, the
    latest at position ``last`` (or, where decode keeps them, by its slots' sums: ``HeadKVCache.sums``, moved with
    the survivors), and compacted in place (``continual.compress``; sliding-window layers untouched)."""
    heads, w = cache.heads, evict.spec.window
    if evict.sharded:
        target = local_heads(target, 1)
    order = (last - w + 1 + jnp.arange(w)) % w  # the ring's rows oldest first
    queries = [ring[slot][order][None] for ring in heads.queries]
    if evict.bits is not None:  # quantized per-head pages: whole groups (``continual.compress_groups``)
        tails = [tail[slot][None] for tail in heads.tails]
        pool, kept, _ = compress_groups(
            evict.spec,
            queries,
            heads.pool,
            tails,
            heads.tables[slot][None],
            heads.stored[slot][None],
            target[None],
            layouts,
            evict.page_elems,
            evict.group,
            evict.bits,
            tokens,
            windows=evict.windows,
        )
        heads = dataclasses.replace(heads, pool=pool, stored=heads.stored.at[slot].set(kept[0]))
        return dataclasses.replace(cache, heads=heads)
    sums = None if heads.sums is None else heads.slot_sums(slot)[None]
    pool, kept, keep = compress(
        evict.spec,
        queries,
        heads.pool,
        heads.tables[slot][None],
        heads.stored[slot][None],
        target[None],
        layouts,
        evict.page_elems,
        tokens,
        windows=evict.windows,
        sums=sums,
    )
    heads = dataclasses.replace(heads, pool=pool, stored=heads.stored.at[slot].set(kept[0]))
    if sums is not None:
        heads = heads.with_slot_sums(jnp.asarray([slot]), compacted(sums, keep, tokens))
    return dataclasses.replace(cache, heads=heads)


def _decode_step(
    graphdef,
    structure,
    weights,
    cache,
    slot_tokens,
    positions,
    active,
    table,
    schedule,
    sampling,
    entries,
    *,
    greedy,
    op,
    pools,
    formats,
    evict,
    vocab,
):
    """Feed each active row's token (``slot_tokens``, one row per slot) at ``positions``, and put the next one in
    its place; layer i reads its pages through ``table[pools[i]]`` (``formats``: as in ``_prefill_step``). An
    evicting engine's (``evict``) reads and appends to each slot's per-head pages instead, its tables first given
    this step's new ``entries`` (``HeadKVCache.with_entries``). ``vocab``: as in ``_prefill_step``."""
    module = nnx.merge(graphdef, jax.tree.unflatten(structure, weights))
    if evict is not None:
        return _decode_heads_step(
            module, cache, slot_tokens, positions, active, sampling, entries, greedy, evict, vocab
        )
    ks, vs = _layers(cache)

    def attend(i, q, k, v, rebuild=None, rotation=None):
        lay, pages, lengths = module.layouts[i], table[pools[i]], positions + 1
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
        kw = dict(op=op, rotation=rotation, schedule=None if schedule is None else schedule.layer(i))
        if formats is None:
            out, ks[i], vs[i] = attention.decode(
                q, k, v, lay, ks[i], vs[i], pages, lengths, rebuild=rebuild, active=active, **kw
            )
        else:
            out, ks[i], vs[i] = attention.decode_quantized(
                q, k, v, lay, ks[i], vs[i], formats[i], pages, lengths, active, **kw
            )
        return out[:, None]

    hidden = _hidden(module, slot_tokens[:, None], positions[:, None], attend, vocab)
    new = sample(_logits(module, hidden[:, 0], vocab), *sampling, greedy=greedy)
    return jnp.where(active, new, slot_tokens), _rebuilt(cache, ks, vs)


def _noisy_mass(weights, slots: int, layout, spec, layer: int, positions, active):
    """Keyformer's share of one decode step in a layer's sums, float32 [B, Hkv, slots]: ``metrics.decode_gumbel`` of
    the step's softmax ``weights`` [B, Hkv, G, <= slots] (0 on the slots a head does not see) at the tokens'
    ``positions`` [B]; 0 for inactive rows. The weights come whole from the decode kernel
    (``decode_heads(weights=True)``) and their noisy softmax runs in jnp: the added cost of the sums kernel's fusion
    is not Keyformer's (unmeasured on a GPU)."""
    weights = jnp.pad(weights, ((0, 0), (0, 0), (0, 0), (0, slots - weights.shape[-1])))  # 0: unseen
    kw = dict(seed=spec.seed, layer=layer, tau=spec.tau, heads=jnp.arange(layout.num_heads), positions=positions)
    added = metrics.decode_gumbel(weights.astype(jnp.float32), **kw)
    return jnp.where(active[:, None, None], added, 0.0)


def _decode_heads_step(module, cache, slot_tokens, positions, active, sampling, entries, greedy, evict, vocab):
    """``_decode_step`` over per-head pages (``attention.decode_heads``): positions stay the tokens' own (RoPE),
    each head attends to the tokens it stores."""
    if evict.sharded:  # the host's entries name every device's heads: this device's, renumbered, the rest dropped
        local = cache.heads.tables.shape[2]
        mine = entries[:, 2] // local == jax.lax.axis_index(forward.AXIS)
        entries = entries.at[:, 0].set(jnp.where(mine, entries[:, 0], slot_tokens.shape[0]))
        entries = entries.at[:, 2].set(entries[:, 2] % local)
    heads = cache.heads.with_entries(jnp.arange(slot_tokens.shape[0]), entries)
    pool, stored, rings, tails = heads.pool, [], list(heads.queries), list(heads.tails)
    sums = None if heads.sums is None else list(heads.sums)
    noisy = sums is not None and evict.spec.method == "keyformer"  # its sums from the weights (``_noisy_mass``)
    ring_row = jnp.where(active, positions % evict.spec.window, evict.spec.window)  # inactive rows: dropped
    works: dict = {}  # the live schedule's work lists, built once a step (one a KV head count) from the live slots

    def step_work(n: int):
        if n not in works:
            works[n] = live_work(jnp.broadcast_to(active[:, None], (active.shape[0], n)))
        return works[n]

    def attend(i, q, k, v, rebuild=None, rotation=None):
        nonlocal pool
        work, layout = None, module.layouts[i]
        if evict.schedule == "live" and evict.backend != "reference":
            if evict.bits is None:
                work = step_work(layout.num_kv_heads)
            else:  # a list a launch's head count (a launch a class of heads: each its own splits)
                work = {n: step_work(n) for n in launch_heads(layout, evict.bits, evict.launches)}
        window = evict.windows[i]
        before = None if window is None else heads.before[:, i]
        if evict.bits is not None:  # quantized per-head pages (``quant_head_kernel`` on the kernels)
            out, pool, tails[i], after, packed = attention.decode_quant_heads(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                module.layouts[i],
                pool,
                tails[i],
                heads.tables[:, i],
                heads.stored[:, i],
                evict.page_elems,
                evict.group,
                evict.bits,
                evict.tokens,
                backend=evict.backend,
                rotation=rotation,
                active=active,
                work=work,
                before=before,
                pairs=evict.pairs,
                launches=evict.launches,
            )
        else:
            got = attention.decode_heads(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                module.layouts[i],
                pool,
                heads.tables[:, i],
                heads.stored[:, i],
                evict.page_elems,
                backend=evict.backend,
                rotation=rotation,
                active=active,
                schedule=evict.schedule,
                work=work,
                before=before,
                sums=None if sums is None or noisy else sums[i],  # this step's queries' share of each slot's sum added
                square=metrics.squares(evict.spec.method),
                weights=noisy,
                slots=sums[i].shape[-1] if noisy else None,
            )
            out, pool, after, packed = got[:4]
            if noisy:
                sums[i] = sums[i] + _noisy_mass(got[4], sums[i].shape[-1], layout, evict.spec, i, positions, active)
            elif sums is not None:
                sums[i] = got[4]
        stored.append(after)
        rings[i] = rings[i].at[jnp.arange(packed.shape[0]), ring_row].set(packed.astype(rings[i].dtype), mode="drop")
        return out[:, None]

    hidden = _hidden(module, slot_tokens[:, None], positions[:, None], attend, vocab)
    new = sample(_logits(module, hidden[:, 0], vocab), *sampling, greedy=greedy)
    sums = None if sums is None else tuple(sums)
    heads = HeadKVCache(pool, heads.tables, jnp.stack(stored, axis=1), tuple(rings), heads.before, sums, tuple(tails))
    return jnp.where(active, new, slot_tokens), dataclasses.replace(cache, heads=heads)


def _layers(cache) -> tuple[list, list]:
    """Each layer's two cache arrays, to be replaced as the layers write: (K, V) pages, or quantized (pages, tail)."""
    if isinstance(cache, QuantizedKVCache):
        return list(cache.pages), list(cache.tails)
    return list(cache.k), list(cache.v)


def _rebuilt(cache, first, second):
    """A cache of ``cache``'s kind from ``_layers``' two lists."""
    kind = type(cache)
    return kind(tuple(first), tuple(second))


class Engine:
    """One paged cache, the decode and prefill ops, the jitted steps that run the model over them, and the latest
    token of each of ``max_batch`` slots on the device.

    The cache holds ``num_pages`` pages if given; else what ``cache_memory`` buys (a fraction of the device memory
    free now, or bytes; ``kvjax.runtime.memory``), after room for the largest step's activations, but never more
    than ``max_batch`` sequences of ``max_seq_len`` tokens can use; with neither, those pages, or what 90% of free
    memory buys where that is less. Prompts are prefilled at most ``chunk_tokens`` tokens a step, in calls of at
    most ``prefill_limit`` padded tokens, which bounds the activations. Sliding-window layers keep their pages in
    pools of their own (``windows``; ``window_pages`` pages each, enough for every slot's window), whose pages are
    given back as the window passes them, so the cache's tokens are those of its whole-context layers."""

    def __init__(self, model, config: EngineConfig | None = None, **settings):
        """``config`` (or its fields as keywords; ``kvjax.runtime.config``) holds every setting. ``backend``:
        "reference" (jnp), "pallas" (GPU kernels) or "interpret" (the kernels on the CPU); default: the kernels on
        a GPU, the reference elsewhere. ``batch_invariant``: decode schedules split each sequence by its own length
        alone and every decode step runs ``max_batch`` rows, and the runner prefills one chunk per step call
        (``kvjax.generate``). ``decode_config``: the decode kernel's knobs (its defaults are the measured best;
        bench/engine.py's ``--knob`` sets them). ``prefill_min_tokens`` (default the page size) and
        ``prefill_max_rows`` (default ``max_batch``): the shortest padded length and the most rows of a prefill
        call; fewer step shapes to compile (``compile_ahead``) for a little padding, since a short prefill call is
        bound by reading the weights anyway (bench/results/serving.md "Serving: latency against request rate")."""
        c = self.config = _config(config, settings)
        self._split(model, c.tensor_parallel, c.head_placement)
        max_batch, max_seq_len, page_size, chunk_tokens = c.max_batch, c.max_seq_len, c.page_size, c.chunk_tokens
        batch_invariant = c.batch_invariant
        num_pages, cache_memory, cache_dtype = c.num_pages, c.cache_memory, c.cache_dtype
        self.model, self.max_batch, self.page_size = model, max_batch, page_size
        self.chunk_tokens, self.batch_invariant = chunk_tokens, batch_invariant
        self.backend = self._backend(c)
        self.pages_per_seq = -(-max_seq_len // page_size)
        self.max_seq_len = self.pages_per_seq * page_size
        self.prefill_min, self.prefill_rows = page_size, max_batch
        if c.prefill_min_tokens is not None:
            self.prefill_min = max(page_size, c.prefill_min_tokens)
        if c.prefill_max_rows is not None:
            self.prefill_rows = min(max_batch, c.prefill_max_rows)
        self.prefill_limit = min(2 * bucket(max(chunk_tokens, self.prefill_min)), max_batch * bucket(self.max_seq_len))
        self.kv_bits = c.kv_bits
        # an evicting engine stages prompts exactly and quantizes only its per-head pages (``_eviction_setup``)
        self.formats = _formats(model, self.layouts, c) if c.eviction is None else None
        self._build_ops(model, c)
        cache_dtype = cache_dtype or model.dtype
        self.eviction: Eviction | None = c.eviction  # type: ignore[assignment]  # EngineConfig parses a string
        # an evicting engine's staging pages hold whole prompts in one pool (the prefill kernel masks each window);
        # its per-head pages keep the sliding layers' windows (``_Evict.windows``)
        self.windows = pool_windows(self.layouts, self.max_seq_len) if self.eviction is None else (None,)
        self.pools = tuple(pool_of(lay, self.windows) for lay in self.layouts)
        self._evict = self._eviction_setup(model) if self.eviction is not None else None
        if self._evict is not None:
            self.pool_pages = self._evicting_pages(num_pages, cache_memory, cache_dtype)
        else:
            self.pool_pages = self._pages(num_pages, cache_memory, cache_dtype)
        self.num_pages = self.pool_pages[0]
        self.window_pages = {w: n for w, n in zip(self.windows, self.pool_pages) if w is not None}
        self.prefix_caching = self._prefix_caching(c.prefix_caching)
        self.cache_dtype = cache_dtype
        self.kept: jax.Array | None = None  # the kept counts [rows, L, Hkv] of the last prefill call that evicted
        self.cache = self._create_cache(cache_dtype)
        self.slot_tokens = jnp.zeros((max_batch,), jnp.int32)
        # The cache is donated to every step, which updates it in place: on the CPU too, where a step that copied it
        # held two caches at once and spent most of its time copying (a 6.7 GB cache: 13 GB resident and about 16 s
        # a step; bench/notes/2026-11-27-first-hour.md)
        jit = functools.partial(_jit, mesh=None if self.sharded is None else self.sharded.mesh)
        # The weights go to the steps as a flat list: flattening the model's nnx state (its Variables, in Python)
        # at every call cost the host about 0.9 ms a decode step (bench/notes/2026-11-24-memory-startup.md).
        graphdef, state = (
            (model.graphdef, model.state) if self.sharded is None else (self.sharded.graphdef, self.sharded.state)
        )
        self.weights, structure = jax.tree.flatten(state)
        self._graph = graphdef, structure  # what every step merges its weights into (``fingerprint``)
        vocab = None if self.sharded is None else self.sharded.vocab_size
        self._steps: dict[tuple, Callable] = {}
        self._compiled: dict[tuple, Callable] = {}  # compile_ahead's executables, by step and input shape
        for greedy in (True, False):
            self._steps["decode", greedy] = jit(
                functools.partial(
                    _decode_step,
                    graphdef,
                    structure,
                    greedy=greedy,
                    op=self.decode_op,
                    pools=self.pools,
                    formats=self.formats,
                    evict=self._evict,
                    vocab=vocab,
                ),
                args=9,
                returns=(False, True),
            )
            for prefix in (True, False):
                for evicts in (False, True) if self._evict is not None else (False,):
                    step = functools.partial(
                        _prefill_step,
                        graphdef,
                        structure,
                        greedy=greedy,
                        op=self.prefill_op,
                        prefix=prefix,
                        pools=self.pools,
                        formats=self.formats,
                        evict=self._evict if evicts else None,
                        vocab=vocab,
                        history=None if self._evict is None else self._evict.history,
                    )
                    self._steps["prefill", greedy, prefix, evicts] = jit(
                        step, args=11, returns=(False, False, True, True)
                    )
        if self._evict is not None and self.continual:
            step = functools.partial(_compress_step, evict=self._evict, layouts=self.layouts, tokens=self.max_seq_len)
            self._steps[("compress",)] = jit(step, args=4, returns=True, cache=0)

    def _prefix_caching(self, asked: bool | None) -> bool:
        """Whether the scheduler shares cached prefix pages (``runtime.prefix``): where asked (None: wherever this
        cache can), refused in one line where it cannot. Shared pages must be whole-context pages of the model's
        dtype that nothing rewrites: not evicting caches, sliding-window pools (their pages go back as the window
        passes), quantized pages (a chunk continues its slot's exact tail page) or batch-invariant runs (a prefix
        hit moves every later chunk boundary)."""
        why = [
            reason
            for reason, applies in (
                ("eviction", self._evict is not None),
                ("sliding-window layers", len(self.windows) > 1),
                (f"kv_bits={self.kv_bits}", self.kv_bits is not None),
                ("batch_invariant", self.batch_invariant),
            )
            if applies
        ]
        if asked and why:
            raise ValueError(f"prefix caching cannot share pages with {' and '.join(why)}")
        return not why if asked is None else asked

    def _split(self, model, devices: int, placement: str) -> None:
        """Tensor parallelism (``kvjax.parallel``) over ``devices``: each device holds its placed KV heads at one
        padded local layout (``layouts``: what a device's cache holds), its share of every weight, and its heads'
        columns of every page; the steps run inside one ``shard_map``. One device: the model as it is."""
        self.devices = devices
        self.sharded: forward.Sharded | None = None
        if devices > 1:
            params = None
            forward.check(model, devices, placement)  # before any weight is read
            if self.config.eviction is not None and model.config.num_kv_heads < devices:
                raise ValueError(
                    f"eviction with tensor_parallel={devices} over {model.config.num_kv_heads} KV heads is not "
                    "supported yet: each replica of a head would score it with its own query heads only"
                )
            if isinstance(spec := self.config.eviction, Eviction) and spec.method == "keyformer":  # parsed by now
                raise ValueError(
                    f"eviction {spec.name} with tensor_parallel={devices} is not supported yet: "
                    "Keyformer's noise is drawn per query head, and a device numbers only its own heads"
                )
            if forward.shapes_only(model) and model.source is not None:  # kvjax.load(..., tensor_parallel=N)
                params = restore_sharded(model.source, model.dtype, jax.devices()[:devices])
            self.sharded = shard(model, devices, params=params, placement=placement)
        elif forward.shapes_only(model):
            raise ValueError(
                "a model loaded for tensor parallelism (or of shapes only) is read by its devices: give "
                "tensor_parallel > 1"
            )
        self.layouts = tuple(model.layouts) if self.sharded is None else self.sharded.layouts

    def _create_cache(self, dtype) -> PagedKVCache | QuantizedKVCache | EvictingCache:
        """The zeroed cache of the engine's pools: quantized pages (``formats``), staging and per-head pages
        (eviction), or pages of ``dtype``; under tensor parallelism one such cache a device (of its heads' columns,
        the page numbers shared), stacked and sharded, each device allocating its own."""
        if self.sharded is not None:
            return forward.stacked_zeros(self.sharded.mesh, functools.partial(self._local_cache, dtype))
        return self._local_cache(dtype)

    def _local_cache(self, dtype) -> PagedKVCache | QuantizedKVCache | EvictingCache:
        """One device's cache (``_create_cache``)."""
        if self._evict is not None:
            layers, heads = self._local_per_page.shape
            return EvictingCache(
                PagedKVCache.create(self.layouts, self.num_pages, self.page_size, dtype),
                HeadKVCache.create(
                    self.head_pages,
                    self._evict.page_elems,
                    self.max_batch,
                    layers,
                    heads,
                    self.head_max_pages,
                    dtype,
                    [(self._evict.spec.window, lay.q_cols) for lay in self.layouts],
                    self._evict.widest,
                    self.max_seq_len if self._evict.decoded else 0,
                    None
                    if self._evict.bits is None
                    else (self.page_size, [lay.k_cols + lay.v_cols for lay in self.layouts]),
                ),
                None
                if self._evict.history is None
                else jnp.zeros((layers, self.num_pages, self.page_size, heads), jnp.float32),
            )
        if self.formats is None:
            return PagedKVCache.create(self.layouts, self.pool_pages, self.page_size, dtype, self.windows)
        return QuantizedKVCache.create(self.formats, self.layouts, self.pool_pages, self.max_batch, dtype, self.windows)

    def _eviction_setup(self, model) -> _Evict:
        """An evicting engine's per-head pool format, or a one-line refusal of what it cannot evict yet: a page of
        ``page_size`` full-width tokens (K and V) serves any head, a narrower head storing more tokens in it
        (``ops.head_paging``); each head may hold a whole ``max_seq_len`` sequence."""
        spec = self.eviction
        assert spec is not None
        if model.module.rebuilt_k:
            raise ValueError(
                f"eviction {spec.name} on a model whose keys are rebuilt (Palu, banded ZACK) is not supported yet: "
                "its decode reads every key through the rebuild"
            )
        bits = served(self.kv_bits)
        if bits is not None and not isinstance(bits, int):
            raise ValueError(f"eviction {spec.name} with kv_bits {bits}: evicting serves KIVI-style 4 or 2 bits only")
        if bits is None:
            widths = [k + v for lay in self.layouts for k, v in zip(lay.k_widths, lay.v_widths)]
            page_elems = self.page_size * max(widths)
            local = np.stack([head_paging.layer_tokens_per_page(lay, page_elems) for lay in self.layouts])
        else:  # a page of bytes: one group of the widest head's slots, more of a narrower head's
            page_elems = quant_head_paging.pool_page_bytes(self.layouts, self.page_size, bits)
            local = np.stack(
                [quant_head_paging.layer_tokens_per_page(lay, page_elems, self.page_size, bits) for lay in self.layouts]
            )
        self._local_per_page = local  # a device's heads; the host's pages (``HeadPages``) hold every device's
        self.head_per_page = np.tile(local, (1, self.devices))
        self.head_max_pages = -(-self.max_seq_len // int(local.min()))
        schedule = self.config.decode_config.head_schedule
        windows = tuple(
            None if lay.sliding_window is None or lay.sliding_window >= self.max_seq_len else lay.sliding_window
            for lay in self.layouts
        )
        sharded = self.sharded is not None
        group = self.page_size if bits is not None else 0
        # the model's width pairs name the kernel's classes (``quant_head_decode``'s ``pairs``): a module a launch
        # form's key (a K class by default), shared by every layer and compiled once
        pairs = tuple(sorted({pair for lay in self.layouts for pair, _ in width_pairs(lay)})) if bits else ()
        launches = self.config.decode_config.quant_head_launches
        return _Evict(
            spec, page_elems, self.backend, schedule, sharded, windows, bits, group, self.max_seq_len, pairs, launches
        )

    def _evicting_pages(self, num_pages, cache_memory, dtype) -> tuple[int, ...]:
        """An evicting engine's two pools: the staging pool (``num_pages``) holds two whole ``max_seq_len`` prompts
        (each is prefilled there whole, then evicted into per-head pages); the per-head pool (``head_pages``) gets
        ``num_pages`` given, or the rest of the budget (``_pages``' rules, each slot's ring of last queries set aside
        beside the staging pages), at most what ``max_batch`` unevicted sequences need, and at least one such
        sequence. Returns (staging pages,)."""
        assert self._evict is not None
        staging = 2 * self.pages_per_seq + 1
        one = int((-(-self.max_seq_len // self._local_per_page)).sum())  # a full sequence in a device's every head
        need = self.max_batch * one + 1
        quantized = self._evict.bits is not None
        page_bytes = self._evict.page_elems * (1 if quantized else jnp.dtype(dtype).itemsize)
        staging_bytes = staging * self.page_size * bytes_per_token(self.layouts, dtype)
        rings = self.max_batch * self._evict.spec.window * sum(lay.q_cols for lay in self.layouts)
        staging_bytes += rings * jnp.dtype(dtype).itemsize  # each slot's last queries (continual eviction)
        if self._evict.history is not None:  # ``EvictingCache.mass``, float32 beside each staged token
            staging_bytes += 4 * staging * self.page_size * self._local_per_page.size
        if self._evict.decoded:  # ``HeadKVCache.sums``: float32 for each slot a head may store
            staging_bytes += 4 * self.max_batch * self._local_per_page.size * self.max_seq_len
        if quantized:  # ``HeadKVCache.tails``: each slot's partial group of every head
            tails = self.max_batch * self.page_size * sum(lay.k_cols + lay.v_cols for lay in self.layouts)
            staging_bytes += tails * jnp.dtype(dtype).itemsize
        if window := self._evict.widest:  # ``HeadKVCache.before``
            staging_bytes += 4 * self.max_batch * self._local_per_page.size * (window + 1)
        if num_pages is not None:
            self.budget_note = f"num_pages={num_pages}"
            self.head_pages = num_pages
        elif (budget := self._budget(cache_memory)) is None:
            self.head_pages = need
        else:
            reserve = self.activation_bytes() + staging_bytes
            (self.head_pages,) = memory.pool_pages(budget[0], reserve, [page_bytes], [need], what=budget[1])
        if self.head_pages - 1 < one:
            tokens = self.max_seq_len * (self.head_pages - 1) // one
            raise memory.CacheTooSmall(
                f"the per-head pool holds {self.head_pages - 1} pages ({self.budget_note}), fewer than the {one} a "
                f"sequence of max_seq_len={self.max_seq_len} positions needs before eviction: give a max_seq_len of "
                f"at most {tokens} or a larger cache_memory",
                tokens,
            )
        return (staging,)

    def _build_ops(self, model, c: EngineConfig) -> None:
        """The decode and prefill ops of the backend: none for the reference; for K rebuilt (Palu, banded ZACK),
        prefill at full width over rebuilt K, and decode by Palu's own kernel, or for bands of ``MIN_BAND`` or more
        by the variable-width kernel projecting each query once a band; the fused quantized decode kernel,
        KIVI-style's or GEAR's (prefill over the prefix dequantized to scratch pages); else the variable-width
        kernels."""
        self.decode_op: DecodeOp | PaluDecodeOp | GearDecodeOp | None = None
        self.prefill_op: PrefillOp | None = None
        if self.backend == "reference":
            return
        interpret = self.backend == "interpret"
        band = model.module.band
        if model.module.rebuilt_k:  # K rebuilt (Palu's latent, banded keys): prefill at full width over rebuilt K
            self.prefill_op = PrefillOp([full_width(lay) for lay in self.layouts], interpret=interpret)
            if band is None or band < MIN_BAND:  # Palu's own decode kernel, rebuilding every key
                self.decode_op = PaluDecodeOp(batch_invariant=c.batch_invariant, interpret=interpret)
                return
        else:
            self.prefill_op = PrefillOp(self.layouts, interpret=interpret)
        if c.eviction is not None:  # decode reads per-head pages (attention.decode_heads), with no host schedule
            return
        if self.formats is not None:
            if all(isinstance(f, PageFormat) for f in self.formats):
                self.decode_op = _quant_decode_op(self.layouts, self.formats, self.pages_per_seq, c, interpret)
            else:  # GEAR pages
                self.decode_op = GearDecodeOp(self.layouts, self.formats, interpret=interpret)
            return
        self.decode_op = DecodeOp(
            self.layouts,
            c.page_size,
            self.pages_per_seq,
            max_batch=c.max_batch,
            config=c.decode_config,
            batch_invariant=c.batch_invariant,
            band=band,
            interpret=interpret,
        )

    @property
    def cache_tokens(self) -> int:
        """Tokens the whole-context pool holds (its pages less the null page); an evicting engine's: the tokens its
        per-head pool holds at the model's widths (each head's share of a page at its own width)."""
        if self._evict is not None and self._evict.bits is not None:  # a token's bytes in each head's groups
            group, bits = self._evict.group, self._evict.bits
            heads = [(k, v) for lay in self.layouts for k, v in zip(lay.k_widths, lay.v_widths)]
            token = sum(quant_head_paging.head_format(k, v, group, bits).page_bytes / group for k, v in heads)
            return int((self.head_pages - 1) * self._evict.page_elems // token)
        if self._evict is not None:
            cols = sum(lay.k_cols + lay.v_cols for lay in self.layouts)
            return (self.head_pages - 1) * self._evict.page_elems // cols
        return (self.num_pages - 1) * self.page_size

    def tail_bytes(self, dtype=None) -> int:
        """The quantized cache's tails: a page of every layer for each slot, in the cache's dtype (0 without)."""
        if self.formats is None:
            return 0
        size = jnp.dtype(dtype or self.cache_dtype).itemsize
        return self.max_batch * self.page_size * sum(f.k_cols + f.v_cols for f in self.formats) * size

    def token_bytes(self) -> dict:
        """Cache bytes a token takes across all layers, by part (``cache.token_bytes``); under tensor parallelism
        across every device, each device's heads at its padded layout (what the padding costs shows here)."""
        return {k: n * self.devices for k, n in token_bytes(self.layouts, self.cache_dtype, self.formats).items()}

    def describe(self) -> str:
        """One line for people: where and how the engine runs, its batch, positions per sequence and cache, and how
        the cache's size was chosen."""
        dtype = jnp.dtype(self.model.dtype).name
        where, size = machine.platform(), memory.size(self.cache.nbytes)
        if self.sharded is not None:
            n, placement = self.config.tensor_parallel, self.sharded.placement
            padded = padded_imbalance(list(self.model.layouts), placement)
            by = "by bytes" if self.config.head_placement == "bytes" else "evenly by count"
            where = (
                f"{n} {where} devices (tensor parallel: KV heads placed {by}, each device's padded to one layout, "
                f"{padded:.2f}x the mean device's bytes)"
            )
            size = f"{size}, {memory.size(self.cache.nbytes // n)} a device"
        return (
            f"on {where} in {dtype} ({self.backend} attention): up to {self.max_batch} sequences at once "
            f"of up to {self.max_seq_len} positions; KV cache {self.cache_tokens:,} tokens, "
            f"{size} ({self.budget_note}){self._format_note()}{self._band_note()}{self._eviction_note()}"
        )

    def _eviction_note(self) -> str:
        """For an evicting engine: the policy, and the pools it keeps."""
        if self._evict is None or self.eviction is None:
            return ""
        evict = self._evict
        cut = "halving a decoding request's heads before preempting one" if self.continual else "never halving heads"
        if evict.bits is None:
            pages = f"per-head pages of {evict.page_elems} elements"
        else:
            pages = (
                f"per-head pages of {evict.page_elems} bytes, each head's survivors quantized to {evict.bits} bits in "
                f"groups of {evict.group} slots"
            )
        return (
            f"; evicting with {self.eviction.name} at each prompt's end ({self.eviction.allocated} budget), {cut}: "
            f"{pages}, {self.head_pages - 1:,} of them, beside staging pages for two whole prompts"
        )

    def _band_note(self) -> str:
        """For a banded ZACK model on the kernels: how decode reads its keys (prefill rebuilds them to full width)."""
        band = self.model.module.band
        if band is None or self.decode_op is None:
            return ""
        if isinstance(self.decode_op, PaluDecodeOp):
            return (
                f"; keys in bands of {band} positions, read by Palu's decode kernel, which rebuilds each key to full "
                f"width (the kernel that projects the query once a band needs bands of {MIN_BAND} or more)"
            )
        return f"; keys in bands of {band} positions: decode projects each query once a band"

    def _format_note(self) -> str:
        """The cache's bytes a token by part, for quantized pages (none for plain ones: K and V in the dtype)."""
        if self.formats is None:
            return ""
        parts = self.token_bytes()
        shown = ", ".join(f"{name} {n:,.0f}" for name, n in parts.items() if n)
        gear = isinstance(self.decode_op, GearDecodeOp)
        narrow = (
            self.decode_op is not None
            and not gear
            and any(min(lay.k_widths + lay.v_widths) < lay.head_dim for lay in self.layouts)
        )
        note = ""
        if narrow:
            note = (
                "; compressed heads make the quantized decode kernel slower than bf16's (1.75x at rate 0.5: "
                'bench/results/quantization.md "On the H100, with 64 tokens a step for narrow heads")'
            )
        elif gear:
            note = (
                "; GEAR's decode kernel is 6.6x slower than bf16's at rate 0 and 39x at rate 0.5, its outliers most "
                'of it (bench/results/quantization.md "On the H100, with 64 tokens a step for narrow heads")'
            )
        return (
            f"; {label(self.kv_bits)} pages of {self.page_size} tokens, {sum(parts.values()):,.0f} bytes a token "
            f"({shown}) + tails {memory.size(self.tail_bytes())}{note}"
        )

    def activation_bytes(self) -> int:
        """The room the largest step needs beside the cache (``memory.activation_bytes``'s estimate)."""
        cfg = self.model.config if self.sharded is None else self.sharded.config  # a device's heads and MLP share
        dtype = self.model.dtype
        scores = self.backend == "reference"
        gathers = scores or self.model.module.rebuilt_k  # a prefill over rebuilt K (Palu, banded) gathers each row
        rows = min(self.max_batch, self.prefill_limit)
        prefill = memory.activation_bytes(
            cfg, self.prefill_limit, rows, self.max_seq_len, dtype, scores=scores, gathers=gathers
        )
        decode = memory.activation_bytes(
            cfg, self.max_batch, self.max_batch, self.max_seq_len, dtype, scores=True, gathers=True
        )
        return max(prefill, decode)

    def _budget(self, cache_memory) -> tuple[int, str] | None:
        """The cache's bytes and their name in ``memory.pool_pages``' errors: ``cache_memory``, or a share of the
        memory free (``machine.SHARE``); None on a machine that does not say what is free (the caller then sizes for
        ``max_batch`` full sequences). Says which in ``budget_note``."""
        free = memory.free_bytes()
        if cache_memory is not None:
            budget = memory.budget_bytes(cache_memory)
            self.budget_note = f"cache_memory={memory.size(budget)}"
            if isinstance(cache_memory, float) and free is not None:
                self.budget_note += f", {cache_memory:g} of the {memory.size(free)} free"
            return budget, "cache_memory"
        if free is None:
            self.budget_note = "room for max_batch full sequences (this machine does not say how much memory is free)"
            return None
        share = machine.SHARE[machine.platform()]
        self.budget_note = f"at most {share:.0%} of the {memory.size(free)} free on this {machine.platform()}"
        return int(share * free), "free-memory"

    def _pages(self, num_pages, cache_memory, dtype) -> tuple[int, ...]:
        """Each pool's page count. The whole-context pool: ``num_pages``, or what ``cache_memory`` (or 90% of free
        memory) buys beside the window pools, capped at what ``max_batch`` full sequences can use; a window pool:
        what ``max_batch`` windows use at once (``window_span``), never more than the whole-context pool."""
        spans = [window_span(w, self.page_size, self.chunk_tokens, self.pages_per_seq) for w in self.windows]
        needs = [self.max_batch * span + 1 for span in spans]
        if num_pages is not None:
            self.budget_note = f"num_pages={num_pages}"
            return tuple(min(num_pages, need) if i else num_pages for i, need in enumerate(needs))
        pooled = [tuple(lay for lay, p in zip(self.layouts, self.pools) if p == i) for i in range(len(needs))]
        if self.formats is None:
            page_bytes = [self.page_size * bytes_per_token(layouts, dtype) for layouts in pooled]
        else:
            fmts = [tuple(f for f, p in zip(self.formats, self.pools) if p == i) for i in range(len(needs))]
            page_bytes = [sum(f.page_bytes for f in group) for group in fmts]
        reserve = self.activation_bytes() + self.tail_bytes(dtype)
        budget = self._budget(cache_memory)
        if budget is None:
            return tuple(needs)
        pages = memory.pool_pages(budget[0], reserve, page_bytes, needs, what=budget[1])
        if page_bytes[0] and (pages[0] - 1) * self.page_size < self.max_seq_len:
            tokens = (pages[0] - 1) * self.page_size
            raise memory.CacheTooSmall(
                f"the KV cache holds {tokens} tokens ({self.budget_note}, less {memory.size(reserve)} for a step's "
                f"activations), fewer than the max_seq_len={self.max_seq_len} one sequence may fill: give a "
                f"max_seq_len of at most {tokens} or a larger cache_memory",
                tokens,
            )
        return pages

    def prefill(self, chunks: list[list[int]], starts, rows: Rows, slots, tail_slots=None, heads=None) -> jax.Array:
        """Enqueue prompt chunks (token ids from positions ``starts``); the token sampled after each chunk goes to
        slot ``slots[i]`` (-1: none). ``tail_slots``: the slot of each chunk's request, whose tail a quantized cache
        continues (default ``slots``). ``heads`` (an evicting engine): for each chunk that ends its prompt, its
        request's per-head tables (``HeadPages.table``, grown by the whole prompt), else None; those prompts are
        evicted into their slots' per-head pages, and ``kept`` holds each row's kept counts [rows, L, Hkv] on the
        device. Returns the sampled tokens [padded rows] on the device, without waiting."""
        n = len(chunks)
        if n > self.prefill_rows:
            raise ValueError(f"a prefill call of {n} chunks, more than the {self.prefill_rows} rows a call holds")
        b, t = self.call_shape(n, max(map(len, chunks)))
        if b * t > self.prefill_limit:
            raise ValueError(f"a prefill call of {b} x {t} padded tokens, more than the {self.prefill_limit} sized for")
        tokens = np.zeros((b, t), np.int32)
        lengths = np.ones(b, np.int32)
        for row, ids in enumerate(chunks):
            tokens[row, : len(ids)], lengths[row] = ids, len(ids)
        padded = rows if rows.table.shape[1] == b else _pad_rows(rows, self.rows(b))
        where = np.full(b, self.max_batch, np.int32)
        where[:n] = [s if s >= 0 else self.max_batch for s in slots]
        starts = np.pad(np.asarray(starts, np.int32), (0, b - n))
        tails = np.full(b, self.max_batch, np.int32)
        tails[:n] = [s if s >= 0 else self.max_batch for s in (slots if tail_slots is None else tail_slots)]
        evicting = (
            self._evicting_inputs(heads, starts, lengths, n) if heads and any(h is not None for h in heads) else None
        )
        key = ("prefill", padded.greedy, bool(starts.any()), evicting is not None)
        self.slot_tokens, new, self.cache, kept = self._run(
            key,
            (*key, b, t),
            self.weights,
            self.cache,
            self.slot_tokens,
            tokens,
            starts,
            lengths,
            padded.table,
            where,
            tails,
            padded.sampling(),
            evicting,
        )
        self.kept = kept if self.sharded is None or kept is None else _placed(kept)
        return new

    def _evicting_inputs(self, heads, starts, lengths, n: int) -> tuple:
        """A prefill call's eviction inputs for ``_evicted``: each row's head tables (null pages for rows that do
        not end a prompt, so they write nothing), its prompt's length and ``Eviction.sizes``' budgets."""
        if self._evict is None or self.eviction is None:
            raise ValueError("per-head tables given to an engine that does not evict")
        layers, kv_heads = self.head_per_page.shape
        tables = np.full((len(starts), layers, kv_heads, self.head_max_pages), NULL_PAGE, np.int32)
        for row, table in enumerate(heads[:n]):
            if table is not None:
                tables[row] = table
        prompts = (starts + lengths).astype(np.int32)
        # a local head's budget is of its window (``_Evict.windows``: one whole context past max_seq_len)
        return (tables, prompts, *self.eviction.sizes(prompts, self._evict.windows))

    def decode(self, positions: np.ndarray, active: np.ndarray, rows: Rows, entries=None) -> jax.Array:
        """Enqueue one decode step over all ``max_batch`` slots (row i is slot i, so the step compiles once; an
        inactive row costs next to nothing: the step reads every weight whatever its rows, and the row's attention
        one token): each active row feeds its slot's token at its position and samples the next into the slot.
        ``entries`` (an evicting engine): the per-head table entries this step's growth filled, rows of (slot, layer,
        head, index, page) (``HeadPages.grow``'s, with the slot first). Returns the slot tokens [max_batch] after the
        step on the device, without waiting."""
        key = ("decode", rows.greedy)
        self.slot_tokens, self.cache = self._run(
            key,
            key,
            self.weights,
            self.cache,
            self.slot_tokens,
            positions,
            active,
            rows.table,
            self.schedule(positions + 1),
            rows.sampling(),
            self.head_entries(entries),
        )
        return self.slot_tokens

    @property
    def head_windows(self) -> tuple[int | None, ...] | None:
        """Each layer's sliding window where its per-head pages give back what the window has passed (None: the
        whole context), for the host's ``HeadPages``; None for an engine that does not evict."""
        return None if self._evict is None else self._evict.windows

    @property
    def continual(self) -> bool:
        """Whether this engine cuts decoding requests' heads when its per-head pool runs out (continual eviction),
        before the scheduler preempts: an evicting engine with a layer that sees the whole context (sliding-window
        layers are never cut: ``eviction.continual``) whose policy scores by its last queries or by sums decode keeps
        adding to (``_Evict.decoded``). On quantized pages (``kv_bits``) the cut is by whole groups
        (``continual.compress_groups``) and only the last-queries policies cut: decode keeps no sums there."""
        evict = self._evict
        if evict is None:
            return False
        scored = evict.history is None or (evict.decoded and evict.bits is None)
        return scored and not all(evict.windows)

    @property
    def continual_group(self) -> int:
        """The slots a cut keeps whole (``continual.halved``'s ``group``): a quantized group on quantized per-head
        pages, 0 (any slot) otherwise."""
        return self._evict.group if self._evict is not None and self._evict.bits is not None else 0

    def compress(self, slot: int, last: int, target) -> None:
        """Enqueue continual eviction of slot ``slot``, whose latest query is at position ``last``: each KV head cut to
        ``target`` [L, Hkv] tokens (``continual.halved``; the host's ``HeadPages`` has already given back the pages
        past them, so this runs before any step that writes them), by its last W queries' scores."""
        if not self.continual:
            raise ValueError("continual eviction asked of an engine that does not evict, or of sliding layers only")
        args = (self.cache, np.int32(slot), np.int32(last), np.asarray(target, np.int32))
        self.cache = self._run(("compress",), ("compress",), *args)

    def head_entries(self, entries) -> np.ndarray | None:
        """An evicting decode step's table entries padded to its fixed shape (one page a head of every slot, the most
        a step can fill), padding rows naming no slot; None for an engine that does not evict."""
        if self._evict is None:
            if entries is not None and len(entries):
                raise ValueError("per-head table entries given to an engine that does not evict")
            return None
        layers, heads = self.head_per_page.shape
        out = np.zeros((self.max_batch * layers * heads, 5), np.int32)
        out[:, 0] = self.max_batch
        if entries is not None and len(entries):
            out[: len(entries)] = entries
        return out

    def rows(self, n: int) -> Rows:
        """``n`` empty rows of step inputs (null pages in every pool, greedy)."""
        return Rows.empty(n, self.pages_per_seq, len(self.windows))

    def call_shape(self, chunks: int, longest: int) -> tuple[int, int]:
        """The padded (rows, length) of a prefill call of ``chunks`` chunks, the longest ``longest`` tokens."""
        b = bucket(chunks, maximum=self.prefill_rows)  # one chunk per running request at most
        return b, bucket(longest, minimum=self.prefill_min, maximum=self.max_seq_len)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, length) a prefill call can take: powers of two (rows capped at ``prefill_max_rows``, one row
        in batch-invariant mode; lengths from ``prefill_min_tokens`` to the chunk budget, capped at
        ``max_seq_len``) within ``prefill_limit`` padded tokens."""
        top = bucket(self.chunk_tokens, minimum=self.prefill_min, maximum=self.max_seq_len)
        lengths = {bucket(1 << i, minimum=self.prefill_min, maximum=top) for i in range(top.bit_length() + 1)}
        most = 1 if self.batch_invariant else self.prefill_rows
        rows = {bucket(1 << i, maximum=most) for i in range(most.bit_length() + 1)}
        return [(b, t) for t in sorted(lengths) for b in sorted(rows) if b * t <= self.prefill_limit]

    def compile_ahead(self, greedy=(True, False), threads: int = 8, progress: bool = False, processes: int = 0) -> int:
        """Compile every step the engine can run (the decode step; each prefill shape, with and without a prefix)
        before serving, so no request waits for a compile. ``threads`` overlap XLA's compiles; tracing and Pallas's
        lowering hold Python's lock, and for a compressed 8B-shaped model they cost seconds a shape
        (bench/results/serving.md "Serving: latency against request rate"), so with the step store on (``step_cache``)
        ``processes`` > 0 traces the steps it lacks in that many processes at once (``step_cache.trace_apart``).
        Returns how many executables it compiled."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        processes = validate.integer("processes", processes, low=0)  # before any work: a bad count names itself
        jobs: list[tuple[tuple, Callable, tuple]] = []
        state = (self.weights, self.cache, self.slot_tokens)

        def rows_of(n: int, greedily: bool) -> Rows:  # n rows that sample greedily or not, as such a step gets them
            rows = self.rows(n)
            rows.temperature[:] = 0.0 if greedily else 1.0
            return rows

        for g in greedy:
            rows = rows_of(self.max_batch, g)
            positions = np.zeros(self.max_batch, np.int32)
            inputs: tuple = (
                positions,
                positions.astype(bool),
                rows.table,
                self.schedule(positions + 1),
                rows.sampling(),
                self.head_entries(None),
            )
            jobs.append((("decode", g), self._steps["decode", g], (*state, *inputs)))
            for b, t in self.prefill_shapes():
                rows = rows_of(b, g)
                ids, zeros = np.zeros((b, t), np.int32), np.zeros(b, np.int32)
                for prefix in (True, False):
                    for evicts in (False, True) if self._evict is not None else (False,):
                        key = ("prefill", g, prefix, evicts)
                        evicting = self._evicting_inputs([None] * b, zeros, zeros + 1, 0) if evicts else None
                        inputs = (ids, zeros, zeros + 1, rows.table, zeros, zeros, rows.sampling(), evicting)
                        jobs.append(((*key, b, t), self._steps[key], (*state, *inputs)))
        if self.continual:  # continual eviction, which a full per-head pool asks for mid-serving
            target = np.zeros(self.head_per_page.shape, np.int32)
            jobs.append((("compress",), self._steps[("compress",)], (self.cache, np.int32(0), np.int32(0), target)))
        jobs = [job for job in jobs if job[0] not in self._compiled]

        if processes > 0 and self._store() is not None:
            apart = [(name, _unjitted(step), args) for name, step, args in jobs]
            step_cache.trace_apart(apart, fingerprint=self.fingerprint, processes=processes, progress=progress)

        def compile_one(job):
            name, step, args = job
            return name, self._compile(step, name, args)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            done = tqdm(
                pool.map(compile_one, jobs), total=len(jobs), desc="compiling", unit="step", disable=not progress
            )
            self._compiled.update(done)
        return len(jobs)

    def _backend(self, c: EngineConfig) -> str:
        """The attention path: ``c.backend``, else the device's default (``attention.default_backend``), else the
        reference where the kernels cannot run these head widths (multiples of 16); a kernel path asked for by name
        that cannot run them, or GPU kernels given pages they do not take, is a one-line ValueError."""
        backend = attention.check_backend(c.backend or attention.default_backend())
        if backend != "reference" and not all(w % 16 == 0 for lay in self.layouts for w in lay.k_widths + lay.v_widths):
            if c.backend is not None:
                raise ValueError("the attention kernels need head widths that are multiples of 16")
            return "reference"
        page = c.page_size
        if backend == "pallas" and not isinstance(c.kv_bits, str) and not is_pow2(page, 16):
            raise ValueError(
                f"page_size={page}: the GPU kernels take pages of a power of two of at least 16 tokens (checked "
                "at 16 and 32); the reference path takes any"
            )
        return backend

    def _run(self, key: tuple, name: tuple, *args):
        """Step ``key`` (of ``_steps``) run on ``args``: its executable for their shapes ``name`` (``_compiled``),
        compiled now through the step store where that is on, else the jitted step."""
        step = self._compiled.get(name)
        if step is None:
            if self._store() is None:
                return self._steps[key](*args)
            step = self._compiled[name] = self._compile(self._steps[key], name, args)
        return step(*args)

    def _store(self):
        """The step store's directory (``step_cache``), None where it is off, where the engine is sharded (a sharded
        step is not stored yet) or where its model cannot be fingerprinted (a static attribute pickle refuses)."""
        where = step_cache.directory() if self.sharded is None else None
        if where is None:
            return None
        try:
            self.fingerprint  # noqa: B018  # computed once, here, so that a model it cannot name runs unstored
        except (pickle.PicklingError, TypeError, AttributeError):
            return None
        return where

    def _compile(self, step, name: tuple, args: tuple):
        """The jitted ``step`` compiled for ``args``: through the step store, where it is on, under ``name``."""
        where = self._store()
        if where is None:
            return step.lower(*args).compile()
        donate = 0 if name == ("compress",) else 1  # the cache (``_jit``)
        fingerprint, options = self.fingerprint, COMPILER_OPTIONS
        return step_cache.compile(
            _unjitted(step),
            args,
            name=name,
            fingerprint=fingerprint,
            donate=donate,
            compiler_options=options,
            where=where,
        )

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """What the engine's steps are traced from, for ``step_cache``: the model's graph (its structure, layouts
        and settings, without weights) and the engine's configuration. Everything else a step closes over (the
        ops, pools, formats) is built from these on the same code and machine, which ``step_cache.key`` adds."""
        return hashlib.blake2b(pickle.dumps(self._graph) + repr(self.config).encode(), digest_size=20).digest()

    def schedule(self, lengths: np.ndarray):
        """The decode op's device schedule for these lengths (None on the reference path)."""
        return None if self.decode_op is None else self.decode_op.schedule(lengths)


def _formats(model, layouts, c: EngineConfig) -> tuple[AnyPageFormat, ...] | None:
    """Each layer's quantized page format (``kv_schemes.page_format``) for its cached ``layouts`` (a device's, under
    tensor parallelism), or None for pages in the cache's dtype."""
    # Palu and banded models refused, in the words kvjax.compress uses
    kv_bits = check_kv_bits(c.kv_bits, model.module.method, model.module.band)
    if kv_bits is None:
        return None
    return tuple(page_format(kv_bits, lay, c.page_size) for lay in layouts)


def _quant_decode_op(layouts, formats, pages_per_seq: int, config: EngineConfig, interpret: bool):
    """The fused decode kernel over quantized pages (``ops.decode.quant_kernel``) of each layer's format, scheduled by
    the engine's ``decode_config`` with one KV head a unit, or with runs of heads when it sets ``quant_runs``
    (``quant_kernel.plan_config``)."""
    from kvjax.ops.decode.quant_kernel import QuantDecodeOp, plan_config

    return QuantDecodeOp(
        layouts,
        config.page_size,
        pages_per_seq,
        formats=formats,
        config=plan_config(config.decode_config, min(f.bits for f in formats), config.decode_config.quant_runs),
        max_batch=config.max_batch,
        batch_invariant=config.batch_invariant,
        interpret=interpret,
    )


def _config(config: EngineConfig | None, settings: dict) -> EngineConfig:
    """``config``, or one built from ``settings``; never both."""
    if config is None:
        return EngineConfig(**settings)
    if settings:
        raise TypeError("give an EngineConfig or its fields as keywords, not both")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    return config


def _placed(kept: jax.Array) -> jax.Array:
    """Kept counts [devices, rows, L, local heads] as the host's per-head pages order them, [rows, L, heads]."""
    n, b, layers, local = kept.shape
    return jnp.moveaxis(kept, 0, 2).reshape(b, layers, n * local)


def _pad_rows(rows: Rows, out: Rows) -> Rows:
    """``rows`` grown to the rows of ``out``, whose further rows stay empty (null pages, greedy)."""
    n = rows.table.shape[1]
    for field in dataclasses.fields(Rows):
        if field.name == "table":
            out.table[:, :n] = rows.table
        else:
            getattr(out, field.name)[:n] = getattr(rows, field.name)
    return out
