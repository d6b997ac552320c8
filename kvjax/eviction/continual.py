"""Continual eviction on the device (issue 37, item 4; KV-Compress, Rehg 2024, section 3.4): a decoding sequence
whose per-head pages must shrink (the pool would otherwise preempt a request) has each KV head cut to a number of
tokens the host chose, keeping the head's most recent slots and its highest scoring others, scored in the reduced
space by the sequence's last W queries (the limited observation window, ``metrics.window_scores``) or, for the
full-history methods decode adds to (H2O, KV-Compress's full form, Keyformer: ``metrics.DECODED``), by each slot's
sum of what every query so far gave it, then compacted in place (``head_paging.compact``).

The host chooses the counts (``halved``), not the scores, so it gives the freed pages back in the same step that
needs them, with no wait for the device. Each head keeps a share of what it stores, so the allocation across heads
and layers that KV-Compress made at the prompt's end carries over in proportion. Scoring works in slot order: after
eviction a head's slots are its survivors in position order, then every token decoded since, and the last W of
them are the last W queries' own tokens (never evicted: ``Eviction.recent`` holds at least the window), so each query
sees exactly the slots before and at its own, as causal attention did.

Sliding-window layers are never cut: their heads' slots are counted from the prompt's eviction to say where the
window starts (``head_paging.window_before``), and their pages already go back as the window passes
(``HeadPages.release_passed``), so each holds about a window. A model of local and global layers (Gemma 3) cuts its
global ones.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.eviction import metrics
from kvjax.eviction.select import Eviction, ranks
from kvjax.ops import head_paging, quant_head_paging


def halved(spec: Eviction, stored, context: int | None = None, windows=None, group: int = 0) -> np.ndarray:
    """Host: what each head keeps when its sequence is cut (int64, ``stored``'s shape, [..., layers, heads]): half of
    what it stores, rounded up, never fewer than ``spec.recent`` nor, for a sequence at ``context`` positions, than
    the policy's tokens a head for it (``spec.per_head``: continual eviction never cuts below the budget the prompt
    was cut to), and never more than it stores; all of it in a layer with a sliding window (``windows``: one a layer,
    None or 0 for none; module docstring). ``compress`` keeps exactly this many. ``group`` (quantized pages,
    ``compress_groups``): the count rounded up to whole groups of ``group`` slots plus the head's partial group,
    which a cut never splits."""
    stored = np.asarray(stored, np.int64)
    floor = max(spec.recent, 0 if context is None else spec.per_head(context))
    target = np.minimum(stored, np.maximum(-(-stored // 2), floor))
    if group:
        target = whole_groups(target, stored, group)
    if windows is not None:
        local = np.array([bool(w) for w in windows])[:, None]
        target = np.where(local, stored, target)
    return target


def whole_groups(target, stored, group: int) -> np.ndarray:
    """Host: each head's ``target`` (int, ``stored``'s shape) rounded up to whole groups of ``group`` slots plus the
    head's partial group (``stored % group``), the counts a cut by groups keeps (``group_marks``): a cut never
    splits a group, and never drops the partial one, whose keys are still exact in the tail."""
    target, stored = np.asarray(target, np.int64), np.asarray(stored, np.int64)
    partial = stored % group
    return np.maximum(-(-(target - partial) // group), 0) * group + partial


def group_marks(scores, stored, target, group: int, recent: int):
    """bool [..., S // group]: which of each head's full groups a cut by groups keeps, from its slots' ``scores``
    [..., S] (higher: keep), ``stored`` [...] and ``target`` [...] (``whole_groups``' counts): a group scores its best
    slot's score, the last groups that the ``recent`` newest slots reach past the partial group are kept, then the
    best others (``keep_counts``) up to ``target``'s whole groups. The device's cut (``compress_groups``) and the
    accuracy bench's (``reference.group_cut``) both choose by it. The best slot, not the sum: a group that holds a
    heavy hitter keeps it, which scored better than the sum (bench/results/eviction.md, "Eviction on quantized pages:
    a cut by whole groups against a cut by slots")."""
    stored = jnp.asarray(stored, jnp.int32)
    groups = scores.shape[-1] // group
    full, partial = stored // group, stored % group
    by_group = scores[..., : groups * group].reshape(*scores.shape[:-1], groups, group).max(-1)
    protect = -(-jnp.maximum(recent - partial, 0) // group)  # the last groups the recent slots reach
    want = (jnp.asarray(target, jnp.int32) - partial) // group
    return keep_counts(by_group, full, want, protect[..., None])


def _keys(pool, tables, layout, page_elems: int, tokens: int):
    """Every KV head's first ``tokens`` slots of one layer, packed as the layer's K [B, tokens, k_cols]; slots past
    what a head stores hold whatever their pages do (the scores mask them)."""
    heads = range(layout.num_kv_heads)
    return jnp.concatenate([head_paging.read(pool, tables, h, layout, page_elems, tokens)[0] for h in heads], -1)


def _quant_keys(pool, tail, tables, stored, layout, page_bytes: int, group: int, bits: int, tokens: int):
    """``_keys`` on quantized per-head pages: every KV head's first ``tokens`` slots as attention reads them
    (``quant_head_paging.read``: full groups dequantized, the partial one exact from ``tail``), packed [B, tokens,
    k_cols]."""
    heads = range(layout.num_kv_heads)
    read = quant_head_paging.read
    return jnp.concatenate(
        [read(pool, tail, tables, stored, h, layout, page_bytes, group, bits, tokens)[0] for h in heads], -1
    )


def keep_counts(scores, stored, target, protect):
    """bool [..., S]: of each head's ``stored`` [...] slots, its last ``protect`` (an int, or [..., 1]: one a head)
    and then its highest ``scores`` [..., S] (ties: the earlier slot) up to ``target`` [...] in all; ``max(min(target,
    stored), min(protect, stored))`` of them (``halved`` gives targets of at least ``protect``)."""
    slot = jnp.arange(scores.shape[-1])
    stored = jnp.asarray(stored, jnp.int32)[..., None]
    live = slot < stored
    guarded = live & (slot >= stored - protect)
    free = live & ~guarded
    room = jnp.minimum(jnp.asarray(target, jnp.int32), stored[..., 0]) - guarded.sum(-1, dtype=jnp.int32)
    cost = jnp.where(free, -scores.astype(jnp.float32), jnp.inf)
    return guarded | (free & (ranks(cost) < room[..., None]))


def compress(
    spec: Eviction, queries, pool, tables, stored, target, layouts, page_elems: int, tokens: int, windows=(), sums=None
):
    """Cut each KV head of B sequences to ``target`` [B, L, Hkv] tokens (``halved``) and compact it in place; the
    heads of a layer with a sliding window (``windows``: one a layer, None for none; absent: none) keep every slot,
    unread and unmoved (their tables may name pages the window has given back).

    ``queries``: per layer [B, W, q_cols], each sequence's last W queries in order (packed as the cache is: ZACK's
    rotated ones), the last one the latest token's; ``tables`` [B, L, Hkv, pages] and ``stored`` [B, L, Hkv] as
    ``runtime.cache.HeadKVCache`` holds them; ``tokens`` (static): the most slots a head may store. Returns (pool,
    kept [B, L, Hkv], keep [B, L, Hkv, tokens]): the pool with each head's survivors in its first slots, in order
    (donate it under ``jax.jit``: XLA writes in place), and the counts ``HeadPages.shrink`` took from the host.
    ``sums`` (the full-history methods that decode adds to, ``metrics.DECODED``; their ``queries`` are unused):
    float32 [B, L, Hkv, tokens], each stored slot's sum so far, which ranks the head's slots instead; move them with
    the survivors by ``select.compacted(sums, keep, tokens)``."""
    if spec.method in metrics.DECODED and sums is None:
        raise ValueError(f"continual eviction by {spec.method!r} ranks each slot's sum: give the sums")
    cut = tuple(layer for layer in range(len(layouts)) if not (windows and windows[layer]))
    every = jnp.arange(tokens) < jnp.asarray(stored, jnp.int32)[..., None]  # [B, L, Hkv, tokens]
    marks = []
    for layer, lay in enumerate(layouts):
        if layer not in cut:
            marks.append(every[:, layer])
            continue
        if spec.method in metrics.DECODED:
            scores = sums[:, layer]
        else:
            keys = _keys(pool, tables[:, layer], lay, page_elems, tokens)
            scores = metrics.window_scores(spec.method, queries[layer], keys, stored[:, layer], lay, pool=spec.pool)
        marks.append(keep_counts(scores, stored[:, layer], target[:, layer], spec.recent))
    keep = jnp.stack(marks, axis=1)
    pool, kept = head_paging.compact(pool, tables, keep, stored, layouts, page_elems, layers=cut)
    return pool, kept, keep


def compress_groups(
    spec: Eviction,
    queries,
    pool,
    tails,
    tables,
    stored,
    target,
    layouts,
    page_bytes: int,
    group: int,
    bits: int,
    tokens: int,
    windows=(),
):
    """``compress`` on quantized per-head pages (``ops.quant_head_paging``), by whole groups: each head's full groups
    are scored by their best slot's score (the last W queries against its keys as attention reads them,
    dequantized; ``metrics.window_scores``), its last groups holding ``spec.recent`` slots with the partial group are
    kept, then its best others up to ``target`` [B, L, Hkv] (``halved`` with ``group``: whole groups plus the partial
    group), and the survivors move as bytes (``quant_head_paging.compact_groups``). Only the observation-window
    methods: decode keeps no sums on quantized pages. ``tails``: per layer, the partial groups (row i: sequence i).
    Returns (pool, kept [B, L, Hkv], keep [B, L, Hkv, tokens // group]: each head's groups kept)."""
    if spec.method not in metrics.WINDOWED:
        raise ValueError(f"continual eviction on quantized pages scores with {metrics.WINDOWED}, not {spec.method!r}")
    cut = tuple(layer for layer in range(len(layouts)) if not (windows and windows[layer]))
    stored, target = jnp.asarray(stored, jnp.int32), jnp.asarray(target, jnp.int32)
    every = jnp.arange(tokens // group) < (stored // group)[..., None]  # [B, L, Hkv, groups]
    marks = []
    for layer, lay in enumerate(layouts):
        if layer not in cut:
            marks.append(every[:, layer])
            continue
        n = stored[:, layer]
        keys = _quant_keys(pool, tails[layer], tables[:, layer], n, lay, page_bytes, group, bits, tokens)
        scores = metrics.window_scores(spec.method, queries[layer], keys, n, lay, pool=spec.pool)  # [B, Hkv, tokens]
        marks.append(group_marks(scores, n, target[:, layer], group, spec.recent))
    keep = jnp.stack(marks, axis=1)
    pool, kept = quant_head_paging.compact_groups(pool, tables, keep, stored, layouts, page_bytes, group, bits, cut)
    return pool, kept, keep
