"""Eviction after prefill on the device, as the engine will run it at the end of a prompt (issue 37, item 4;
bench/notes/2026-12-02-eviction-device.md, "The engine on per-head pages"): the prompts sit in the engine's
per-sequence pages, the prefill step has each layer's last ``window`` queries; score, select, and copy each KV head's
survivors into its per-head pages in one jitted pass, with no host work between.

Observation-window methods only (``metrics.WINDOWED``: KV-Compress, SnapKV): full-history ones need every query's
softmax, which only the prefill kernel has (bench/results/eviction.md "Eviction: device cost": 2-3x the prefill as a
separate pass). Its selection is ``eviction.reference``'s (tested on a model's own prefill).
"""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.eviction import metrics
from kvjax.eviction.select import Eviction, device_keep
from kvjax.ops import head_paging
from kvjax.parallel.forward import all_heads, local_heads


def evict_prompts(
    spec: Eviction,
    queries,
    k_pages,
    v_pages,
    seq_table,
    lengths,
    sizes,
    layouts,
    head_pool,
    head_tables,
    page_elems: int,
    sharded: bool = False,
):
    """Evict prompts of ``lengths`` [B] tokens held in per-sequence pages (``k_pages``/``v_pages`` per layer [P,
    page_size, cols], ``seq_table`` [B, pages]) into per-head pages: ``queries`` per layer [B, W, q_cols], each
    prompt's last W queries (packed as the cache is: ZACK's rotated ones); ``sizes`` = ``spec.sizes(lengths)`` from
    the host. ``head_tables`` [B, L, Hkv, head pages] must give each head pages for what it keeps (the host's
    ``HeadPages`` grows them; the whole prompt is always enough). Returns (head_pool, kept [B, L, Hkv]: what
    ``HeadPages.shrink`` takes, keep [B, L, Hkv, S]: the selection). ``sharded`` (tensor parallelism, inside
    ``shard_map``): the arrays hold this device's heads, and a budget shared across heads ranks every device's
    scores (gathered), each device keeping its own heads' share of the one selection."""
    if spec.method not in metrics.WINDOWED:
        raise ValueError(f"the engine evicts with {metrics.WINDOWED} only; {spec.method!r} needs every query's softmax")
    b = seq_table.shape[0]
    scores = []
    for layer, lay in enumerate(layouts):
        keys = k_pages[layer][seq_table].reshape(b, -1, lay.k_cols)
        scores.append(metrics.window_scores(spec.method, queries[layer], keys, lengths, lay, pool=spec.pool))
    per_head, protect = sizes
    windows = tuple(lay.sliding_window for lay in layouts)
    stacked = jnp.stack(scores, axis=1)  # [B, L, Hkv, S]
    if sharded:
        keep = local_heads(device_keep(spec, all_heads(stacked, 2), lengths, per_head, protect, windows), 2)
    else:
        keep = device_keep(spec, stacked, lengths, per_head, protect, windows)
    head_pool, kept = head_paging.admit(head_pool, head_tables, k_pages, v_pages, seq_table, keep, layouts, page_elems)
    return head_pool, kept, keep
