"""Eviction after prefill on the device, as the engine will run it at the end of a prompt (issue 37, item 4;
bench/notes/2026-12-02-eviction-device.md, "The engine on per-head pages"): the prompts sit in the engine's
per-sequence pages, the prefill step has each layer's last ``window`` queries; score, select, and copy each KV head's
survivors into its per-head pages in one jitted pass, with no host work between.

Observation-window methods (``metrics.WINDOWED``: KV-Compress, SnapKV) score from the last queries alone. The
full-history ones (H2O, KV-Compress's full form, Keyformer) need every query's softmax: each prefill chunk adds what
its queries give the keys before them to a float32 mass beside the staging pages, addressed by the same block table
(``accumulate``), and the prompt's end reads it back (``history_scores``). Both selections are
``eviction.reference``'s (tested on a model's own prefill).
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
    mass=None,
):
    """Evict prompts of ``lengths`` [B] tokens held in per-sequence pages (``k_pages``/``v_pages`` per layer [P,
    page_size, cols], ``seq_table`` [B, pages]) into per-head pages: ``queries`` per layer [B, W, q_cols], each
    prompt's last W queries (packed as the cache is: ZACK's rotated ones); ``sizes`` = ``spec.sizes(lengths)`` from
    the host. ``head_tables`` [B, L, Hkv, head pages] must give each head pages for what it keeps (the host's
    ``HeadPages`` grows them; the whole prompt is always enough). Returns (head_pool, kept [B, L, Hkv]: what
    ``HeadPages.shrink`` takes, keep [B, L, Hkv, S]: the selection, scores [B, L, Hkv, S]: what it ranked, this
    device's heads; the engine keeps the survivors' full-history sums from them). ``mass`` (the full-history
    methods, which score with it instead of ``queries``): ``accumulate``'s, over the prompts' whole prefill.
    ``sharded`` (tensor parallelism, inside ``shard_map``): the arrays hold this device's heads, and a budget shared
    across heads ranks every device's scores (gathered), each device keeping its own heads' share of the one
    selection."""
    keep, stacked = select_prompts(spec, queries, k_pages, seq_table, lengths, sizes, layouts, sharded, mass)
    head_pool, kept = head_paging.admit(head_pool, head_tables, k_pages, v_pages, seq_table, keep, layouts, page_elems)
    return head_pool, kept, keep, stacked


def select_prompts(spec: Eviction, queries, k_pages, seq_table, lengths, sizes, layouts, sharded=False, mass=None):
    """``evict_prompts``' selection alone (same arguments): (keep [B, L, Hkv, S], scores [B, L, Hkv, S]), for a
    caller that admits the survivors into pages of its own (``ops.quant_head_paging.admit``)."""
    b = seq_table.shape[0]
    if spec.method in metrics.WINDOWED:
        scores = []
        for layer, lay in enumerate(layouts):
            keys = k_pages[layer][seq_table].reshape(b, -1, lay.k_cols)
            scores.append(metrics.window_scores(spec.method, queries[layer], keys, lengths, lay, pool=spec.pool))
        stacked = jnp.stack(scores, axis=1)  # [B, L, Hkv, S]
    elif mass is None:
        raise ValueError(f"{spec.method!r} needs every query's softmax: give the prefill's accumulated mass")
    else:
        stacked = history_scores(mass, seq_table, lengths)
    per_head, protect = sizes
    windows = tuple(lay.sliding_window for lay in layouts)
    if sharded:
        keep = local_heads(device_keep(spec, all_heads(stacked, 2), lengths, per_head, protect, windows), 2)
    else:
        keep = device_keep(spec, stacked, lengths, per_head, protect, windows)
    return keep, stacked


def accumulate(
    mass, layer: int, spec: Eviction, q, keys, pages, starts, lengths, layout, kernel: bool = False, lse=None
):
    """``mass`` [L, P, page_size, Hkv] (float32, beside the staging pool of P pages) with layer ``layer``'s entries
    for one prefill call added: chunk b's packed queries ``q`` [B, T, q_cols], from position ``starts[b]``, its first
    ``lengths[b]`` rows real, give the keys ``keys`` [B, S, k_cols] (its pages ``pages`` [B, S / page_size], the
    chunk's own keys written) what ``metrics.chunk_mass`` says; a chunk from position 0 starts its pages afresh (a
    prompt's first chunk, or a preempted one's again). The sum over a prompt's chunks is ``metrics.scores``'
    (tested). Rows of null pages all add to page 0, which no prompt reads. ``kernel``: the sums through
    ``ops.attention_mass`` (``metrics.chunk_mass``); ``lse``: the prefill kernel's denominators for them."""
    kw = dict(tau=spec.tau, seed=spec.seed, layer=layer, kernel=kernel, lse=lse)
    add = metrics.chunk_mass(spec.method, q, keys, starts, lengths, layout, **kw)
    old = mass[layer][pages]  # [B, pages, page_size, Hkv]
    old = jnp.where((jnp.asarray(starts) == 0)[:, None, None, None], 0.0, old)
    new = old + jnp.swapaxes(add, 1, 2).reshape(old.shape)
    return mass.at[layer, pages].set(new)


def history_scores(mass, seq_table, lengths):
    """float32 [B, L, Hkv, S]: the full-history scores of prompts of ``lengths`` [B] from ``accumulate``'s ``mass``
    [L, P, page_size, Hkv] through their staging pages ``seq_table`` [B, pages] (slots past a prompt: 0)."""
    got = mass[:, seq_table]  # [L, B, pages, page_size, Hkv]
    layers, b = got.shape[:2]
    got = jnp.transpose(got.reshape(layers, b, -1, got.shape[-1]), (1, 0, 3, 2))  # [B, L, Hkv, S]
    return jnp.where(jnp.arange(got.shape[-1]) < jnp.asarray(lengths)[:, None, None, None], got, 0.0)
