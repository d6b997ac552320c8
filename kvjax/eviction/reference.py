"""Eviction in a plain forward, for scoring and as the engine's reference: a prompt is prefilled exactly, each KV
head's prompt tokens are cut to the policy's selection (``select.keep_masks`` over ``metrics.scores``), and the
tokens after the prompt attend to what was kept plus each other, as decode would over the evicted cache.

This is the methods' published setting (SnapKV, KV-Compress and Keyformer compress the prompt once after prefill;
H2O's accumulated attention is read at the same point), teacher-forced: two forwards, the first over the prompt
for the scores, the second over everything with each head's keys masked. Continual eviction during decode is the
engine's (issue 37, item 4), not this module's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.eviction import metrics
from kvjax.eviction.select import Eviction, keep_masks
from kvjax.ops.grouped import attend_groups, full_width, visible
from kvjax.ops.prefill.reference import causal_attention


def _positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prompt_scores(graphdef, state, tokens, spec: Eviction):
    """Per layer, float32 [B, Hkv, P]: the policy's scores of the prompt ``tokens`` [B, P], from an exact forward."""
    module = nnx.merge(graphdef, state)
    out = []

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        layout = module.layouts[i]
        kw = dict(window=spec.window, pool=spec.pool, tau=spec.tau, seed=spec.seed, layer=i, rebuild=rebuild)
        out.append(metrics.scores(spec.method, q, k, layout, **kw))
        return causal_attention(q, k, v, layout, rebuild)

    module.hidden(tokens, _positions(tokens), attend)
    return out


@functools.partial(jax.jit, static_argnums=(0, 3))
def _evicted_hidden(graphdef, state, tokens, prompt: int, keep):
    """Final-norm hidden states [B, T, E] when the queries after the first ``prompt`` tokens see, of the prompt, only
    what ``keep`` (per layer, bool [B, Hkv, P]) holds."""
    module = nnx.merge(graphdef, state)
    t = tokens.shape[1]
    pos = jnp.arange(t)

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        layout = module.layouts[i]
        if rebuild is not None:
            k, layout = rebuild(k, _positions(tokens)), full_width(layout)
        seen = visible(pos[:, None], pos[None, :], layout.sliding_window)  # [T, T]
        kept = jnp.pad(keep[i], ((0, 0), (0, 0), (0, t - prompt)), constant_values=True)  # [B, Hkv, T]
        evicted_for = (pos[:, None] >= prompt) & (pos[None, :] < prompt)  # decode rows over prompt keys
        mask = seen & (~evicted_for | kept[:, :, None, :])  # [B, Hkv, T, T]
        return attend_groups(q, k, v, mask, layout)

    return module.hidden(tokens, _positions(tokens), attend)


def prompt_scores(model, tokens, spec: Eviction) -> list[np.ndarray]:
    """Per layer, float32 [B, Hkv, P]: ``spec``'s scores of the prompt ``tokens`` [B, P] from an exact forward of
    ``model`` (a ``kvjax.Model``). They depend on the method and its window, pooling and noise, not the budget: one
    call serves every budget (``keep``)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return [np.asarray(s) for s in _prompt_scores(model.graphdef, model.state, tokens, spec)]


def keep(model, scores: list[np.ndarray], spec: Eviction) -> list[np.ndarray]:
    """Per layer, bool [B, Hkv, P]: what each KV head of ``model`` keeps of each prompt row under ``spec``'s budget,
    from ``prompt_scores``."""
    windows = [lay.sliding_window for lay in model.module.layouts]
    rows = [keep_masks(spec, [s[b] for s in scores], windows) for b in range(scores[0].shape[0])]
    return [np.stack([row[layer] for row in rows]) for layer in range(len(scores))]


def prompt_keep(model, tokens, spec: Eviction) -> list[np.ndarray]:
    """``keep`` of ``prompt_scores``: what each head keeps of the prompt ``tokens`` [B, P] under ``spec``."""
    return keep(model, prompt_scores(model, tokens, spec), spec)


def hidden_after(model, tokens, kept: list[np.ndarray]) -> jax.Array:
    """Final-norm hidden states [B, T, E] of ``tokens`` [B, T] whose prompt (the first P, P = ``kept``'s last axis)
    was prefilled and then cut to ``kept`` (per layer, bool [B, Hkv, P]) before the rest were decoded."""
    tokens = jnp.asarray(tokens, jnp.int32)
    prompt = kept[0].shape[-1]
    return _evicted_hidden(model.graphdef, model.state, tokens, prompt, [jnp.asarray(k) for k in kept])


def evicted_hidden(model, tokens, prompt: int, spec: Eviction) -> tuple[jax.Array, list[np.ndarray]]:
    """(final-norm hidden states [B, T, E], what each head kept: ``prompt_keep``) of ``tokens`` [B, T] whose first
    ``prompt`` tokens are prefilled, then cut by ``spec``, before the rest are decoded (teacher-forced)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if not 0 < prompt <= tokens.shape[1]:
        raise ValueError(f"prompt must be 1..{tokens.shape[1]} tokens, got {prompt}")
    kept = prompt_keep(model, tokens[:, :prompt], spec)
    return hidden_after(model, tokens, kept), kept


def kept_bytes(kept: list[np.ndarray], layouts) -> float:
    """The cache bytes the kept prompt tokens take (each head at its own K and V width) over those of every prompt
    token a head would hold uncompressed (at full width; a sliding-window layer's last window only): 1 - the
    overall rate of rank reduction and eviction together, right after the prompt."""
    held = total = 0.0
    for k, lay in zip(kept, layouts):
        p = k.shape[-1]
        widths = np.add(lay.k_widths, lay.v_widths)
        held += float((k.sum(-1) * widths).sum())
        total += (
            k.shape[0]
            * lay.num_kv_heads
            * 2
            * lay.head_dim
            * (p if lay.sliding_window is None else min(p, lay.sliding_window))
        )
    return held / total
