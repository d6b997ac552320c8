"""Eviction in a plain forward, for scoring and as the engine's reference: a prompt is prefilled exactly, each KV
head's prompt tokens are cut to the policy's selection (``select.keep_masks`` over ``metrics.scores``), and the
tokens after the prompt attend to what was kept plus each other, as decode would over the evicted cache
(``evicted_hidden``, ``hidden_after``). Teacher-forced, and one cut after prefill (the methods' published setting);
continual eviction during decode is the engine's (its cut by whole groups on quantized pages is scored here as one
cut at the prompt's end: ``group_cut``). With ``kv`` (a ``kv_schemes`` scheme), the kept tokens are compacted and
then served from quantized pages (``compacted_round_trip``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.eviction import metrics
from kvjax.eviction.continual import group_marks, whole_groups
from kvjax.eviction.select import Eviction, keep_masks
from kvjax.ops import kv_schemes
from kvjax.ops.grouped import attend_groups, full_width, head_logits, visible
from kvjax.ops.prefill.reference import causal_attention


def _positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _many_scores(graphdef, state, tokens, specs: tuple[Eviction, ...]):
    """(per spec, per layer, float32 [B, Hkv, P]: each policy's scores of the prompt ``tokens`` [B, P], and the
    prompt's prefix: final-norm hidden [B, P, E] and each layer's K and V as attention receives them, ZACK's packed,
    Palu's latent K) from one exact forward (each layer's q and k serve every spec): one compile and one
    forward for all of a plan's methods and every cut's decode after them."""
    module = nnx.merge(graphdef, state)
    out: list[list] = [[] for _ in specs]
    ks, vs = [], []

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        layout = module.layouts[i]
        for spec, found in zip(specs, out):
            kw = dict(window=spec.window, pool=spec.pool, tau=spec.tau, seed=spec.seed, layer=i, rebuild=rebuild)
            found.append(metrics.scores(spec.method, q, k, layout, **kw))
        ks.append(k)
        vs.append(v)
        return causal_attention(q, k, v, layout, rebuild)

    hidden = module.hidden(tokens, _positions(tokens), attend)
    return out, (hidden, ks, vs)


def compacted_round_trip(kv, q, k, v, layout, kept, prompt: int, rows=None):
    """(K and V as ``kv``'s pages serve them, which of them a query reads quantized) when each KV head's surviving
    tokens (``kept``: bool [B, Hkv, T], the tokens after the first ``prompt`` all True) are compacted in order and then
    quantized page by page: per head, survivor j sits at slot ``rank_j`` (its count of survivors before it), pages
    group slots, and a query at m >= ``prompt`` reads a key quantized iff the key's page was full when m was decoded
    (``quantized_causal_attention``'s rule over slots: ``rank_j // page < (kept + m - prompt + 1) // page``). The
    prompt's own rows read exactly (one prefill chunk, in full-precision staging pages). ``rows``: the queries'
    positions (default: all T). -> (k_q [B, T, k_cols], v_q [B, T, v_cols], quant bool [B, Hkv, len(rows), T])."""
    t = kept.shape[-1]
    order = jnp.argsort(~kept, axis=-1, stable=True)  # [B, Hkv, T]: slot -> position (survivors first, in order)
    rank = jnp.argsort(order, axis=-1)  # position -> slot

    def per_column(x, widths, index):
        heads = np.repeat(np.arange(len(widths)), widths)  # each packed column's KV head
        return jnp.take_along_axis(x, jnp.swapaxes(index[:, heads], 1, 2), axis=1)

    k_slots = per_column(k, layout.k_widths, order)
    v_slots = per_column(v, layout.v_widths, order)
    kq, vq = kv.round_trip(q, k_slots, v_slots, layout)  # rows in slot order: the pages a compacted head fills
    kq, vq = per_column(kq, layout.k_widths, rank), per_column(vq, layout.v_widths, rank)
    pos = jnp.arange(t) if rows is None else rows
    cached = kept[..., :prompt].sum(-1)[..., None] + jnp.maximum(pos - prompt + 1, 0)  # [B, Hkv, rows] per query
    page = kv.page_size
    quant = (rank[:, :, None, :] // page < (cached // page)[..., None]) & (pos >= prompt)[None, None, :, None]
    return kq, vq, quant


@functools.partial(jax.jit, static_argnums=(0, 3, 7, 8, 9))
def _continued_hidden(
    graphdef, state, tokens, prompt: int, prefix_k, prefix_v, keep, kv=None, method=None, noise=(0, 1.0)
):
    """Final-norm hidden states [B, C, E] of the tokens after the prompt (``tokens`` [B, C], at positions ``prompt``
    on), each attending to what ``keep`` (per layer, bool [B, Hkv, P]) holds of the prompt's K and V (``prefix_k``,
    ``prefix_v``: ``prompt_prefix``'s) and causally to each other; ``kv``: from quantized pages
    (``compacted_round_trip``). The work is the C rows' against the P + C keys: a prompt is never run again.
    ``method`` (a full-history one): also, per layer, float32 [B, Hkv, P + C], what these rows' softmax gives each
    key under ``metrics``' rule for it (their share of the method's sums); Keyformer's noise (``noise``: its seed and
    tau) keyed by each key's slot among what its head holds, as decode draws it (``metrics.decode_gumbel``)."""
    module = nnx.merge(graphdef, state)
    b, c = tokens.shape
    t = prompt + c
    rows, cols = prompt + jnp.arange(c), jnp.arange(t)
    positions = jnp.broadcast_to(rows.astype(jnp.int32), tokens.shape)
    masses: list = []

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        layout = module.layouts[i]
        k, v = jnp.concatenate([prefix_k[i], k], axis=1), jnp.concatenate([prefix_v[i], v], axis=1)
        if rebuild is not None:
            if kv is not None:
                raise ValueError("kv: quantized pages are not supported on Palu or banded ZACK models yet")
            k, layout = rebuild(k, jnp.broadcast_to(cols.astype(jnp.int32), (b, t))), full_width(layout)
        kept = jnp.pad(keep[i], ((0, 0), (0, 0), (0, c)), constant_values=True)  # [B, Hkv, T]
        mask = visible(rows[:, None], cols[None, :], layout.sliding_window) & kept[:, :, None, :]  # [B, Hkv, C, T]
        if method is not None:
            logits = [head_logits(q, k, layout, g) for g in range(layout.num_kv_heads)]
            if method == "keyformer":
                seed, tau = noise
                slot = jnp.cumsum(kept, axis=-1) - 1  # a kept key's slot in its head: the kept keys before it
                row_pos = jnp.broadcast_to(rows, (b, c))
                group = layout.group_size
                logits = [
                    (x + metrics.gumbel_noise(seed, i, g * group + jnp.arange(group), row_pos, slot[:, g])) / tau
                    for g, x in enumerate(logits)
                ]
            masses.append(
                jnp.stack([metrics.softmax_mass(method, x, mask[:, g, None]) for g, x in enumerate(logits)], 1)
            )
        if kv is None:
            return attend_groups(q, k, v, mask, layout)
        kq, vq, quant = compacted_round_trip(kv, q, k, v, layout, kept, prompt, rows=rows)
        both = jnp.concatenate([mask & quant, mask & ~quant], axis=-1)  # keys: the quantized copies, then exact
        return attend_groups(q, jnp.concatenate([kq, k], axis=1), jnp.concatenate([vq, v], axis=1), both, layout)

    hidden = module.hidden(tokens, positions, attend)
    return hidden if method is None else (hidden, masses)


def prompt_scores(model, tokens, spec: Eviction) -> list[np.ndarray]:
    """Per layer, float32 [B, Hkv, P]: ``spec``'s scores of the prompt ``tokens`` [B, P] from an exact forward of
    ``model`` (a ``kvjax.Model``). They depend on the method and its window, pooling and noise, not the budget: one
    call serves every budget (``keep``)."""
    return many_prompt_scores(model, tokens, [spec])[0]


def many_prompt_scores(model, tokens, specs) -> list[list[np.ndarray]]:
    """``prompt_scores`` of each of ``specs`` (a sequence of ``Eviction``), from one forward: the same scores, one
    compile for all of them (the eviction bench scores every method of a plan this way)."""
    return scores_and_prefix(model, tokens, specs)[0]


def scores_and_prefix(model, tokens, specs) -> tuple[list[list[np.ndarray]], tuple]:
    """(``many_prompt_scores``, ``prompt_prefix``) of the prompt ``tokens`` from the one forward both need: a caller
    that scores a prompt and then decodes each cut of it (the eviction bench) runs the prompt once."""
    tokens = jnp.asarray(tokens, jnp.int32)
    found, prefix = _many_scores(model.graphdef, model.state, tokens, tuple(specs))
    return [[np.asarray(s) for s in one] for one in found], prefix


def keep(model, scores: list[np.ndarray], spec: Eviction) -> list[np.ndarray]:
    """Per layer, bool [B, Hkv, P]: what each KV head of ``model`` keeps of each prompt row under ``spec``'s budget,
    from ``prompt_scores``."""
    windows = [lay.sliding_window for lay in model.module.layouts]
    rows = [keep_masks(spec, [s[b] for s in scores], windows) for b in range(scores[0].shape[0])]
    return [np.stack([row[layer] for row in rows]) for layer in range(len(scores))]


def group_cut(model, scores: list[np.ndarray], kept: list[np.ndarray], group: int, recent: int) -> list[np.ndarray]:
    """Per layer, bool [B, Hkv, P]: the slot cut ``kept`` (``keep`` of ``scores``) made a cut by whole groups of
    ``group`` positions, as continual eviction cuts a sequence already in quantized pages
    (``continual.compress_groups``): each head keeps its slot count rounded up to whole groups plus its partial group
    (``continual.whole_groups``), the groups chosen by their best slot's ``scores`` with the last ``recent`` slots'
    groups kept (``continual.group_marks``). A group is of positions, as the pages quantized them while the sequence
    grew, so a group cut never quantizes again; a slot cut's survivors are compacted and quantized anew. A layer with
    a sliding window is not cut (continual eviction never cuts one): its heads keep what the window holds."""
    out = []
    for score, mask, lay in zip(scores, kept, model.module.layouts):
        p = mask.shape[-1]
        if lay.sliding_window is not None:
            out.append(np.broadcast_to(np.arange(p) >= p - lay.sliding_window, mask.shape).copy())
            continue
        stored = np.full(mask.shape[:-1], p)  # every position of the prompt is in a head's slots
        target = whole_groups(mask.sum(-1), stored, group)
        marks = np.asarray(group_marks(jnp.asarray(score), stored, target, group, recent))
        tail = np.ones(mask.shape[:-1] + (p % group,), bool)  # the partial group: kept, still exact
        out.append(np.concatenate([np.repeat(marks, group, axis=-1), tail], axis=-1))
    return out


def prompt_keep(model, tokens, spec: Eviction) -> list[np.ndarray]:
    """``keep`` of ``prompt_scores``: what each head keeps of the prompt ``tokens`` [B, P] under ``spec``."""
    return keep(model, prompt_scores(model, tokens, spec), spec)


def prompt_prefix(model, prompt_tokens) -> tuple:
    """The exact forward of ``prompt_tokens`` [B, P] through ``model``, kept for ``hidden_after``: its hidden states
    and each layer's K and V. Every cut of one prompt decodes from the same prefix, so a caller scoring many
    policies (the eviction bench) runs the prompt once. ``scores_and_prefix`` with no policy to score."""
    return scores_and_prefix(model, prompt_tokens, [])[1]


def hidden_after(model, tokens, kept: list[np.ndarray], kv=None, prefix=None) -> jax.Array:
    """Final-norm hidden states [B, T, E] of ``tokens`` [B, T] whose prompt (the first P, P = ``kept``'s last axis)
    was prefilled and then cut to ``kept`` (per layer, bool [B, Hkv, P]) before the rest were decoded; ``kv`` (a
    ``kv_schemes`` scheme, KIVI-style or GEAR): the survivors compacted, then served from its quantized pages.
    ``prefix``: ``prompt_prefix`` of these tokens' prompt (computed here when None). The prompt's rows are its exact
    forward's; the rest cost their rows against the prompt's keys, not a whole [T, T] forward."""
    tokens = jnp.asarray(tokens, jnp.int32)
    prompt = kept[0].shape[-1]
    if kv is not None and not (hasattr(kv, "round_trip") and hasattr(kv, "page_size")):
        raise TypeError(f"kv must be a kvjax.ops.kv_schemes scheme (Kivi, Gear), got {type(kv).__name__}")
    if isinstance(kv, kv_schemes.Zip):
        raise ValueError("kv: ZipCache ranks tokens by probe queries over the whole sequence; not with eviction")
    if not 0 < prompt <= tokens.shape[1]:
        raise ValueError(f"kept covers {prompt} prompt tokens of {tokens.shape[1]}")
    hidden, ks, vs = prompt_prefix(model, tokens[:, :prompt]) if prefix is None else prefix
    if hidden.shape[:2] != (tokens.shape[0], prompt):
        raise ValueError(f"prefix is of {hidden.shape[:2]} prompt tokens, not {(tokens.shape[0], prompt)}")
    if prompt == tokens.shape[1]:
        return hidden
    keep = [jnp.asarray(k) for k in kept]
    rest = _continued_hidden(model.graphdef, model.state, tokens[:, prompt:], prompt, ks, vs, keep, kv)
    return jnp.concatenate([hidden, rest], axis=1)


def evicted_hidden(model, tokens, prompt: int, spec: Eviction) -> tuple[jax.Array, list[np.ndarray]]:
    """(final-norm hidden states [B, T, E], what each head kept: ``prompt_keep``) of ``tokens`` [B, T] whose first
    ``prompt`` tokens are prefilled, then cut by ``spec``, before the rest are decoded (teacher-forced)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if not 0 < prompt <= tokens.shape[1]:
        raise ValueError(f"prompt must be 1..{tokens.shape[1]} tokens, got {prompt}")
    kept = prompt_keep(model, tokens[:, :prompt], spec)
    return hidden_after(model, tokens, kept), kept


def decode_sums(model, tokens, prompt: int, spec: Eviction) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(per layer, float32 [B, Hkv, T]: each token's full-history sum, per layer, bool [B, Hkv, prompt]: what each
    head kept of the prompt) for ``tokens`` [B, T] whose first ``prompt`` were prefilled and cut by ``spec`` (a
    method decode adds to: ``metrics.DECODED``) before the rest were decoded: a kept prompt token's exact sum over
    the prompt's queries (``prompt_scores``) plus what every later query's softmax over the head's kept tokens and
    those since gives it; a later token's from the queries at and after it; 0 on evicted tokens. Brute force over
    the whole [T - prompt, T] softmax: what the engine's ``HeadKVCache.sums`` holds for the tokens each head stores
    once the queries of ``tokens`` have run (tested)."""
    if spec.method not in metrics.DECODED:
        raise ValueError(f"decode adds to the sums of {metrics.DECODED}, not {spec.method!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if not 0 < prompt < tokens.shape[1]:
        raise ValueError(f"prompt must be 1..{tokens.shape[1] - 1} tokens, got {prompt}")
    (scores,), (_, ks, vs) = scores_and_prefix(model, tokens[:, :prompt], [spec])
    kept = keep(model, scores, spec)
    rest = tokens[:, prompt:]
    masks = [jnp.asarray(k) for k in kept]
    noise = (spec.seed, spec.tau)
    _, masses = _continued_hidden(model.graphdef, model.state, rest, prompt, ks, vs, masks, None, spec.method, noise)
    out = []
    for score, mask, mass in zip(scores, kept, masses):
        held = np.pad(mask, ((0, 0), (0, 0), (0, rest.shape[1])), constant_values=True)
        total = np.pad(score, ((0, 0), (0, 0), (0, rest.shape[1]))) + np.asarray(mass, np.float64)
        out.append(np.where(held, total, 0.0))
    return out, kept


def kept_bytes(kept: list[np.ndarray], layouts, kv=None) -> float:
    """The cache bytes the kept prompt tokens take (each head at its own K and V width) over those of every prompt
    token a head would hold uncompressed (at full width; a sliding-window layer's last window only): 1 - the
    overall rate of rank reduction and eviction together, right after the prompt. ``kv`` (a ``kv_schemes`` scheme):
    the kept tokens sit in its pages, each layer's heads at the layer's bytes per token (codes, scales, zeros,
    padding: ``page_bytes``) over its bytes in bfloat16."""
    held = total = 0.0
    for k, lay in zip(kept, layouts):
        p = k.shape[-1]
        widths = np.add(lay.k_widths, lay.v_widths)
        scale = 1.0 if kv is None else sum(kv.page_bytes(lay).values()) / kv.page_size / (2 * float(widths.sum()))
        held += float((k.sum(-1) * widths).sum()) * scale
        total += (
            k.shape[0]
            * lay.num_kv_heads
            * 2
            * lay.head_dim
            * (p if lay.sliding_window is None else min(p, lay.sliding_window))
        )
    return held / total
