"""KIVI-style quantized pages: the codes, scales and zero points of one page of K or V (``PageFormat``), and their jnp
reference (``quantize``, ``dequantize``, ``simulate``).

Keys are quantized per channel over a page's tokens (KIVI, section 3), values per token and head. A b-bit code c in
[0, 2^b) stands for ``zero + scale * c`` with ``scale = (max - min) / (2^b - 1)`` and ``zero = min``, so a value comes
back within ``scale / 2`` of itself, plus the rounding of the stored scale and zero (``bound``). Codes are packed
``n = 8 // b`` to a byte in planes (``pack``): byte column ``j`` of a head of width ``w`` holds columns ``j, j + w/n,
...``, the first in the lowest bits, so a kernel scores ``q[:, block]`` against each unpacked block with no
permutation (``../shared/DESIGN.md``, "Quantized pages"). Head widths are multiples of 16: whole planes at 4 and 2 bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout

BITS = (4, 2)  # code widths a page may hold
# Tokens a quantized page by default: the keys' group, so their scale and zero per column cost 4 bytes over 32
# tokens, a quarter of an int4 code's half byte (KIVI's group; 16 would make them half)
GROUP = 32
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
    scale, zero = _ranged(lo, hi, levels)
    return _rounded(x32, scale, zero, levels), scale, zero


def _ranged(lo, hi, levels: int):
    """(scale, zero) as stored for the float32 range [lo, hi]."""
    zero = lo.astype(META_DTYPE)
    return ((hi - zero.astype(jnp.float32)) / levels).astype(META_DTYPE), zero


def _rounded(x32, scale, zero, levels: int):
    """The codes of float32 ``x32`` against the stored ``scale`` and ``zero`` (broadcast against it).

    Steps are a multiply by the scale's reciprocal, never a division: XLA rewrites ``a / broadcast(b)`` into
    ``a * broadcast(1 / b)`` where the divisor happens to be a broadcast and not where it is a gather, so a division
    here would round a code one step apart depending on how the caller shaped its scales."""
    s32 = scale.astype(jnp.float32)
    inverse = jnp.where(s32 > 0, 1.0 / jnp.where(s32 > 0, s32, 1.0), 0.0)
    steps = (x32 - zero.astype(jnp.float32)) * inverse
    return jnp.clip(jnp.round(steps), 0, levels).astype(jnp.uint8)


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
    """Pages of keys [..., T, sum(widths)] (heads side by side at their ``widths``) -> (packed uint8
    [..., T, sum(widths) * bits / 8], scale [..., sum(widths)], zero [..., sum(widths)]): each column its own range
    over the page's T tokens, each head's columns packed in planes of their own."""
    codes, scale, zero = quantize(k, bits, axis=-2)
    return _packed(codes, widths, bits), scale[..., 0, :], zero[..., 0, :]


def dequantize_keys(packed: jnp.ndarray, scale, zero, widths, bits: int, dtype=jnp.float32) -> jnp.ndarray:
    """``quantize_keys``'s page back to [T, sum(widths)]."""
    n = 8 // check_bits(bits)
    codes = jnp.concatenate([unpack(packed[:, a // n : b // n], bits) for a, b in _heads(widths)], axis=-1)
    return dequantize(codes, scale[None, :], zero[None, :], dtype)


def quantize_values(v: jnp.ndarray, widths, bits: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Pages of values [..., T, sum(widths)] -> (packed uint8 [..., T, sum(widths) * bits / 8], scale [..., T, heads],
    zero [..., T, heads]): each token's row of each head its own range, every head at once (heads padded to the
    widest and masked)."""
    levels = (1 << check_bits(bits)) - 1
    v32 = v.astype(jnp.float32)
    cols, real = _head_columns(widths)
    vh = v32[..., cols]  # [..., T, heads, widest]
    scale, zero = _ranged(jnp.where(real, vh, jnp.inf).min(axis=-1), jnp.where(real, vh, -jnp.inf).max(axis=-1), levels)
    head = np.repeat(np.arange(len(widths)), widths)
    return _packed(_rounded(v32, scale[..., head], zero[..., head], levels), widths, bits), scale, zero


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


ALIGN = 16  # every part of a page starts at a multiple of 16 bytes: a kernel's loads stay whole vectors


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HeadWidths:
    """What a page format's ``k_widths`` and ``v_widths`` (one entry a KV head) give: its column and head counts."""

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]

    @property
    def k_cols(self) -> int:
        return int(sum(self.k_widths))

    @property
    def v_cols(self) -> int:
        return int(sum(self.v_widths))

    @property
    def heads(self) -> int:
        return len(self.v_widths)

    @classmethod
    def check_serves(cls, layout: HeadLayout, fmt, name: str):
        """``fmt`` if it is one of this class (``name``: what a kernel calls it) with ``layout``'s heads, else a
        ValueError saying why not."""
        if not isinstance(fmt, cls):
            raise ValueError(f"fmt must be a {name}, got {type(fmt).__name__}")
        if fmt.k_widths != tuple(layout.k_widths) or fmt.v_widths != tuple(layout.v_widths):
            raise ValueError(
                f"fmt's heads (k_widths={fmt.k_widths}, v_widths={fmt.v_widths}) do not match the layout's "
                f"(k_widths={layout.k_widths}, v_widths={layout.v_widths})"
            )
        return fmt


@dataclasses.dataclass(frozen=True)
class PageFormat(HeadWidths):
    """One layer's quantized page: ``page_size`` tokens of every KV head as a flat run of ``page_bytes`` bytes, so a
    layer's pool is one uint8 array [num_pages, page_bytes] written one whole page at a time (one scatter a layer).

    Parts, in order, each starting at a multiple of ``ALIGN`` bytes (``offsets``):
      ``k_codes`` [page_size, k_cols / n] uint8, every head's planes side by side (``quantize_keys``);
      ``v_codes`` [page_size, v_cols / n] uint8 (``quantize_values``);
      ``k_meta``  [2, k_cols] float16: the keys' scale row, then their zero row (one range per column of the page);
      ``v_meta``  [2, heads, page_size] float16: the values' scales, then their zeros (one range per token and head;
                  a head's run contiguous, so a kernel reads it as one vector: a load narrower than 32 bits a lane is
                  never pipelined by Triton, and strided metadata made the decode kernel 2.2x slower,
                  bench/results/quantization.md "Quantized pages: decode kernel lab").
    ``n = 8 // bits`` codes a byte. The key group is the page (``../shared/DESIGN.md``, "Quantized pages"), so a
    page carries one scale and zero vector per head and a kernel streams whole pages."""

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]
    page_size: int
    bits: int

    def __post_init__(self):
        check_bits(self.bits)
        n = 8 // self.bits
        if any(w % n for w in self.k_widths + self.v_widths):
            raise ValueError(f"head widths must split into {n} planes of {self.bits}-bit codes")

    @classmethod
    def for_layout(cls, layout: HeadLayout, page_size: int, bits: int) -> PageFormat:
        return cls(tuple(layout.k_widths), tuple(layout.v_widths), int(page_size), check_bits(bits))

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def sizes(self) -> dict[str, int]:
        """Bytes of each part of a page (``page_bytes``' accounting, before alignment)."""
        return page_bytes(self.k_widths, self.v_widths, self.page_size, self.bits)

    @property
    def offsets(self) -> dict[str, int]:
        """Each part's first byte in a page: k_codes, v_codes, k_meta, v_meta."""
        s, out, at = self.sizes(), {}, 0
        for part, size in (
            ("k_codes", "k_codes"),
            ("v_codes", "v_codes"),
            ("k_meta", "k_scales"),
            ("v_meta", "v_scales"),
        ):
            out[part], at = at, _aligned(at + s[size])
        return out

    @property
    def page_bytes(self) -> int:
        """A page's bytes, every part with its alignment padding."""
        return self.offsets["v_meta"] + _aligned(self.sizes()["v_scales"])

    def bytes_by_part(self) -> dict[str, int]:
        """``sizes`` and the page's alignment padding: every byte of a page, by part (they sum to ``page_bytes``)."""
        sizes = self.sizes()
        return {**sizes, "padding": self.page_bytes - sum(sizes.values())}

    def round_trip(self, q, k, v, layout=None):
        """``simulate`` as the scheme protocol of ``kv_schemes`` has it (q and layout unused)."""
        return simulate(k, v, self)

    def encode(self, k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
        """Pages of keys [..., page_size, k_cols] and values [..., page_size, v_cols] -> uint8 [..., page_bytes]:
        ``quantize_keys`` and ``quantize_values`` of every page at once, in a few whole-array operations whatever
        the number of heads. A decode step encodes its filling pages with it: per-head slices made the int4 step's
        writes about 36 kernels a layer, whole arrays about 12 (bench/results/engine.md "Engine: quantized pages")."""
        lead, p = k.shape[:-2], self.page_size
        kp, ks, kz = quantize_keys(k.reshape(-1, p, self.k_cols), self.k_widths, self.bits)
        vp, vs, vz = quantize_values(v.reshape(-1, p, self.v_cols), self.v_widths, self.bits)
        m = kp.shape[0]
        parts = [
            kp.reshape(m, -1),
            vp.reshape(m, -1),
            _bytes(jnp.stack([ks, kz], 1)),  # [m, 2, k_cols]
            _bytes(jnp.swapaxes(jnp.stack([vs, vz], 1), -1, -2)),  # [m, 2, heads, P]
        ]
        pieces, at = [], 0
        for part, start in zip(parts, self.offsets.values()):
            pieces += [jnp.zeros((m, start - at), jnp.uint8), part]
            at = start + part.shape[1]
        pieces.append(jnp.zeros((m, self.page_bytes - at), jnp.uint8))
        return jnp.concatenate(pieces, axis=1).reshape(*lead, self.page_bytes)

    def parts(self, pages: jnp.ndarray) -> dict[str, jnp.ndarray]:
        """uint8 pages [..., page_bytes] -> their parts: k_codes [..., P, k_cols / n], v_codes [..., P, v_cols / n],
        k_scale and k_zero [..., k_cols] float16, v_scale and v_zero [..., P, heads] float16."""
        lead, p, n, at = pages.shape[:-1], self.page_size, self.per_byte, self.offsets

        def take(part, count):
            return pages[..., at[part] : at[part] + count]

        k_meta = _halves(take("k_meta", 4 * self.k_cols)).reshape(*lead, 2, self.k_cols)
        v_meta = jnp.swapaxes(_halves(take("v_meta", 4 * p * self.heads)).reshape(*lead, 2, self.heads, p), -1, -2)
        return {
            "k_codes": take("k_codes", p * self.k_cols // n).reshape(*lead, p, self.k_cols // n),
            "v_codes": take("v_codes", p * self.v_cols // n).reshape(*lead, p, self.v_cols // n),
            "k_scale": k_meta[..., 0, :],
            "k_zero": k_meta[..., 1, :],
            "v_scale": v_meta[..., 0, :, :],
            "v_zero": v_meta[..., 1, :, :],
        }

    def decode(self, pages: jnp.ndarray, dtype=jnp.float32) -> tuple[jnp.ndarray, jnp.ndarray]:
        """``encode``'s inverse up to the rounding: uint8 [..., page_bytes] -> keys [..., P, k_cols], values
        [..., P, v_cols] in ``dtype``."""
        lead, parts = pages.shape[:-1], self.parts(pages)
        flat = {name: x.reshape(-1, *x.shape[len(lead) :]) for name, x in parts.items()}
        k = jax.vmap(lambda c, s, z: dequantize_keys(c, s, z, self.k_widths, self.bits, dtype))(
            flat["k_codes"], flat["k_scale"], flat["k_zero"]
        )
        v = jax.vmap(lambda c, s, z: dequantize_values(c, s, z, self.v_widths, self.bits, dtype))(
            flat["v_codes"], flat["v_scale"], flat["v_zero"]
        )
        return k.reshape(*lead, *k.shape[1:]), v.reshape(*lead, *v.shape[1:])


def simulate(k, v, fmt: PageFormat):
    """Whole sequences as a cache of ``fmt`` pages serves them, for scoring a sequence at once: K, V [B, T, cols]
    -> (k_quantized, v_quantized) [B, T, cols], each page of ``page_size`` positions round-tripped through the
    format (the last, partial one padded; which positions a query reads quantized is the caller's:
    ``ops.prefill.reference.quantized_causal_attention``)."""
    b, t = k.shape[:2]
    p = fmt.page_size
    pad = -t % p
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, p, k.shape[-1])
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, p, v.shape[-1])
    kq, vq = fmt.decode(fmt.encode(kp, vp), k.dtype)
    return kq.reshape(b, -1, k.shape[-1])[:, :t], vq.reshape(b, -1, v.shape[-1])[:, :t]


def _head_columns(widths) -> tuple[np.ndarray, np.ndarray]:
    """(columns [heads, widest] of each head, padded with its first column; which are real) for heads side by side
    at ``widths``."""
    widest = max(widths)
    cols = np.zeros((len(widths), widest), np.int32)
    for h, (a, b) in enumerate(_heads(widths)):
        cols[h] = a
        cols[h, : b - a] = np.arange(a, b)
    return cols, np.arange(widest)[None, :] < np.asarray(widths)[:, None]


def _packed(codes: jnp.ndarray, widths, bits: int) -> jnp.ndarray:
    """Codes [..., sum(widths)] of heads side by side packed in each head's planes (``pack`` a head, at once):
    byte ``j`` of a head of width ``w`` holds its columns ``j + i w/n``, plane ``i`` in bits ``i * bits``."""
    n = 8 // bits
    src = np.concatenate(
        [
            a + np.arange(w // n)[None, :] + (w // n) * np.arange(n)[:, None]
            for a, w in zip(HeadLayout.offsets(widths), widths)
        ],
        axis=1,
    )  # [n, sum(widths) / n]
    out = codes[..., src[0]]
    for i in range(1, n):
        out = out | (codes[..., src[i]] << (bits * i))
    return out


def _bytes(x: jnp.ndarray) -> jnp.ndarray:
    """float16 [m, ...] -> its bytes, uint8 [m, 2 * size]."""
    return jax.lax.bitcast_convert_type(x.astype(META_DTYPE), jnp.uint8).reshape(x.shape[0], -1)


def _halves(b: jnp.ndarray) -> jnp.ndarray:
    """uint8 [..., 2m] -> float16 [..., m] (``_bytes``' inverse)."""
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), META_DTYPE)
