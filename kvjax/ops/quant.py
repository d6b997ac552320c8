"""KIVI-style quantized pages: the codes, scales and zero points of one page of K or V, and their jnp reference.

Keys are quantized per channel over a page's tokens (KIVI, section 3: keys have outlier channels, so each column
gets a range of its own; the page is the key group), values per token (each token's row of a head its own range).
A b-bit code c in [0, 2^b) stands for ``zero + scale * c`` with ``scale = (max - min) / (2^b - 1)`` and
``zero = min``, so a value comes back within ``scale / 2`` of itself, plus the rounding of the stored scale and
zero (``bound``).

Codes are packed ``8 // b`` to a byte in planes: within a head of width ``w``, byte column ``j`` holds the codes of
columns ``j, j + w/n, ..., j + (n - 1) w/n`` (``n = 8 // b``), the first in the lowest bits. Unpacking a head's bytes
by shift and mask gives ``n`` contiguous blocks of columns, so a kernel scores ``q[:, block]`` against each block
with no permutation (``../shared/DESIGN.md``, "Quantized pages"). Head widths are multiples of 16, so every width
splits into whole planes at 4 and 2 bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout

BITS = (4, 2)  # code widths a page may hold
META_DTYPE = jnp.float16  # scales and zero points: an 11-bit mantissa keeps their rounding well under a step


def check_bits(bits) -> int:
    """``bits`` as an int, or a one-line ValueError naming the widths kvjax quantizes to."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in BITS:
        raise ValueError(f"quantization bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")
    return int(bits)


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Codes (uint8 < 2^bits) [..., w] packed in planes to uint8 [..., w * bits / 8] (module docstring)."""
    bits = check_bits(bits)
    n = 8 // bits
    w = codes.shape[-1]
    if w % n:
        raise ValueError(f"a width of {w} columns does not split into {n} planes of {bits}-bit codes")
    planes = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], n, w // n)
    out = planes[..., 0, :]
    for i in range(1, n):
        out = out | (planes[..., i, :] << (bits * i))
    return out


def unpack(packed: jnp.ndarray, bits: int) -> jnp.ndarray:
    """``pack``'s inverse: uint8 [..., w * bits / 8] -> codes uint8 [..., w]."""
    bits = check_bits(bits)
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
    return jnp.concatenate(planes, axis=-1).astype(jnp.uint8)


def quantize(x: jnp.ndarray, bits: int, axis: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(codes uint8, scale, zero) of ``x`` with one range along ``axis`` (kept as size 1 in scale and zero); scale
    and zero are stored as ``META_DTYPE`` and the codes are rounded against the stored values, so ``dequantize``
    reproduces exactly what a kernel reading the page computes."""
    bits = check_bits(bits)
    levels = (1 << bits) - 1
    x32 = x.astype(jnp.float32)
    lo, hi = jnp.min(x32, axis=axis, keepdims=True), jnp.max(x32, axis=axis, keepdims=True)
    zero = lo.astype(META_DTYPE)
    scale = ((hi - zero.astype(jnp.float32)) / levels).astype(META_DTYPE)
    s32 = scale.astype(jnp.float32)
    steps = jnp.where(s32 > 0, (x32 - zero.astype(jnp.float32)) / jnp.where(s32 > 0, s32, 1.0), 0.0)
    codes = jnp.clip(jnp.round(steps), 0, levels).astype(jnp.uint8)
    return codes, scale, zero


def dequantize(codes: jnp.ndarray, scale: jnp.ndarray, zero: jnp.ndarray, dtype=jnp.float32) -> jnp.ndarray:
    """``zero + scale * codes`` in float32, then ``dtype``."""
    return (zero.astype(jnp.float32) + scale.astype(jnp.float32) * codes.astype(jnp.float32)).astype(dtype)


def bound(x: jnp.ndarray, bits: int, axis: int) -> jnp.ndarray:
    """The most a ``quantize``/``dequantize`` round trip may move each entry of ``x``: half a step, plus the
    rounding of the stored zero (half an ulp of it) and of the stored scale (the step's rounding times the largest
    code), plus float32's own rounding of the sum."""
    levels = (1 << check_bits(bits)) - 1
    x32 = x.astype(jnp.float32)
    lo, hi = jnp.min(x32, axis=axis, keepdims=True), jnp.max(x32, axis=axis, keepdims=True)
    step = (hi - lo) / levels
    ulp = float(jnp.finfo(META_DTYPE).eps)
    return step / 2 + ulp * (jnp.abs(lo) + step * levels + jnp.abs(hi)) + 1e-6 * jnp.abs(x32)


def _heads(widths) -> list[tuple[int, int]]:
    """Each head's (first, past-last) column in a page of heads side by side at ``widths``."""
    return [(start, start + int(w)) for start, w in zip(HeadLayout.offsets(widths), widths)]


def quantize_keys(k: jnp.ndarray, widths, bits: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One page of keys [T, sum(widths)] (heads side by side at their ``widths``) -> (packed uint8
    [T, sum(widths) * bits / 8], scale [sum(widths)], zero [sum(widths)]): each column its own range over the
    page's T tokens, each head's columns packed in planes of their own."""
    codes, scale, zero = quantize(k, bits, axis=0)
    packed = jnp.concatenate([pack(codes[:, a:b], bits) for a, b in _heads(widths)], axis=-1)
    return packed, scale[0], zero[0]


def dequantize_keys(packed: jnp.ndarray, scale, zero, widths, bits: int, dtype=jnp.float32) -> jnp.ndarray:
    """``quantize_keys``'s page back to [T, sum(widths)]."""
    n = 8 // check_bits(bits)
    codes = jnp.concatenate([unpack(packed[:, a // n : b // n], bits) for a, b in _heads(widths)], axis=-1)
    return dequantize(codes, scale[None, :], zero[None, :], dtype)


def quantize_values(v: jnp.ndarray, widths, bits: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One page of values [T, sum(widths)] -> (packed uint8 [T, sum(widths) * bits / 8], scale [T, heads],
    zero [T, heads]): each token's row of each head its own range."""
    parts = [quantize(v[:, a:b], bits, axis=-1) for a, b in _heads(widths)]
    packed = jnp.concatenate([pack(codes, bits) for codes, _, _ in parts], axis=-1)
    return packed, jnp.concatenate([s for _, s, _ in parts], -1), jnp.concatenate([z for _, _, z in parts], -1)


def dequantize_values(packed: jnp.ndarray, scale, zero, widths, bits: int, dtype=jnp.float32) -> jnp.ndarray:
    """``quantize_values``'s page back to [T, sum(widths)]."""
    n = 8 // check_bits(bits)
    heads = _heads(widths)
    rows = [
        dequantize(unpack(packed[:, a // n : b // n], bits), scale[:, h : h + 1], zero[:, h : h + 1], dtype)
        for h, (a, b) in enumerate(heads)
    ]
    return jnp.concatenate(rows, axis=-1)


def page_bytes(k_widths, v_widths, page_size: int, bits: int) -> dict[str, int]:
    """Bytes of one quantized page of a layer, by part, every byte counted (issue 35's honest accounting): the
    key and value codes, the keys' scale and zero per column, the values' scale and zero per token and head."""
    bits, meta = check_bits(bits), jnp.dtype(META_DTYPE).itemsize
    k_cols, v_cols = int(sum(k_widths)), int(sum(v_widths))
    return {
        "k_codes": page_size * k_cols * bits // 8,
        "v_codes": page_size * v_cols * bits // 8,
        "k_scales": 2 * k_cols * meta,
        "v_scales": 2 * page_size * len(v_widths) * meta,
    }


def head_scores(q: jnp.ndarray, packed: jnp.ndarray, scale, zero, bits: int) -> jnp.ndarray:
    """Scores [R, T] of queries q [R, w] against one head's quantized keys (``quantize_keys``' columns of the head:
    packed [T, w * bits / 8], scale and zero [w]) without rebuilding them: ``q . k_t = q . zero + (q * scale) .
    codes_t``, each plane of codes scored against its block of ``q * scale`` (the decode kernel's arithmetic)."""
    n = 8 // check_bits(bits)
    mask, w = (1 << bits) - 1, q.shape[-1]
    qs = q.astype(jnp.float32) * scale.astype(jnp.float32)
    out = (q.astype(jnp.float32) @ zero.astype(jnp.float32))[:, None]
    for i in range(n):
        plane = ((packed >> (bits * i)) & mask).astype(jnp.float32)  # [T, w / n]: columns i w/n ...
        out = out + qs[:, i * w // n : (i + 1) * w // n] @ plane.T
    return out


def head_values(p: jnp.ndarray, packed: jnp.ndarray, scale, zero, bits: int) -> jnp.ndarray:
    """Outputs [R, w] of attention weights p [R, T] over one head's quantized values (``quantize_values``' columns
    of the head: packed [T, w * bits / 8], scale and zero [T]) without rebuilding them: ``sum_t p_t v_t =
    (p * scale) . codes + p . zero``, plane by plane into its block of columns."""
    n = 8 // check_bits(bits)
    mask = (1 << bits) - 1
    ps = p.astype(jnp.float32) * scale.astype(jnp.float32)[None, :]
    base = p.astype(jnp.float32) @ zero.astype(jnp.float32)
    blocks = [ps @ ((packed >> (bits * i)) & mask).astype(jnp.float32) for i in range(n)]
    return jnp.concatenate(blocks, axis=-1) + base[:, None]
