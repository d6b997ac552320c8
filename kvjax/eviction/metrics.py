"""How much each cached token matters to each KV head: the eviction metrics, computed from the attention the model
actually runs (ZACK's rotated, truncated q·k; a Palu latent rebuilt; the packed layout of ``kvjax.layout``).

``scores`` is a float32 score per (KV head, key) over a prompt's keys, higher = keep, for each of ``METHODS``:
``kvcompress`` (KV-Compress, Rehg, 2024, section 3.2; ``kvcompress-full``, its full-history form), ``snapkv``
(SnapKV, Li et al., 2024, section 4), ``h2o`` (H2O, Zhang et al., 2023, section 3) and ``keyformer`` (Keyformer,
Adnan et al., 2024, section 3.3). ``window_scores`` gives the observation-window methods from a prompt's last
queries, as the engine has them. Sums over all queries run in blocks of ``QUERY_BLOCK`` rows; where asked, the
full-history sums of ``ON_KERNEL`` run in ``ops.attention_mass`` instead (two Pallas passes, no [T, T] array; the
jnp form stays the default until the kernel is measured on a GPU: bench/results/eviction.md "Eviction: device
cost" times both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops.attention_mass import attention_mass
from kvjax.ops.grouped import full_width, head_logits, visible

METHODS = ("kvcompress", "kvcompress-full", "snapkv", "h2o", "keyformer")
WINDOWED = ("kvcompress", "snapkv")  # scored by the last ``window`` queries only
ON_KERNEL = ("h2o", "kvcompress-full")  # full-history sums ``ops.attention_mass`` computes (Keyformer's noise: jnp)
QUERY_BLOCK = 256


def _pool(scores, width: int):
    """Max over ``width`` keys centred on each key (SnapKV's and KV-Compress's pooling; width 1: none)."""
    if width <= 1:
        return scores
    pad = [(0, 0)] * (scores.ndim - 1) + [(width // 2, (width - 1) // 2)]
    padded = jnp.pad(scores, pad, constant_values=-jnp.inf)
    return jax.lax.reduce_window(
        padded, -jnp.inf, jax.lax.max, (1,) * (scores.ndim - 1) + (width,), (1,) * scores.ndim, "VALID"
    )


def _mass(method: str, logits, seen):
    """What the queries give each key, [B, S]: each query's softmax over the keys it ``seen`` (0 elsewhere, so a row
    that sees nothing gives nothing and no NaN), squared for KV-Compress, summed over the query group and the rows of
    ``logits`` [B, group, rows, S]."""
    probs = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    probs = jnp.where(seen, probs, 0.0)
    if method.startswith("kvcompress"):
        probs = probs * probs
    return probs.sum(axis=(1, 2))


def scores(
    method: str,
    q,
    k,
    layout: HeadLayout,
    *,
    window: int = 8,
    pool: int = 7,
    tau: float = 1.0,
    seed: int = 0,
    layer: int = 0,
    rebuild=None,
    kernel: bool = False,
):
    """float32 [B, Hkv, S] scores of the S keys of a prompt of S tokens for ``method`` (``METHODS``), from its packed
    q [B, S, q_cols] and the K attention reads, k [B, S, k_cols] (a Palu or banded latent with ``rebuild``).
    Each query sees the keys causal attention (and a sliding window) lets it see; a key's score sums what the
    queries that see it give it, so a key no scoring query sees scores 0. ``layer`` varies Keyformer's noise.
    ``kernel``: the ``ON_KERNEL`` methods through ``ops.attention_mass`` (interpreted where the backend is no GPU),
    else this jnp form."""
    if method not in METHODS:
        raise ValueError(f"eviction method must be one of {METHODS}, got {method!r}")
    b, s = q.shape[:2]
    if rebuild is not None:
        k, layout = rebuild(k, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))), full_width(layout)
    if method in ON_KERNEL and kernel:
        interpret = jax.default_backend() != "gpu"
        return attention_mass(q, k, layout, squared=method == "kvcompress-full", interpret=interpret)
    first = max(s - window, 0) if method in WINDOWED else 0
    block = min(QUERY_BLOCK, s - first)
    blocks = -(-(s - first) // block)
    pad = first + blocks * block - s  # the last block's rows past the prompt are masked out
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0)))
    key_pos = jnp.arange(s)
    out = []
    for g in range(layout.num_kv_heads):

        def step(total, i, g=g):
            start = first + i * block
            rows = start + jnp.arange(block)
            logits = head_logits(jax.lax.dynamic_slice_in_dim(q, start, block, axis=1), k, layout, g)
            seen = visible(rows[:, None], key_pos[None, :], layout.sliding_window) & (rows < s)[:, None]
            if method == "keyformer":
                noise_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), layer * 1024 + g), i)
                logits = (logits + jax.random.gumbel(noise_key, logits.shape)) / tau
            return total + _mass(method, logits, seen), None

        total, _ = jax.lax.scan(step, jnp.zeros((b, s), jnp.float32), jnp.arange(blocks))
        out.append(_pool(total, pool) if method in WINDOWED else total)
    return jnp.stack(out, axis=1)


def window_scores(method: str, q, k, lengths, layout: HeadLayout, *, pool: int = 7):
    """An observation-window method's (``WINDOWED``) float32 scores [B, Hkv, S] where the engine has them at a
    prompt's end: ``q`` [B, W, q_cols], the queries of each prompt's last W positions (``lengths[b] - W`` on; rows
    before position 0 are ignored), against the prompt's keys ``k`` [B, S, k_cols] (slots past ``lengths`` are
    ignored and score 0). Equal to ``scores(method, ...)`` with ``window`` W over each prompt alone (tested): the
    prefill step computes it from the last chunk's queries and the keys in its pages, with no second pass.

    ``lengths`` [B, Hkv] gives each KV head its own count: a head's slots after eviction, its survivors in order and
    then what was decoded, whose last W are the last W queries' own tokens (continual eviction,
    ``kvjax.eviction.continual``)."""
    if method not in WINDOWED:
        raise ValueError(f"only {WINDOWED} score from a window of queries; {method!r} needs every query's attention")
    w = q.shape[1]
    s = k.shape[1]
    lengths = jnp.asarray(lengths, jnp.int32)
    key_pos = jnp.arange(s)
    out = []
    for g in range(layout.num_kv_heads):
        n = lengths[:, g] if lengths.ndim == 2 else lengths
        rows = n[:, None] - w + jnp.arange(w)[None, :]  # [B, W] each query's position
        seen = visible(rows[:, :, None], key_pos[None, None, :], layout.sliding_window) & (rows >= 0)[:, :, None]
        seen &= key_pos < n[:, None, None]  # [B, W, S]
        total = _mass(method, head_logits(q, k, layout, g), seen[:, None])
        pooled = _pool(jnp.where(key_pos < n[:, None], total, -jnp.inf), pool)
        out.append(jnp.where(key_pos < n[:, None], pooled, 0.0))
    return jnp.stack(out, axis=1)
