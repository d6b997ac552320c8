"""ZipCache (He et al., NeurIPS 2024) as a round trip for teacher-forced scoring: every (sequence, KV head) keeps its
most salient tokens at ``high_bits`` and the rest at ``low_bits``; keys and values share the choice.

``saliency`` ranks tokens by ZipCache's normalized attention from a few probe queries, ``salient_mask`` takes the top
``salient`` fraction, ``encode`` and ``decode`` store and rebuild both classes (keys by ``keys``: "channel", "paged"
or "separable"; values channel-separable token-wise; every scale, zero and normalizer float16), and ``round_trip``
ranks the whole sequence once and quantizes every token, as after a prefill of all of it (the decode cadence,
``DECODE_GAP``, is not modelled). ``token_bytes`` counts what is stored, the one-bit precision map included.
Defaults are the reference implementation's (github.com/ThisisBillhe/ZipCache, commit b6932b9). Where kvjax differs
from it: ranges and normalizers per sequence and KV head (never pooled over the batch or across heads), a token's
probe sum divided by the probes that see it (the paper's rule; the reference's ``T - i`` favours late tokens), probes
drawn without replacement from ``spec.seed`` (bench/notes/2026-12-04-module-docstrings.md has the full account).
Why paged keys: bench/results/quantization.md "Every scheme at 4K windows".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.ops.grouped import visible
from kvjax.ops.quant import META_DTYPE, check_bits, dequantize, pack, quantize, unpack

KEY_SCHEMES = ("channel", "separable", "paged")
DECODE_GAP = 100  # the reference's decode refresh cadence (``streaming_gap``); not modelled by ``round_trip``
_EPS = 1e-9  # slack for fractions times lengths landing a hair under an integer


def _fraction(name: str, x, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    below = float(x) <= low if low_open else float(x) < low
    above = float(x) >= high if high_open else float(x) > high
    if below or above:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {span}, got {x!r}")


@dataclasses.dataclass(frozen=True)
class ZipSpec:
    """ZipCache's settings: bits of salient and other tokens, the salient fraction, the probe fractions (of the
    sequence's length), the probes' random seed and the keys' scheme (module docstring). Defaults: the reference's."""

    high_bits: int = 4
    low_bits: int = 2
    salient: float = 0.6
    probe_recent: float = 0.05
    probe_random: float = 0.05
    seed: int = 0
    keys: str = "channel"
    key_group: int = 32  # tokens of one class a key range covers with ``keys="paged"`` (a page: ``quant.GROUP``)

    def __post_init__(self):
        high, low = check_bits(self.high_bits), check_bits(self.low_bits)
        if high <= low:
            raise ValueError(f"high_bits ({high}) must exceed low_bits ({low})")
        _fraction("salient", self.salient, 0.0, 1.0)
        _fraction("probe_recent", self.probe_recent, 0.0, 1.0, low_open=True)
        _fraction("probe_random", self.probe_random, 0.0, 1.0, high_open=True)
        if float(self.probe_recent) + float(self.probe_random) > 1.0 + _EPS:
            raise ValueError(
                f"probe_recent + probe_random must be at most 1, got {self.probe_recent + self.probe_random}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.keys not in KEY_SCHEMES:
            raise ValueError(f"keys must be one of {', '.join(KEY_SCHEMES)}, got {self.keys!r}")
        group = self.key_group
        if isinstance(group, bool) or not isinstance(group, numbers.Integral) or group < 1:
            raise ValueError(f"key_group must be a positive int, got {group!r}")

    @property
    def ranged(self) -> bool:
        """Whether keys are ranged per channel (no normalizer): ``keys`` "channel" or "paged"."""
        return self.keys != "separable"


def salient_count(t: int, spec: ZipSpec) -> int:
    """Tokens of a sequence of ``t`` kept at high bits: ``t - floor((1 - salient) t)`` (the reference's count)."""
    return t - min(t, math.floor((1.0 - float(spec.salient)) * t + _EPS))


def probe_positions(t: int, spec: ZipSpec) -> np.ndarray:
    """The probe queries of a sequence of ``t`` tokens, sorted: the last ``ceil(probe_recent t)`` positions (at least
    the last one) and ``floor(probe_random t)`` distinct positions drawn from those before them (seed ``spec.seed``)."""
    if t < 1:
        raise ValueError(f"a sequence needs at least one token, got {t}")
    recent = min(t, max(1, math.ceil(float(spec.probe_recent) * t - _EPS)))
    pool = t - recent
    drawn = min(pool, math.floor(float(spec.probe_random) * t + _EPS))
    rng = np.random.default_rng(spec.seed)
    chosen = rng.choice(pool, drawn, replace=False) if drawn else np.zeros(0, np.int64)
    return np.sort(np.concatenate([chosen, np.arange(pool, t)])).astype(np.int32)


def _k_heads(layout: HeadLayout):
    """Per KV head: (K width, first Q column, first K column)."""
    return zip(
        layout.k_widths, HeadLayout.offsets(layout.k_widths, layout.group_size), HeadLayout.offsets(layout.k_widths)
    )


def saliency(q, k, layout: HeadLayout, spec: ZipSpec, probes=None) -> jnp.ndarray:
    """Normalized attention [B, heads, T] float32 of each token of K [B, T, k_cols] per KV head, from the queries of
    Q [B, T, q_cols] at ``probes`` (positions; default ``probe_positions(T, spec)``): each probe's causal softmax row
    (softmax scale ``1/sqrt(head_dim)``) summed over the head's query group and over the probes, divided by the
    number of probes that see the token (0 for a token no probe sees)."""
    t = k.shape[1]
    probes = probe_positions(t, spec) if probes is None else np.asarray(probes)
    if probes.ndim != 1 or probes.size == 0 or probes.min() < 0 or probes.max() >= t:
        raise ValueError(f"probes must be a non-empty list of positions in [0, {t})")
    return _saliency(q, k, layout, tuple(int(p) for p in probes))


@functools.partial(jax.jit, static_argnames=("layout", "probes"))
def _saliency(q, k, layout: HeadLayout, probes: tuple[int, ...]) -> jnp.ndarray:
    b, t, _ = k.shape
    g, scale, n = layout.group_size, 1.0 / math.sqrt(layout.head_dim), len(probes)
    at = jnp.asarray(probes, jnp.int32)
    seen = visible(at[:, None], jnp.arange(t)[None, :], layout.sliding_window)  # [P, T]
    count = jnp.sum(seen, axis=0).astype(jnp.float32)
    qp = q[:, at].astype(jnp.float32)
    sums = []
    for kw, qo, ko in _k_heads(layout):
        qg = qp[..., qo : qo + g * kw].reshape(b, n, g, kw)
        scores = jnp.einsum("bpgd,btd->bgpt", qg, k[..., ko : ko + kw].astype(jnp.float32)) * scale
        probs = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
        sums.append(jnp.sum(probs, axis=(1, 2)))
    total = jnp.stack(sums, axis=1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def full_saliency(q, k, layout: HeadLayout) -> jnp.ndarray:
    """``saliency`` with every query a probe: the exact normalized attention (tests; quadratic in T)."""
    return saliency(q, k, layout, ZipSpec(), probes=np.arange(k.shape[1]))


def salient_mask(scores: jnp.ndarray, spec: ZipSpec) -> jnp.ndarray:
    """bool [B, heads, T]: each (sequence, head)'s ``salient_count`` tokens of highest score (ties: the earlier)."""
    t = scores.shape[-1]
    n = salient_count(t, spec)
    if n in (0, t):
        return jnp.full(scores.shape, n == t)
    _, top = jax.lax.top_k(scores, n)
    return jnp.any(top[..., :, None] == jnp.arange(t), axis=-2)


def _classes(mask_h: jnp.ndarray):
    """A head's slots [B, T]: where each position goes when its salient tokens come first, in order, then the
    others in order; and the inverse (the position in each slot)."""
    n_high = jnp.sum(mask_h, axis=-1, keepdims=True)
    slot = jnp.where(mask_h, jnp.cumsum(mask_h, axis=-1) - 1, n_high + jnp.cumsum(~mask_h, axis=-1) - 1)
    rows = jnp.arange(mask_h.shape[0])[:, None]
    order = jnp.zeros_like(slot).at[rows, slot].set(jnp.broadcast_to(jnp.arange(mask_h.shape[-1]), slot.shape))
    return order, slot


def _normalizer(x32: jnp.ndarray) -> jnp.ndarray:
    """float16 [B, 1, w]: ``sqrt(max_t |x|)`` per channel of each sequence (1 for an all-zero channel)."""
    n = jnp.sqrt(jnp.max(jnp.abs(x32), axis=1, keepdims=True))
    n = jnp.minimum(n, float(jnp.finfo(META_DTYPE).max)).astype(META_DTYPE)
    return jnp.where(n > 0, n, jnp.ones_like(n))


def _paged(part, bits: int, group: int):
    """(codes [B, n, w], meta [B, 2, ceil(n / group), w]): one range per channel for every ``group`` rows in order
    (the last group padded by repeating its last row, which widens no range)."""
    b, n, w = part.shape
    groups = -(-n // group)
    padded = jnp.pad(part, ((0, 0), (0, groups * group - n), (0, 0)), mode="edge")
    codes, scale, zero = quantize(padded.reshape(b, groups, group, w), bits, axis=2)
    return codes.reshape(b, groups * group, w)[:, :n], jnp.stack([scale[:, :, 0], zero[:, :, 0]], axis=1)


def _encode_head(x, order, n_high: int, spec: ZipSpec, keys: str):
    """One KV head's columns x [B, T, w] read as ``keys`` ("channel", "paged" or "separable": values are read as
    "separable") -> ({"high"/"low": (packed codes, meta)}, normalizer or None): meta float16 [B, 2, w] (channel
    ranges: scale row, zero row), [B, 2, groups, w] (paged: a scale and zero row a group) or [B, 2, n, 1] (token
    ranges: scales, zeros); an empty class has no codes and no meta."""
    b, t, w = x.shape
    x32 = x.astype(jnp.float32)
    norm = _normalizer(x32) if keys == "separable" else None
    if norm is not None:
        x32 = x32 / norm.astype(jnp.float32)
    xs = jnp.take_along_axis(x32, order[..., None], axis=1)
    out = {}
    for name, part, bits in (("high", xs[:, :n_high], spec.high_bits), ("low", xs[:, n_high:], spec.low_bits)):
        if part.shape[1] == 0:
            empty = {"channel": (b, 0, 0), "paged": (b, 2, 0, w), "separable": (b, 2, 0, 1)}[keys]
            out[name] = (jnp.zeros((b, 0, w * bits // 8), jnp.uint8), jnp.zeros(empty, META_DTYPE))
            continue
        if keys == "paged":
            codes, meta = _paged(part, bits, spec.key_group)
        else:
            codes, scale, zero = quantize(part, bits, axis=1 if keys == "channel" else -1)
            meta = jnp.concatenate([scale, zero], axis=1) if keys == "channel" else jnp.stack([scale, zero], axis=1)
        out[name] = (pack(codes, bits), meta)
    return out, norm


@functools.partial(jax.jit, static_argnames=("layout", "spec"))
def encode(q, k, v, layout: HeadLayout, spec: ZipSpec, scores=None) -> dict[str, jnp.ndarray]:
    """ZipCache's stored form of whole sequences K [B, T, k_cols], V [B, T, v_cols] (saliency from Q [B, T, q_cols]
    unless ``scores`` [B, heads, T] is given). Parts (``token_bytes`` counts the same names), n = 8 // bits:
      ``{k,v}_codes_high`` uint8 [B, n_high, cols / n]: row i of head h is head h's i-th salient token, each head's
          codes packed in planes (``quant.pack``); ``{k,v}_codes_low`` likewise for the other tokens;
      ``k_meta_{high,low}`` float16: channel keys [B, 2, k_cols] (scale row, zero row; [B, 0, 0] for an empty class),
          paged keys [B, 2, ceil(n_class / key_group), k_cols] (a scale and zero row a group of the class's tokens),
          separable keys [B, 2, n_class, heads] (scales, zeros per token and head); ``v_meta_{high,low}`` likewise;
      ``v_norm`` (and ``k_norm`` for separable keys) float16 [B, cols]: the channel normalizers;
      ``map`` uint8 [B, heads, ceil(T / 8)]: the salient bits, ``numpy.packbits`` order."""
    t = k.shape[1]
    scores = saliency(q, k, layout, spec) if scores is None else scores
    mask = salient_mask(scores, spec)
    n_high = salient_count(t, spec)
    kv: dict[str, list] = {"k": [], "v": []}
    norms: dict[str, list] = {"k": [], "v": []}
    for h, (kw, vw) in enumerate(zip(layout.k_widths, layout.v_widths)):
        order, _ = _classes(mask[:, h])
        ko, vo = HeadLayout.offsets(layout.k_widths)[h], HeadLayout.offsets(layout.v_widths)[h]
        for name, x, keys in (("k", k[..., ko : ko + kw], spec.keys), ("v", v[..., vo : vo + vw], "separable")):
            parts, norm = _encode_head(x, order, n_high, spec, keys)
            kv[name].append(parts)
            norms[name].append(norm)
    out = {}
    for name in ("k", "v"):
        chan = spec.ranged and name == "k"
        for cls in ("high", "low"):
            out[f"{name}_codes_{cls}"] = jnp.concatenate([p[cls][0] for p in kv[name]], axis=-1)
            metas = [p[cls][1] for p in kv[name]]
            out[f"{name}_meta_{cls}"] = jnp.concatenate(metas, axis=-1)
        if not chan:
            out[f"{name}_norm"] = jnp.concatenate(norms[name], axis=-1)[:, 0]
    out["map"] = jnp.packbits(mask, axis=-1)
    return out


def _decode_head(codes, meta, bits: int, keys: str, h: int, cols: tuple[int, int], group: int):
    """One class of one head, read as ``keys`` (``_encode_head``), back to float32 [B, n, w] (before the
    normalizer)."""
    a, b = cols
    n = 8 // bits
    c = unpack(codes[..., a // n : b // n], bits)
    if keys == "channel":
        return dequantize(c, meta[:, 0:1, a:b], meta[:, 1:2, a:b])
    if keys == "paged":
        scale, zero = (jnp.repeat(meta[:, i, :, a:b], group, axis=1)[:, : c.shape[1]] for i in (0, 1))
        return dequantize(c, scale, zero)
    return dequantize(c, meta[:, 0, :, h : h + 1], meta[:, 1, :, h : h + 1])


@functools.partial(jax.jit, static_argnames=("layout", "spec", "dtype"))
def decode(parts: dict[str, jnp.ndarray], layout: HeadLayout, spec: ZipSpec, dtype=jnp.float32):
    """``encode``'s inverse up to the rounding: -> (K [B, T, k_cols], V [B, T, v_cols]) in ``dtype``."""
    t = parts["k_codes_high"].shape[1] + parts["k_codes_low"].shape[1]
    paged = parts["k_meta_high"].ndim == 4 and parts["k_meta_high"].shape[-1] == layout.k_cols
    if (
        salient_count(t, spec) != parts["k_codes_high"].shape[1]
        or spec.ranged != ("k_norm" not in parts)
        or (spec.keys == "paged") != paged
    ):
        raise ValueError("these parts were not encoded with this spec")
    mask = jnp.unpackbits(parts["map"], axis=-1, count=t).astype(bool)
    out: dict[str, list] = {"k": [], "v": []}
    for h in range(layout.num_kv_heads):
        _, slot = _classes(mask[:, h])
        for name, widths in (("k", layout.k_widths), ("v", layout.v_widths)):
            keys = spec.keys if name == "k" else "separable"
            a = HeadLayout.offsets(widths)[h]
            cols = (a, a + widths[h])
            rows = []
            for cls, bits in (("high", spec.high_bits), ("low", spec.low_bits)):
                codes, meta = parts[f"{name}_codes_{cls}"], parts[f"{name}_meta_{cls}"]
                if codes.shape[1]:
                    rows.append(_decode_head(codes, meta, bits, keys, h, cols, spec.key_group))
            x = jnp.take_along_axis(jnp.concatenate(rows, axis=1), slot[..., None], axis=1)
            if keys == "separable":
                x = x * parts[f"{name}_norm"][:, None, cols[0] : cols[1]].astype(jnp.float32)
            out[name].append(x)
    return jnp.concatenate(out["k"], axis=-1).astype(dtype), jnp.concatenate(out["v"], axis=-1).astype(dtype)


def round_trip(q, k, v, layout: HeadLayout, spec: ZipSpec, scores=None):
    """Teacher-forced ZipCache: K [B, T, k_cols] and V [B, T, v_cols] as decode would read them had the whole
    sequence been prefilled and stored (module docstring) -> (k_hat, v_hat) in K's and V's dtypes. ``scores``
    [B, heads, T] replaces the probe saliency (ablations)."""
    k_hat, v_hat = decode(encode(q, k, v, layout, spec, scores), layout, spec)
    return k_hat.astype(k.dtype), v_hat.astype(v.dtype)


def token_bytes(layout: HeadLayout, spec: ZipSpec, tokens: int) -> dict[str, float]:
    """Mean bytes per token of one layer by part, for sequences of ``tokens`` tokens (``encode``'s parts, every byte
    counted): the codes of the ``salient_count`` high and the other low tokens, the per-token scales and zeros (values;
    separable keys), the channel keys' two ranges per channel and the channel normalizers (amortised over ``tokens``;
    paged keys: two rows a group of ``key_group`` tokens of a class), and the precision map (a bit per token and KV
    head, rounded up to whole bytes per sequence). The sum is the format's honest rate."""
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    t, heads, meta = int(tokens), layout.num_kv_heads, jnp.dtype(META_DTYPE).itemsize
    n_high = salient_count(t, spec)
    counts = {"high": (n_high, spec.high_bits), "low": (t - n_high, spec.low_bits)}
    out = {}
    for name, cols in (("k", layout.k_cols), ("v", layout.v_cols)):
        chan = spec.ranged and name == "k"
        for cls, (n, bits) in counts.items():
            out[f"{name}_codes_{cls}"] = n * cols * bits / 8 / t
            ranges = -(-n // spec.key_group) if spec.keys == "paged" else int(n > 0)
            out[f"{name}_meta_{cls}"] = (2 * cols * meta * ranges if chan else 2 * n * heads * meta) / t
        if not chan:
            out[f"{name}_norm"] = cols * meta / t
    out["map"] = heads * math.ceil(t / 8) / t
    return out
