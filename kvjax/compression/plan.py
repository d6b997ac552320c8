"""Rank plans (``RankPlan``): how many rotated directions each KV head keeps for Q/K and for V.

A head keeps the smallest ``k`` whose removed tail of singular values stays within the shared removal rate ``r``
(``sum_{i>=k} s_i / sum_i s_i <= r``), rounded up to a multiple of 16 (kernel alignment), at least 16. The overall
rate is ``p = 1 - sum(k_qk + k_v) / (2 * Hkv * d_h * L)``; ``F_p`` finds ``r`` for a target ``p`` by bisection, and
``ranks="measured"`` takes the widths from each head's measured effect instead (``compression.sensitivity``).
A plan may reorder each layer's KV heads (``head_order``; the output does not change), move a few columns between
a layer's heads at an unchanged rate (``filled_for_runs``, opt-in: accuracy traded for decode speed), and, for ZACK,
store keys in banded frames (``band``, DESIGN.md section 7, "Banded bases") and project queries and keys on a
score-aware pair of bases rather than one shared rotation (``qk_basis="pair"``, ``CalibrationStats.basis``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from kvjax import validate
from kvjax.layout import HeadLayout
from kvjax.ops.decode.config import DECODE, DecodeConfig
from kvjax.ops.decode.search import fill_runs, order_heads
from kvjax.ops.kv_schemes import served
from kvjax.ops.tiles import is_pow2

ALIGN = 16
METHODS = ("zack", "palu")
# ZACK's Q/K directions: one orthogonal rotation, or a score-aware pair (A for q, B for k)
QK_BASES = ("shared", "pair")
QK_WIDTHS = ("shared", "pair")  # the spectrum F_p reads a pair's Q/K widths from: the shared basis's or its own
# A Palu model asked for quantized pages, in the same words wherever it is refused (``check_kv_bits``: the engine,
# ``kvjax.compress``, ``kvjax-convert``, ``Model.save``), so each refuses the pair before any work
PALU_KV_BITS = (
    "kv_bits: quantized pages are not supported on Palu models yet (their cache holds a latent K that every read "
    "rebuilds); quantize an uncompressed or ZACK model"
)
BANDED_KV_BITS = (
    "kv_bits: quantized pages are not supported on banded ZACK models yet (their keys are turned back by their "
    "band's angle as they are read); quantize an uncompressed or plain ZACK model"
)


def check_kv_bits(kv_bits, method: str | None, band: int | None = None) -> int | str | None:
    """The quantized pages a model compressed by ``method`` (None: uncompressed; ``band``: a banded ZACK plan's) may
    be served with: None (pages of the cache's dtype), or 4, 2 or a GEAR name (``kv_schemes.served``) on any model
    but a Palu or banded one; anything else is a one-line ValueError."""
    if kv_bits is None:
        return None
    bits = served(kv_bits)
    if method == "palu":
        raise ValueError(PALU_KV_BITS)
    if band is not None:
        raise ValueError(BANDED_KV_BITS)
    return bits


def check_band(band, method: str, max_context=None) -> int | None:
    """A plan's ``band`` (ZACK's banded key frames, in positions): None, or a power of two from 1 to 4096 on a ZACK
    plan (a decode step's tokens are a power of two, so a band never straddles two of them unevenly) with no
    ``max_context`` (a banded plan serves every position)."""
    if band is None:
        return None
    band = validate.integer("band", band, low=1)
    if band > 4096 or not is_pow2(band):
        raise ValueError(f"band must be a power of two from 1 to 4096, got {band}")
    if method != "zack":
        raise ValueError(f"band applies to method='zack' (a post-RoPE basis), not {method!r}")
    if max_context is not None:
        raise ValueError(f"band serves every position: give max_context=None with it, not {max_context!r}")
    return band


def check_qk_basis(qk_basis, method: str) -> str | None:
    """A plan's ``qk_basis`` checked: None or "shared" (ZACK's one orthogonal rotation, stored as None) or "pair"
    (a score-aware pair, ZACK only)."""
    if qk_basis is None or qk_basis == "shared":
        return None
    if qk_basis != "pair":
        raise ValueError(f"qk_basis must be one of {QK_BASES}, got {qk_basis!r}")
    if method != "zack":
        raise ValueError(f"qk_basis='pair' applies to method='zack' (a post-RoPE basis), not {method!r}")
    return qk_basis


def check_qk_widths(qk_widths, qk_basis, ranks=None, adaptive=True) -> str | None:
    """A plan's ``qk_widths`` checked: None or "shared" (F_p read Q/K widths off the shared basis's spectrum, stored
    as None) or "pair" (off the pair's own singular values: an adaptive pair plan under F_p only)."""
    if qk_widths is None or qk_widths == "shared":
        return None
    if qk_widths != "pair":
        raise ValueError(f"qk_widths must be one of {QK_WIDTHS}, got {qk_widths!r}")
    if qk_basis != "pair" or ranks == "measured":
        raise ValueError(
            "qk_widths='pair' applies to a pair's widths under F_p (qk_basis='pair', ranks from the spectrum)"
        )
    if not adaptive:
        raise ValueError("qk_widths='pair' applies to adaptive plans (uniform widths read no spectrum)")
    return qk_widths


def rank_for_removal(s: np.ndarray, r: float, head_dim: int) -> int:
    """Smallest multiple of 16 (>= 16, <= head_dim) keeping all but at most ``r`` of the singular-value mass."""
    total = float(np.sum(s))
    if total <= 0:
        return ALIGN
    tail = total - np.concatenate([[0.0], np.cumsum(s)])  # tail[k] = sum_{i>=k} s_i
    k = int(np.argmax(tail / total <= r + 1e-12))
    return int(min(head_dim, max(ALIGN, -(-k // ALIGN) * ALIGN)))


@dataclasses.dataclass
class RankPlan:
    method: str  # "zack" (rotate after RoPE) or "palu" (low-rank K before RoPE, rebuilt every step)
    head_dim: int
    k_qk: np.ndarray  # int [L, Hkv]: cached K width (zack: also Q's width; palu: K latent width)
    k_v: np.ndarray  # int [L, Hkv]
    s_qk: np.ndarray  # float [L, Hkv, d_h]: singular values behind k_qk, descending
    s_v: np.ndarray  # float [L, Hkv, d_h]
    removal_rate: float | None = None
    adaptive: bool = True
    head_order: np.ndarray | None = None  # int [L, Hkv]: the calibrated head at each cached position (None: as is)
    moved_columns: int = 0  # K + V columns that ``filled_for_runs`` moved between heads
    max_context: int | None = None  # zack: Q/K basis derived for positions 0..max_context-1 (None: those calibrated)
    k_share: float | None = None  # the share of the kept columns given to Q/K (None: one removal rate for both)
    band: int | None = None  # zack: keys stored in the frame of their band of ``band`` positions (None: plain)
    ranks: str | None = None  # "measured": widths from each head's measured KL (``sensitivity``); None: F_p's rule
    qk_basis: str | None = None  # zack: "pair" (queries on A, keys on B: ``q_rotation``); None: one shared rotation
    qk_widths: str | None = None  # a pair under F_p: "pair" (widths off its own spectrum, ``s_qk``); None: shared's

    def __post_init__(self):
        self.k_qk, self.k_v = np.asarray(self.k_qk, np.int64), np.asarray(self.k_v, np.int64)
        self.s_qk, self.s_v = np.asarray(self.s_qk, np.float64), np.asarray(self.s_v, np.float64)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("k_qk", "k_v"):
            k = getattr(self, name)
            if k.shape != self.s_qk.shape[:2] or np.any(k % ALIGN) or k.min() < ALIGN or k.max() > self.head_dim:
                raise ValueError(
                    f"{name} must be multiples of {ALIGN} in [{ALIGN}, head_dim={self.head_dim}] "
                    f"of shape {self.s_qk.shape[:2]}"
                )
        if self.max_context is not None:
            self.max_context = validate.positive("max_context", self.max_context)
        self.band = check_band(self.band, self.method, self.max_context)
        if self.ranks not in (None, "measured"):
            raise ValueError(f"ranks must be None or 'measured', got {self.ranks!r}")
        self.qk_basis = check_qk_basis(self.qk_basis, self.method)
        self.qk_widths = check_qk_widths(self.qk_widths, self.qk_basis, self.ranks, self.adaptive)
        if self.head_order is not None:
            self.head_order = np.asarray(self.head_order, np.int64)
            heads = self.s_qk.shape[1]
            if self.head_order.shape != self.s_qk.shape[:2] or np.any(np.sort(self.head_order, 1) != np.arange(heads)):
                raise ValueError(f"head_order must hold a permutation of the {heads} KV heads for every layer")

    @property
    def num_layers(self) -> int:
        return self.k_qk.shape[0]

    @property
    def rate(self) -> float:
        """Overall KV-cache compression rate p."""
        return 1.0 - float(self.k_qk.sum() + self.k_v.sum()) / (2 * self.k_qk.size * self.head_dim)

    def layer_order(self, layer: int) -> tuple[int, ...]:
        """The calibrated KV head at each cached position of ``layer``."""
        if self.head_order is None:
            return tuple(range(self.k_qk.shape[1]))
        return tuple(int(h) for h in self.head_order[layer])

    def layer_widths(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The cached K and V widths of ``layer``'s KV heads, in cache order."""
        order = self.layer_order(layer)
        return tuple(int(self.k_qk[layer, h]) for h in order), tuple(int(self.k_v[layer, h]) for h in order)

    def filled_for_runs(self, group_size: int, config: DecodeConfig = DECODE, max_shift: int = 32) -> RankPlan:
        """This plan with widths moved between each layer's heads (at most ``max_shift`` columns a head, the layer's
        K and V totals kept, so the rate stays) where that lets the decode kernel's runs fill their tiles
        (``kvjax.ops.decode.search.fill_runs``), dropping as little energy (squared singular values, each head's
        share) as it can. Not free: on SmolLM2, moving 3% of the kept columns cost about as much perplexity as one
        more point of rate (bench/results/kernels.md "Decode: filled tiles"), so compression leaves it off unless
        asked."""
        if self.head_order is not None:
            raise ValueError("fill a plan's widths before ordering its heads")
        heads, m = self.k_qk.shape[1], max_shift // ALIGN
        shifts = ALIGN * np.arange(-m, m + 1)

        def losses(s, widths):  # [H, 2m+1]: the share of each head's energy (s^2) a shift drops (< 0: adds)
            energy = np.concatenate([np.zeros((heads, 1)), np.cumsum(s * s, 1)], 1)
            energy /= np.maximum(energy[:, -1:], 1e-30)
            moved = np.clip(widths[:, None] + shifts[None, :], 0, self.head_dim)
            return np.take_along_axis(energy, widths[:, None], 1) - np.take_along_axis(energy, moved, 1)

        k_qk, k_v = self.k_qk.copy(), self.k_v.copy()
        for i in range(self.num_layers):
            k_qk[i], k_v[i] = fill_runs(
                self._layout(k_qk[i], k_v[i], group_size),
                config,
                max_shift,
                losses(self.s_qk[i], k_qk[i]),
                losses(self.s_v[i], k_v[i]),
            )
        moved = int(np.abs(k_qk - self.k_qk).sum() + np.abs(k_v - self.k_v).sum())
        return dataclasses.replace(self, k_qk=k_qk, k_v=k_v, moved_columns=self.moved_columns + moved // 2)

    def ordered_for_runs(self, group_size: int, config: DecodeConfig = DECODE) -> RankPlan:
        """This plan with every layer's KV heads in the order whose decode runs cost least
        (``kvjax.ops.decode.search.order_heads``); the model's output does not change."""
        return dataclasses.replace(
            self,
            head_order=np.asarray(
                [order_heads(self._layout(k, v, group_size), config) for k, v in zip(self.k_qk, self.k_v)]
            ),
        )

    def _layout(self, k, v, group_size: int):
        """One layer's widths (calibrated order) as the ``HeadLayout`` the decode op plans runs for."""
        heads = len(k)
        return HeadLayout(group_size * heads, heads, self.head_dim, tuple(map(int, k)), tuple(map(int, v)))

    @classmethod
    def from_removal_rate(cls, method, s_qk, s_v, r: float, adaptive: bool = True) -> RankPlan:
        validate.rate("removal_rate", r)
        d = s_qk.shape[-1]
        rank = np.vectorize(
            lambda layer, head, which: rank_for_removal((s_qk if which == 0 else s_v)[layer, head], r, d)
        )
        layers, heads = np.indices(s_qk.shape[:2])
        k_qk, k_v = rank(layers, heads, 0), rank(layers, heads, 1)
        if not adaptive:  # the ablation: the same widths everywhere, spending the same total
            plan = cls.for_target_rate(
                method, s_qk, s_v, 1.0 - (k_qk.sum() + k_v.sum()) / (2 * k_qk.size * d), adaptive=False
            )
            return dataclasses.replace(plan, removal_rate=r)
        return cls(method, d, k_qk, k_v, s_qk, s_v, removal_rate=r, adaptive=adaptive)

    @classmethod
    def for_target_rate(
        cls, method, s_qk, s_v, p: float, adaptive: bool = True, steps: int = 50, k_share: float | None = None
    ) -> RankPlan:
        """``F_p``: the plan whose rate is closest to ``p`` without going under it (bisection on ``r``). With
        ``k_share`` (adaptive only): Q/K gets that share of the columns the rate keeps and V the rest, each spread
        over its heads by a removal rate of its own (``for_column_budgets``), so K and V are never ranked against
        each other on their singular values' different scales."""
        validate.rate("target_rate", p)
        d = s_qk.shape[-1]
        if k_share is not None and not 0 < k_share < 1:
            raise ValueError(f"k_share must lie strictly between 0 and 1, got {k_share!r}")
        if k_share is not None and adaptive:
            kept = int(np.floor(2 * s_qk[..., 0].size * d * (1 - p)))
            k_cols = int(round(kept * k_share))
            return cls.for_column_budgets(method, s_qk, s_v, k_cols, kept - k_cols, steps)
        if not adaptive:
            k_qk, k_v = uniform_widths(p, d, k_share)
            shape = s_qk.shape[:2]
            return cls(method, d, np.full(shape, k_qk), np.full(shape, k_v), s_qk, s_v, adaptive=False, k_share=k_share)
        lo, hi = 0.0, 1.0  # rate(r) is monotone non-decreasing in r
        best = cls.from_removal_rate(method, s_qk, s_v, 0.0)
        if best.rate >= p:
            return best
        for _ in range(steps):
            mid = (lo + hi) / 2
            plan = cls.from_removal_rate(method, s_qk, s_v, mid)
            if plan.rate >= p:
                hi, best = mid, plan
            else:
                lo = mid
        if best.rate < p:
            raise ValueError(
                f"target_rate {p} is out of reach: with every head at {ALIGN} columns the rate is {1 - ALIGN / d:.4f}"
            )
        return best

    @classmethod
    def for_column_budgets(cls, method, s_qk, s_v, k_cols: int, v_cols: int, steps: int = 50) -> RankPlan:
        """The adaptive plan keeping at most ``k_cols`` Q/K and ``v_cols`` V columns in all: each kind's heads share
        the smallest removal rate whose widths fit its budget (bisection per kind; every head keeps >= 16)."""
        d = s_qk.shape[-1]
        widths = []
        for name, s, budget in (("k_cols", s_qk, k_cols), ("v_cols", s_v, v_cols)):
            heads = s.reshape(-1, d)
            if budget < ALIGN * len(heads):
                raise ValueError(f"{name}={budget} is below {ALIGN} columns for each of the {len(heads)} heads")

            def fit(r, heads=heads, shape=s.shape[:-1]):
                return np.array([rank_for_removal(h, r, d) for h in heads]).reshape(shape)

            lo, hi, best = 0.0, 1.0, fit(1.0)
            if fit(0.0).sum() <= budget:
                best = fit(0.0)
            else:
                for _ in range(steps):
                    mid = (lo + hi) / 2
                    w = fit(mid)
                    lo, hi, best = (lo, mid, w) if w.sum() <= budget else (mid, hi, best)
            widths.append(best)
        k_share = k_cols / max(k_cols + v_cols, 1)
        return cls(method, d, widths[0], widths[1], s_qk, s_v, adaptive=True, k_share=k_share)

    def summary(self) -> str:
        lines = [
            f"{self.method} plan ({'adaptive' if self.adaptive else 'uniform'}): overall rate p = "
            f"{self.rate:.4f}"
            + (f", removal rate r = {self.removal_rate:.4g}" if self.removal_rate is not None else "")
            + (f", Q/K share of the kept columns {self.k_share:.3f}" if self.k_share is not None else ""),
            "layer | k_qk min/mean/max | k_v min/mean/max",
        ]
        if self.max_context is not None:
            lines.insert(1, f"Q/K basis derived for positions 0..{self.max_context - 1} (max_context)")
        if self.ranks == "measured":
            lines.insert(1, "widths allocated by each head's measured effect on the outputs (KL), K and V together")
        if self.band is not None:
            lines.insert(1, f"keys stored in bands of {self.band} positions, each in its band's frame (any context)")
        if self.qk_basis == "pair":
            source = "the pair's own" if self.qk_widths == "pair" else "the shared basis's"
            widths = "" if self.ranks == "measured" else f" (widths from {source} spectrum)"
            lines.insert(1, f"queries and keys on a score-aware pair of bases{widths}")
        if self.moved_columns:
            lines.insert(
                1,
                f"{self.moved_columns} columns moved between heads so the decode kernel's runs fill "
                f"their tiles (rate unchanged)",
            )
        if self.head_order is not None:
            moved = sum(self.layer_order(i) != tuple(range(self.k_qk.shape[1])) for i in range(self.num_layers))
            lines.insert(1, f"KV heads reordered for the decode kernel's runs in {moved} of {self.num_layers} layers")
        for i in range(self.num_layers):
            a, b = self.k_qk[i], self.k_v[i]
            lines.append(
                f"{i:5d} | {a.min():3d} / {a.mean():5.1f} / {a.max():3d} | {b.min():3d} / {b.mean():5.1f} / "
                f"{b.max():3d}"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "method": self.method,
                "head_dim": self.head_dim,
                "rate": self.rate,
                "removal_rate": self.removal_rate,
                "adaptive": self.adaptive,
                "k_qk": self.k_qk.tolist(),
                "k_v": self.k_v.tolist(),
                "s_qk": self.s_qk.tolist(),
                "s_v": self.s_v.tolist(),
                "head_order": None if self.head_order is None else self.head_order.tolist(),
                "moved_columns": self.moved_columns,
                "max_context": self.max_context,
                "k_share": self.k_share,
                "band": self.band,
                "ranks": self.ranks,
                "qk_basis": self.qk_basis,
                "qk_widths": self.qk_widths,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> RankPlan:
        d = json.loads(text)
        d.pop("rate", None)
        return cls(**d)


def uniform_widths(p: float, head_dim: int, k_share: float | None = None) -> tuple[int, int]:
    """One (k_qk, k_v) for every head: a per-head budget of ``2 * head_dim * (1 - p)`` columns rounded to 16,
    split between K and V by ``k_share``, by default evenly (one rate for K and V, the ablation of the ZACK paper's
    ZACK/AC; a split by singular-value mass compared two scales and cut K first: bench/results/accuracy.md "Compression:
    K and V budgets"), at least 16 each."""
    budget = min(2 * head_dim, max(2 * ALIGN, round(2 * head_dim * (1 - p) / ALIGN) * ALIGN))
    share = 0.5 if k_share is None else k_share
    k_qk = min(head_dim, max(ALIGN, round(budget * share / ALIGN) * ALIGN))
    k_qk = min(max(k_qk, budget - head_dim), budget - ALIGN)
    return int(k_qk), int(budget - k_qk)
