"""GEAR (Kang et al. 2024) as a page-wise round trip: each full page of each KV head, a matrix X [P, w], is stored as
``D + L + S``: S, a fraction ``outliers`` of X's entries kept exact (float16, with their positions); D, the rest
quantized as kvjax's KIVI-style pages are (``quant``); L = A B^T, a rank-``rank`` approximation of ``X - D`` (float16
factors from ``iterations`` steps of power iteration from a fixed start, so deterministic). The reconstruction is
``D + L`` with the outliers put back; with no outliers and no L it is ``quant.simulate`` exactly.

Entry points: ``GearSpec``, ``round_trip``, ``GearPageFormat`` (the engine's page, ``quant.PageFormat``'s interface)
and ``page_bytes``, which counts every stored part. ``scores_low_rank`` scores L as ``(q B) A^T`` without rebuilding
it. Defaults follow the authors' reference implementation (github.com/opengear-project/GEAR, read at efe0bfe), with
the page as its streaming buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.layout import HeadLayout
from kvjax.ops import quant

STREAM_RANK = 2  # the reference's rank for each streaming buffer (--rank 2 --rankv 2): a page's, here
PREFILL_RANK = 4  # the reference's rank for the prefilled matrix (--prefillrank 4 --prefillrankv 4)
OUTLIERS = 0.02  # fraction of entries kept exact (--left 0.02)
ITERATIONS = 3  # power iteration steps (--loop 3)
FACTOR_DTYPE = jnp.float16  # low-rank factors and outlier values, as stored
_INIT_SEED = 0x6EA2  # the power iteration's fixed start
_HI = lax.Precision.HIGHEST  # small matmuls: f32 throughout, no TF32 on GPUs


def _whole(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class GearSpec:
    """GEAR on kvjax pages: ``bits``-bit KIVI codes, a rank-``rank`` residual per head and page, a fraction
    ``outliers`` of each head's page entries kept exact; ``iterations`` steps of power iteration."""

    bits: int
    rank: int
    outliers: float
    page_size: int = quant.GROUP
    iterations: int = ITERATIONS

    def __post_init__(self):
        quant.check_bits(self.bits)
        if not _whole(self.rank) or self.rank < 1:
            raise ValueError(f"GEAR rank must be an integer >= 1, got {self.rank!r}")
        real = isinstance(self.outliers, (int, float, np.floating, np.integer)) and not isinstance(self.outliers, bool)
        if not real or not 0 <= self.outliers < 0.5:
            raise ValueError(f"GEAR outliers must be a fraction in [0, 0.5), got {self.outliers!r}")
        if not _whole(self.page_size) or self.page_size < 1:
            raise ValueError(f"GEAR page_size must be an integer >= 1, got {self.page_size!r}")
        if not _whole(self.iterations) or self.iterations < 1:
            raise ValueError(f"GEAR iterations must be an integer >= 1, got {self.iterations!r}")
        if self.rank > self.page_size:
            raise ValueError(f"GEAR rank {self.rank} exceeds the page's {self.page_size} tokens")

    @classmethod
    def paper(cls, bits: int, page_size: int = quant.GROUP) -> GearSpec:
        """The reference's streaming-buffer settings: rank 2, 2% outliers, 3 iterations."""
        return cls(bits, STREAM_RANK, OUTLIERS, page_size, ITERATIONS)

    def outlier_count(self, width: int) -> int:
        """Outliers kept in one page of one head ``width`` wide: ``floor(outliers * page_size * width)``."""
        return math.floor(round(float(self.outliers) * self.page_size * int(width), 9))


def index_bits(page_size: int, width: int) -> int:
    """Bits an outlier's position within a page's head block of ``page_size * width`` entries needs."""
    return max(1, (int(page_size) * int(width) - 1).bit_length())


def _index_dtype(page_size: int, width: int):
    """The smallest unsigned integer holding ``index_bits``: how positions are stored (and counted)."""
    bits = index_bits(page_size, width)
    return jnp.uint8 if bits <= 8 else jnp.uint16 if bits <= 16 else jnp.uint32


def _check(layout: HeadLayout, spec: GearSpec) -> None:
    _check_widths(tuple(layout.k_widths), tuple(layout.v_widths), spec)


def _check_widths(k_widths: tuple[int, ...], v_widths: tuple[int, ...], spec: GearSpec) -> None:
    """Heads of these widths can be GEAR pages of ``spec``: widths that split into planes of codes, none narrower
    than the rank."""
    quant.PageFormat(k_widths, v_widths, spec.page_size, spec.bits)
    narrowest = min(k_widths + v_widths)
    if spec.rank > narrowest:
        raise ValueError(f"GEAR rank {spec.rank} exceeds the narrowest head's {narrowest} columns")


def _by_width(widths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(width, the heads of that width in order) for each distinct width, ascending: how heads of one width are
    stored as one array."""
    return [(w, [h for h, hw in enumerate(widths) if hw == w]) for w in sorted(set(widths))]


def _start(width: int, rank: int) -> np.ndarray:
    """The power iteration's start [width, rank]: column j drawn from a generator seeded by (width, j) alone."""
    cols = [np.random.default_rng((_INIT_SEED, width, j)).standard_normal(width) for j in range(rank)]
    return np.stack(cols, axis=-1).astype(np.float32)


def _low_rank(r: jnp.ndarray, rank: int, iterations: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Factors A [..., P, rank], B [..., w, rank] (float16) of residuals r [..., P, w] with ``A B^T ~ r``: subspace
    iteration from a fixed start, A orthonormal, ``B = r^T A``."""
    b = jnp.broadcast_to(jnp.asarray(_start(r.shape[-1], rank)), (*r.shape[:-2], r.shape[-1], rank))
    rt = jnp.swapaxes(r, -1, -2)
    for _ in range(iterations):
        a, _ = jnp.linalg.qr(jnp.matmul(r, b, precision=_HI))
        b = jnp.matmul(rt, a, precision=_HI)
    return a.astype(FACTOR_DTYPE), b.astype(FACTOR_DTYPE)


def _outliers(x: jnp.ndarray, axis: int, count: int):
    """The ``count`` entries of each block x [..., P, w] farthest from their group's mean (the group: ``axis``):
    (mask [..., P, w], positions [..., count] within the block, flattened row-major)."""
    dev = jnp.abs(x - jnp.mean(x, axis=axis, keepdims=True))
    lead, n = x.shape[:-2], x.shape[-2] * x.shape[-1]
    _, idx = lax.top_k(dev.reshape(*lead, n), count)
    m = math.prod(lead)
    flat = idx.reshape(m, count)
    mask = jnp.zeros((m, n), bool).at[jnp.arange(m)[:, None], flat].set(True, unique_indices=True)
    return mask.reshape(x.shape), idx


def _encode_block(x: jnp.ndarray, spec: GearSpec, keys: bool, low_rank: bool):
    """Heads of one width, x [..., P, w] float32 -> (reconstruction [..., P, w] float32, stored parts)."""
    axis = -2 if keys else -1  # the quantization group: a key's column over the page, a value's row of the head
    p, w = x.shape[-2:]
    count = spec.outlier_count(w)
    parts: dict[str, jnp.ndarray] = {}
    exact = x.astype(FACTOR_DTYPE)
    if count:
        mask, idx = _outliers(x, axis, count)
        inliers = jnp.sum(~mask, axis=axis, keepdims=True)
        fill = jnp.sum(jnp.where(mask, 0.0, x), axis=axis, keepdims=True) / jnp.maximum(inliers, 1)
        parts["outliers"] = jnp.take_along_axis(exact.reshape(*x.shape[:-2], p * w), idx, axis=-1)
        parts["outlier_index"] = idx.astype(_index_dtype(p, w))
        body = jnp.where(mask, fill, x)
    else:
        mask, body = None, x
    codes, scale, zero = quant.quantize(body, spec.bits, axis)
    parts["codes"] = quant.pack(codes, spec.bits)
    parts["scale"], parts["zero"] = scale, zero
    out = quant.dequantize(codes, scale, zero)
    if low_rank:
        a, b = _low_rank(x - out if mask is None else jnp.where(mask, 0.0, x - out), spec.rank, spec.iterations)
        parts["a"], parts["b"] = a, b
        out = out + jnp.matmul(a.astype(jnp.float32), jnp.swapaxes(b.astype(jnp.float32), -1, -2), precision=_HI)
    if mask is not None:
        out = jnp.where(mask, exact.astype(jnp.float32), out)
    return out, parts


_PARTS = {  # page_bytes' part -> the stored arrays it counts
    "codes": ("codes",),
    "scales": ("scale", "zero"),
    "factors": ("a", "b"),
    "outliers": ("outliers",),
    "outlier_index": ("outlier_index",),
}


def _encode_side(x: jnp.ndarray, widths: Sequence[int], spec: GearSpec, keys: bool, low_rank: bool):
    """Pages x [..., P, sum(widths)] of heads side by side -> (reconstruction, {part: [arrays, one per width]}); heads
    of one width run together, stacked on a heads axis before [P, ...]."""
    starts = HeadLayout.offsets(widths)
    out: list = [None] * len(widths)
    parts: dict[str, list] = {name: [] for names in _PARTS.values() for name in names}
    for w, heads in _by_width(widths):
        block = jnp.stack([x[..., starts[h] : starts[h] + w] for h in heads], axis=-3)
        recon, got = _encode_block(block, spec, keys, low_rank)
        for i, h in enumerate(heads):
            out[h] = recon[..., i, :, :]
        for name, arr in got.items():
            parts[name].append(arr)
    return jnp.concatenate(out, axis=-1), parts


@functools.partial(jax.jit, static_argnames=("layout", "spec", "low_rank"))
def _round_trip(k, v, layout: HeadLayout, spec: GearSpec, low_rank: bool):
    b, t = k.shape[:2]
    p = spec.page_size
    pad = -t % p

    def pages(x):
        return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0))).reshape(b, -1, p, x.shape[-1])

    k_hat, _ = _encode_side(pages(k), layout.k_widths, spec, True, low_rank)
    v_hat, _ = _encode_side(pages(v), layout.v_widths, spec, False, low_rank)
    return (
        k_hat.reshape(b, -1, k.shape[-1])[:, :t].astype(k.dtype),
        v_hat.reshape(b, -1, v.shape[-1])[:, :t].astype(v.dtype),
    )


def round_trip(k, v, layout: HeadLayout, spec: GearSpec, *, low_rank: bool = True):
    """K [B, T, k_cols] and V [B, T, v_cols] -> their GEAR reconstructions (same shape and dtype), each page of
    ``spec.page_size`` positions from 0 and each head compressed on its own (the last partial page padded with zeros,
    like ``quant.simulate``; only full pages' reconstructions are meant to be read). ``low_rank=False`` drops L
    (outliers and quantization alone; with ``outliers=0`` it is ``quant.simulate``). Jitted."""
    _check(layout, spec)
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"K and V must be [B, T, cols] of one B and T, got {k.shape} and {v.shape}")
    if k.shape[-1] != layout.k_cols or v.shape[-1] != layout.v_cols:
        raise ValueError(
            f"K, V have {k.shape[-1]}, {v.shape[-1]} columns for a layout of {layout.k_cols}, {layout.v_cols}"
        )
    return _round_trip(k, v, layout, spec, bool(low_rank))


@functools.partial(jax.jit, static_argnames=("layout", "spec"))
def _page_parts(k_page, v_page, layout: HeadLayout, spec: GearSpec):
    out = {}
    for side, x, widths in (("k", k_page, layout.k_widths), ("v", v_page, layout.v_widths)):
        _, got = _encode_side(x.astype(jnp.float32), widths, spec, side == "k", True)
        for part, names in _PARTS.items():
            out[f"{side}_{part}"] = tuple(arr for name in names for arr in got[name])
    return out


def page_parts(k_page, v_page, layout: HeadLayout, spec: GearSpec) -> dict[str, tuple[jax.Array, ...]]:
    """The arrays one page stores, by ``page_bytes``' part: K [P, k_cols] and V [P, v_cols] -> for each of K and V
    (``k_...``, ``v_...``): ``codes`` (packed, [heads, P, w * bits / 8] uint8), ``scales`` (scale then zero,
    float16), ``factors`` (A [heads, P, r] then B [heads, w, r], float16), ``outliers`` ([heads, n] float16) and
    ``outlier_index`` ([heads, n]: each outlier's position in its head's [P, w] block, row-major). Heads of one width
    share each array, one array per distinct width, widths ascending, heads in layout order. Jitted."""
    _check(layout, spec)
    return _page_parts(jnp.asarray(k_page), jnp.asarray(v_page), layout, spec)


def page_bytes(layout: HeadLayout, spec: GearSpec) -> dict[str, int]:
    """Every byte one page of one layer stores, by part: ``quant.page_bytes``' codes and scales, then for K and V the
    low-rank factors (A [P, r] and B [w, r] float16 a head), the outliers' float16 values and their positions (a
    position within the head's page block: ``index_bits`` bits, stored in 1, 2 or 4 bytes; 2 for 32 x 64). Their sum
    is the page's size."""
    _check(layout, spec)
    return _sizes(tuple(layout.k_widths), tuple(layout.v_widths), spec)


def _sizes(k_widths: tuple[int, ...], v_widths: tuple[int, ...], spec: GearSpec) -> dict[str, int]:
    p, r, item = spec.page_size, spec.rank, jnp.dtype(FACTOR_DTYPE).itemsize
    out = dict(quant.page_bytes(k_widths, v_widths, p, spec.bits))
    for side, widths in (("k", k_widths), ("v", v_widths)):
        out[f"{side}_factors"] = sum((p + w) * r * item for w in widths)
        out[f"{side}_outliers"] = sum(spec.outlier_count(w) * item for w in widths)
        out[f"{side}_outlier_index"] = sum(
            spec.outlier_count(w) * jnp.dtype(_index_dtype(p, w)).itemsize for w in widths
        )
    return out


def scores_low_rank(q: jnp.ndarray, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """Scores [..., R, P] of queries q [..., R, w] against a head's low-rank part ``A B^T`` (A [..., P, r],
    B [..., w, r]) without rebuilding it: ``q (A B^T)^T = (q B) A^T``, (w + P) r multiply-adds a query, float32."""
    qb = jnp.matmul(q.astype(jnp.float32), b.astype(jnp.float32), precision=_HI)  # [..., R, r]: q in B's basis
    return jnp.matmul(qb, jnp.swapaxes(a.astype(jnp.float32), -1, -2), precision=_HI)


@dataclasses.dataclass(frozen=True)
class GearPageFormat(quant.HeadWidths):
    """One layer's GEAR page for the engine: ``quant.PageFormat``'s interface (``encode``, ``decode``, ``page_bytes``,
    ``bytes_by_part``, ``round_trip``), so ``quant_paging`` writes and reads a pool of these pages as it does KIVI
    ones. A page is ``_encode_side``'s arrays for K then V as bytes, part by part (``_PARTS``, each part from a
    multiple of ``quant.ALIGN``); heads of one width are one array, widths ascending. ``decode`` rebuilds exactly what
    ``round_trip`` reconstructs (codes dequantized plus ``A B^T``, the outliers put back). The engine's kernels read
    them with ``ops.decode.gear_kernel`` (each head's parts found by ``head_parts``); its reference backend decodes
    them (``decode`` then attention)."""

    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]
    spec: GearSpec

    def __post_init__(self):
        _check_widths(self.k_widths, self.v_widths, self.spec)

    @classmethod
    def for_layout(cls, layout: HeadLayout, spec: GearSpec) -> GearPageFormat:
        return cls(tuple(layout.k_widths), tuple(layout.v_widths), spec)

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def bits(self) -> int:
        return self.spec.bits

    def sizes(self) -> dict[str, int]:
        """Bytes of each part of a page before alignment (``page_bytes``, the module function)."""
        return _sizes(self.k_widths, self.v_widths, self.spec)

    @property
    def page_bytes(self) -> int:
        """A page's bytes, every part with its alignment padding."""
        return _layout(self)[1]

    def bytes_by_part(self) -> dict[str, int]:
        """``sizes`` and the page's alignment padding: they sum to ``page_bytes``."""
        sizes = self.sizes()
        return {**sizes, "padding": self.page_bytes - sum(sizes.values())}

    def round_trip(self, q, k, v, layout=None):
        """Whole sequences through this format's pages (``quant.simulate``; q and layout unused)."""
        return quant.simulate(k, v, self)

    def encode(self, k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
        """Pages of keys [..., page_size, k_cols] and values [..., page_size, v_cols] -> uint8 [..., page_bytes]."""
        lead, p = k.shape[:-2], self.page_size
        stored = {}
        for side, x, widths in (("k", k, self.k_widths), ("v", v, self.v_widths)):
            x32 = x.reshape(-1, p, x.shape[-1]).astype(jnp.float32)
            stored[side] = _encode_side(x32, widths, self.spec, side == "k", True)[1]
        m = math.prod(lead)
        pieces, at = [], 0
        for (side, name, i, start), _ in _layout(self)[0]:
            pieces += [jnp.zeros((m, start - at), jnp.uint8)] if start > at else []
            arr = stored[side][name][i]
            raw = arr if arr.dtype == jnp.uint8 else lax.bitcast_convert_type(arr, jnp.uint8)
            pieces.append(raw.reshape(m, -1))
            at = start + pieces[-1].shape[1]
        pieces.append(jnp.zeros((m, self.page_bytes - at), jnp.uint8))
        return jnp.concatenate(pieces, axis=1).reshape(*lead, self.page_bytes)

    def head_parts(self, side: str, head: int) -> dict[str, tuple[int, jnp.dtype, tuple[int, ...]]]:
        """Where head ``head``'s arrays of ``side`` ("k" or "v") lie in a page: name (``codes``, ``scale``,
        ``zero``, ``a``, ``b``, and with outliers ``outliers`` and ``outlier_index``) -> (first byte, dtype, shape of
        the head's own array, as ``page_parts`` gives it less the heads axis). A kernel reads one head's parts
        from these (``ops.decode.gear_kernel``)."""
        widths = self.k_widths if side == "k" else self.v_widths
        if side not in ("k", "v") or not 0 <= head < len(widths):
            raise ValueError(f"no head {head!r} on side {side!r} of {len(widths)} heads")
        groups = _by_width(widths)
        which = next(i for i, (_, of_width) in enumerate(groups) if head in of_width)
        j = groups[which][1].index(head)
        out = {}
        for (s, name, i, start), shape in _layout(self)[0]:
            if s == side and i == which:
                size = math.prod(shape.shape[1:]) * shape.dtype.itemsize
                out[name] = (start + j * size, shape.dtype, tuple(shape.shape[1:]))
        return out

    def decode(self, pages: jnp.ndarray, dtype=jnp.float32) -> tuple[jnp.ndarray, jnp.ndarray]:
        """``encode``'s inverse up to GEAR's loss: uint8 [..., page_bytes] -> keys [..., P, k_cols], values
        [..., P, v_cols] in ``dtype``, equal to ``round_trip``'s reconstruction of the same pages."""
        lead = pages.shape[:-1]
        flat = pages.reshape(-1, self.page_bytes)
        m = flat.shape[0]
        arrays: dict[tuple[str, str], list] = {}
        for (side, name, _, start), shape in _layout(self)[0]:
            size = math.prod(shape.shape) * shape.dtype.itemsize
            raw = flat[:, start : start + size]
            if shape.dtype == jnp.uint8:
                arr = raw.reshape(m, *shape.shape)
            else:
                arr = lax.bitcast_convert_type(raw.reshape(m, *shape.shape, shape.dtype.itemsize), shape.dtype)
            arrays.setdefault((side, name), []).append(arr)
        out = []
        for side, widths in (("k", self.k_widths), ("v", self.v_widths)):
            heads: list = [None] * len(widths)
            for i, (w, of_width) in enumerate(_by_width(widths)):
                got = {name: stored[i] for (s, name), stored in arrays.items() if s == side}
                block = _decode_block(got, self.spec, w)
                for j, h in enumerate(of_width):
                    heads[h] = block[:, j]
            x = jnp.concatenate(heads, axis=-1).astype(dtype)
            out.append(x.reshape(*lead, *x.shape[1:]))
        return out[0], out[1]


def _decode_block(got: dict, spec: GearSpec, width: int) -> jnp.ndarray:
    """Heads of one width from their stored arrays ([m, heads, ...] each) -> [m, heads, P, w] float32, as
    ``_encode_block`` reconstructs them: codes dequantized, plus ``A B^T``, the outliers put back."""
    codes = quant.unpack(got["codes"], spec.bits)
    out = quant.dequantize(codes, got["scale"], got["zero"])
    a, b = got["a"].astype(jnp.float32), got["b"].astype(jnp.float32)
    out = out + jnp.matmul(a, jnp.swapaxes(b, -1, -2), precision=_HI)
    if "outliers" in got:
        lead = out.shape[:-2]
        flat = out.reshape(*lead, -1)
        idx = got["outlier_index"].astype(jnp.int32)
        flat = jnp.put_along_axis(flat, idx, got["outliers"].astype(jnp.float32), axis=-1, inplace=False)
        out = flat.reshape(out.shape)
    return out


@functools.cache
def _layout(fmt: GearPageFormat):
    """((side, array name, width index, first byte), ShapeDtypeStruct of one page's array) in storage order, and the
    page's bytes: ``_encode_side``'s arrays for one page, part by part, each part from a multiple of ``quant.ALIGN`` and
    each array from a multiple of its item's size (positions of one byte and of two share a part)."""
    p = fmt.page_size
    shapes = {}
    for side, cols, widths in (("k", fmt.k_cols, fmt.k_widths), ("v", fmt.v_cols, fmt.v_widths)):
        x = jax.ShapeDtypeStruct((1, p, cols), jnp.float32)
        encode = functools.partial(_encode_side, widths=widths, spec=fmt.spec, keys=side == "k", low_rank=True)
        shapes[side] = jax.eval_shape(lambda x, encode=encode: encode(x)[1], x)
    entries, at = [], 0
    for names in _PARTS.values():
        for side in ("k", "v"):
            for name in names:
                for i, arr in enumerate(shapes[side].get(name, [])):
                    at = -(-at // arr.dtype.itemsize) * arr.dtype.itemsize  # whole items: a kernel reads them so
                    entries.append(((side, name, i, at), jax.ShapeDtypeStruct(arr.shape[1:], arr.dtype)))
                    at += math.prod(arr.shape[1:]) * arr.dtype.itemsize
        at = -(-at // quant.ALIGN) * quant.ALIGN
    return tuple(entries), at
