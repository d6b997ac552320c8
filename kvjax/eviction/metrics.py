"""How much each cached token matters to each KV head: the eviction metrics, computed from the attention the model
actually runs (ZACK's rotated, truncated q·k; a Palu latent rebuilt; the packed layout of ``kvjax.layout``).

``scores`` is a float32 score per (KV head, key) over a prompt's keys, higher = keep, for each of ``METHODS``:
``kvcompress`` (KV-Compress, Rehg, 2024, section 3.2; ``kvcompress-full``, its full-history form), ``snapkv``
(SnapKV, Li et al., 2024, section 4), ``h2o`` (H2O, Zhang et al., 2023, section 3) and ``keyformer`` (Keyformer,
Adnan et al., 2024, section 3.3). ``window_scores`` gives the observation-window methods from a prompt's last
queries, as the engine has them; ``chunk_mass`` one prefill chunk's share of a full-history sum, which the engine
adds up over a prompt's chunks. Sums over queries run in blocks of ``QUERY_BLOCK`` rows; where asked, the
full-history sums of ``ON_KERNEL`` run in ``ops.attention_mass`` instead (two Pallas passes, no [T, T] array; 9.1x
the jnp form on an H100: bench/results/eviction.md "Eviction on the H100 (2026-12-06)"). The engine takes the kernel
wherever it runs kernels (Keyformer's noise hashed in the kernel, the same bits as ``gumbel_noise``); the jnp form
is the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layout import HeadLayout
from kvjax.ops import noise
from kvjax.ops.attention_mass import attention_mass
from kvjax.ops.grouped import full_width, head_logits, visible

METHODS = ("kvcompress", "kvcompress-full", "snapkv", "h2o", "keyformer")
WINDOWED = ("kvcompress", "snapkv")  # scored by the last ``window`` queries only
ON_KERNEL = ("h2o", "kvcompress-full", "keyformer")  # the full-history sums ``ops.attention_mass`` computes
# the full-history sums decode keeps adding to, one step's weights at a time (``decode_heads(sums=)``, squared where
# ``squares``, summed over the group: ``softmax_mass``'s rule on one query a row; Keyformer's softmax of noisy
# scores, its decode draws keyed by the head's slots: ``decode_gumbel``)
DECODED = ("h2o", "kvcompress-full", "keyformer")
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


def softmax_mass(method: str, logits, seen):
    """What the queries give each key, [B, S]: each query's softmax over the keys it ``seen`` (0 elsewhere, so a row
    that sees nothing gives nothing and no NaN), squared for KV-Compress, summed over the query group and the rows of
    ``logits`` [B, group, rows, S]."""
    probs = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    probs = jnp.where(seen, probs, 0.0)
    if squares(method):
        probs = probs * probs
    return probs.sum(axis=(1, 2))


def squares(method: str) -> bool:
    """Whether ``method`` squares each attention weight before summing it (KV-Compress, Rehg, 2024, section 3.2)."""
    return method.startswith("kvcompress")


def gumbel_noise(seed: int, layer: int, heads, rows, keys):
    """Keyformer's standard Gumbel draws, float32 [B, len(heads), R, S], for query ``heads`` [G] at query positions
    ``rows`` [B, R] against key positions ``keys`` [S] (or [B, S]: each row's own): a counter-based hash of (seed,
    layer, query head, query position, key position) alone (``ops.noise``: a 32-bit integer mixer, five rounds), so
    a prompt scored whole and the same prompt scored chunk by chunk (the engine's prefill, ``chunk_mass``) draw the
    same noise, and the mass kernel hashes the same bits."""

    keys = jnp.asarray(keys, jnp.int32)
    h = noise.mix(noise.base(seed, layer) ^ jnp.asarray(heads, jnp.int32)[None, :, None, None])
    h = noise.mix(h ^ jnp.asarray(rows, jnp.int32)[:, None, :, None])
    return noise.gumbel(noise.mix(h ^ (keys[None, None, None, :] if keys.ndim == 1 else keys[:, None, None, :])))


def decode_gumbel(weights, *, seed: int, layer: int, tau: float, heads, positions):
    """float32 [B, Hkv, slots]: what one decode query a row gives each slot of each KV head under Keyformer's rule,
    summed over the head's query group: the softmax over the slots the step saw of (score + g) / tau, from its
    softmax ``weights`` [B, Hkv, G, slots] (0 on slots a head does not store or its window has passed, as
    ``decode_heads(weights=True)`` gives them, so a weight of 0, underflowed ones included, is a slot not seen; the
    weights' logs are the scores less each row's log-sum, which the softmax drops), g ``gumbel_noise``'s draw for query
    ``heads`` [Hkv x G] (the layer's query heads) at ``positions`` [B] against the slot's index, not its token's
    position. Slots are what a head still holds after a cut, and a draw a (query, slot) pair is as independent as
    one a (query, key position) pair (Keyformer, section 3.3, draws the noise afresh); a cut head's positions are
    gone."""
    b, hkv, g, n = weights.shape
    draws = gumbel_noise(seed, layer, heads, positions[:, None], jnp.arange(n)).reshape(b, hkv, g, n)
    ok = weights > 0
    logits = (jnp.log(jnp.where(ok, weights, 1.0)) + draws) / tau
    return softmax_mass("keyformer", logits.reshape(b * hkv, g, 1, n), ok.reshape(b * hkv, g, 1, n)).reshape(b, hkv, n)


def _head_mass(method: str, q, k, rows, valid, layout: HeadLayout, g: int, *, tau: float, seed: int, layer: int):
    """float32 [B, S]: what KV head ``g``'s query group gives each key of ``k`` [B, S, k_cols] from the queries ``q``
    [B, R, q_cols] at positions ``rows`` [B, R] (those ``valid`` [B, R]), each seeing the keys causal attention and
    the layer's window let it see (``_mass``; Keyformer: its Gumbel-softmax)."""
    logits = head_logits(q, k, layout, g)  # [B, group, R, S]
    key_pos = jnp.arange(k.shape[1])
    seen = visible(rows[:, :, None], key_pos[None, None, :], layout.sliding_window) & valid[:, :, None]
    if method == "keyformer":
        heads = g * layout.group_size + jnp.arange(layout.group_size)
        logits = (logits + gumbel_noise(seed, layer, heads, rows, key_pos)) / tau
    return softmax_mass(method, logits, seen[:, None])


def _on_kernel(
    method: str, q, k, layout: HeadLayout, *, tau: float, seed: int, layer, starts=None, lengths=None, lse=None
):
    """``ops.attention_mass`` for an ``ON_KERNEL`` method (squared: KV-Compress; Keyformer's noise hashed in the
    kernel), interpreted where the backend is no GPU; ``lse``: attention's denominators (not Keyformer's)."""
    return attention_mass(
        q,
        k,
        layout,
        starts=starts,
        lengths=lengths,
        squared=method == "kvcompress-full",
        gumbel=(seed, layer, tau) if method == "keyformer" else None,
        lse=lse,
        interpret=jax.default_backend() != "gpu",
    )


def chunk_mass(
    method: str,
    q,
    k,
    starts,
    lengths,
    layout: HeadLayout,
    *,
    tau: float = 1.0,
    seed: int = 0,
    layer: int = 0,
    kernel: bool = False,
    lse=None,
):
    """float32 [B, Hkv, S]: the unpooled sum ``scores`` makes, over one chunk of queries only: ``q`` [B, T, q_cols]
    holds chunk b's queries from position ``starts[b]`` (its first ``lengths[b]`` rows), ``k`` [B, S, k_cols] the
    keys they may see (later slots are masked by causality). Sums over consecutive chunks equal the whole prompt's
    sum (tested), which is how the engine accumulates the full-history methods (H2O, KV-Compress's full form,
    Keyformer) while prefilling chunk by chunk. Rows run in blocks of ``QUERY_BLOCK``: memory [B, group, block, S].
    ``kernel``: the ``ON_KERNEL`` methods through ``ops.attention_mass`` (no [rows, S] array; interpreted where the
    backend is no GPU): 9.1x the jnp form on an H100 (bench/results/eviction.md "Eviction on the H100 (2026-12-06)").
    ``lse`` (with ``kernel``; H2O and KV-Compress's full form): the chunk's log2 softmax denominators [B, T, num_heads]
    from the prefill kernel (``ops.prefill.kernel.prefill_attention(lse=True)``), which skip the kernel's first pass."""
    b, t = q.shape[:2]
    if method in ON_KERNEL and kernel:
        kw = dict(starts=starts, lengths=lengths, tau=tau, seed=seed, layer=layer, lse=lse)
        return _on_kernel(method, q, k, layout, **kw)
    block = min(QUERY_BLOCK, t)
    blocks = -(-t // block)
    q = jnp.pad(q, ((0, 0), (0, blocks * block - t), (0, 0)))  # the last block's rows past the chunk: not valid
    starts = jnp.broadcast_to(jnp.asarray(starts, jnp.int32), (b,))
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (b,))
    out = []
    for g in range(layout.num_kv_heads):

        def step(total, i, g=g):
            local = i * block + jnp.arange(block)
            rows, valid = starts[:, None] + local[None, :], local[None, :] < lengths[:, None]
            q_block = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)
            mass = _head_mass(method, q_block, k, rows, valid, layout, g, tau=tau, seed=seed, layer=layer)
            return total + mass, None

        total, _ = jax.lax.scan(step, jnp.zeros((b, k.shape[1]), jnp.float32), jnp.arange(blocks))
        out.append(total)
    return jnp.stack(out, axis=1)


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
    queries that see it give it, so a key no scoring query sees scores 0. ``layer`` varies Keyformer's noise
    (``gumbel_noise``). ``kernel``: the ``ON_KERNEL`` methods through ``ops.attention_mass`` (interpreted where the
    backend is no GPU), else this jnp form (``chunk_mass`` over the scoring queries)."""
    if method not in METHODS:
        raise ValueError(f"eviction method must be one of {METHODS}, got {method!r}")
    b, s = q.shape[:2]
    if rebuild is not None:
        k, layout = rebuild(k, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))), full_width(layout)
    if method in ON_KERNEL and kernel:
        return _on_kernel(method, q, k, layout, tau=tau, seed=seed, layer=layer)
    first = max(s - window, 0) if method in WINDOWED else 0
    total = chunk_mass(method, q[:, first:], k, first, s - first, layout, tau=tau, seed=seed, layer=layer)
    return _pool(total, pool) if method in WINDOWED else total


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
        total = softmax_mass(method, head_logits(q, k, layout, g), seen[:, None])
        pooled = _pool(jnp.where(key_pos < n[:, None], total, -jnp.inf), pool)
        out.append(jnp.where(key_pos < n[:, None], pooled, 0.0))
    return jnp.stack(out, axis=1)
