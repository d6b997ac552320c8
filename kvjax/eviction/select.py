"""Which prompt tokens each KV head keeps: a budget, per head or shared by every head of every layer, spent on the
highest scores (``kvjax.eviction.metrics``) after the most recent tokens, which are always kept.

``Eviction`` (``parse`` reads its short form) is the one description of a policy; ``keep_masks`` applies it on the
host and ``device_keep`` on the device, the same selection. Allocations: ``global`` (KV-Compress, section 3.3: one
budget over every (layer, KV head)), ``classed`` (one such budget within each class of layers of one sliding window:
local heads' scores never compete with global ones') and ``uniform`` (SnapKV, H2O, Keyformer as published:
``budget`` a head). A head evicts whole pages' worth of tokens, so it may keep up to ``page_size - 1`` over its
share. Protected: the last ``max(window, page_size)`` tokens, and for H2O and Keyformer a recent window of
``recent_share`` of the budget.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from kvjax.eviction.metrics import METHODS

ALLOCATIONS = ("global", "classed", "uniform")
RECENT_SHARE = {"h2o": 0.5, "keyformer": 0.2}  # of the budget, kept as a recent window (H2O: half heavy hitters)


def _is_int(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Eviction:
    """An eviction policy: ``method`` (``metrics.METHODS``) keeps ``budget`` prompt tokens per KV head, or the
    prompt's tokens over ``ratio`` (2.0: half of them), under ``allocation`` (None: "global" for KV-Compress,
    "uniform" for the others; "classed" ranks each window class of layers apart, for models of local and global
    layers)."""

    method: str
    budget: int | None = None
    ratio: float | None = None
    allocation: str | None = None
    window: int = 8
    pool: int = 7
    page_size: int = 16
    tau: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"eviction method must be one of {METHODS}, got {self.method!r}")
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("give an eviction budget (tokens per KV head) or a ratio, not both or neither")
        if self.budget is not None and not _is_int(self.budget, 1):
            raise ValueError(f"eviction budget must be a positive number of tokens, got {self.budget!r}")
        if self.ratio is not None and not (_is_number(self.ratio) and self.ratio >= 1):
            raise ValueError(f"eviction ratio must be a number >= 1, got {self.ratio!r}")
        if self.allocation is not None and self.allocation not in ALLOCATIONS:
            raise ValueError(f"eviction allocation must be one of {ALLOCATIONS}, got {self.allocation!r}")
        for name in ("window", "pool", "page_size"):
            if not _is_int(getattr(self, name), 1):
                raise ValueError(f"eviction {name} must be a positive integer, got {getattr(self, name)!r}")
        if not (_is_number(self.tau) and self.tau > 0):
            raise ValueError(f"eviction tau must be a finite positive number, got {self.tau!r}")
        if not _is_int(self.seed, 0):
            raise ValueError(f"eviction seed must be a non-negative integer, got {self.seed!r}")

    def sizes(self, prompts, windows=(None,)) -> tuple[np.ndarray, np.ndarray]:
        """(per_head [B, L], protected [B, L]) int32 for ``prompts`` (lengths) over layers of sliding ``windows``
        (None: the whole context): ``device_keep``'s inputs."""
        lengths, shape = [int(p) for p in prompts], (len(prompts), len(windows))
        # once a distinct window, not a layer: the engine asks at every prefill that ends prompts
        by_window = {w: [(self.per_head(n, w), self.protected(n, w)) for n in lengths] for w in dict.fromkeys(windows)}
        both = np.array([by_window[w] for w in windows], np.int32).reshape(len(windows), len(lengths), 2)
        return both[..., 0].T.reshape(shape), both[..., 1].T.reshape(shape)

    @property
    def allocated(self) -> str:
        """The allocation in force ("global", "classed" or "uniform")."""
        if self.allocation is not None:
            return self.allocation
        return "global" if self.method.startswith("kvcompress") else "uniform"

    @property
    def name(self) -> str:
        """A short label: "kvcompress:256", "snapkv:4x"."""
        amount = f"{self.budget}" if self.budget is not None else f"{self.ratio:g}x"
        return f"{self.method}:{amount}" + ("" if self.allocation is None else f":{self.allocation}")

    def per_head(self, prompt: int, window: int | None = None) -> int:
        """Tokens one head keeps of a ``prompt``-token prompt, on average under "global": of what it holds, the
        prompt's last ``window`` tokens on a sliding-window layer (a ratio is of the cache, so a 2x cut halves a
        local layer's window too, and its budget never counts tokens the window has already dropped)."""
        held = prompt if window is None else min(prompt, window)
        if self.budget is not None:
            return min(held, self.budget)
        assert self.ratio is not None
        return min(held, math.ceil(held / self.ratio))

    @property
    def recent(self) -> int:
        """The fewest most recent tokens a head always keeps: the observation window, and at least the page being
        filled (continual eviction's guard too: ``kvjax.eviction.continual``)."""
        return max(self.window, self.page_size)

    def protected(self, prompt: int, window: int | None = None) -> int:
        """The most recent tokens every head of a layer of sliding ``window`` keeps whatever they score: ``recent``,
        and for H2O and Keyformer their recent share of that layer's own budget (``per_head``). A local layer's
        share is of its window's budget: of the whole prompt's, it would keep more than its budget."""
        budget = self.per_head(prompt, window)
        recent = self.recent
        share = RECENT_SHARE.get(self.method)
        if share is not None:
            recent = max(recent, int(share * budget))
        return min(prompt, recent, max(budget, 1))


def keep_masks(spec: Eviction, scores: list[np.ndarray], windows: list[int | None]) -> list[np.ndarray]:
    """Per layer, bool [Hkv, S]: the prompt tokens each KV head keeps, from each layer's scores [Hkv, S] (higher =
    keep) and sliding window (None: whole context). Tokens a layer's window has already passed for the prompt's
    last query are neither candidates nor kept (the window drops them whatever the policy)."""
    s = scores[0].shape[-1]
    keep = [np.zeros(sc.shape, bool) for sc in scores]
    ranked, spare = [], []  # per (layer, head): its candidate tokens and their scores; the slots left to it
    for layer, (sc, w) in enumerate(zip(scores, windows)):
        protect = spec.protected(s, w)
        seen = np.arange(s) >= (0 if w is None else max(s - w, 0))
        recent = np.arange(s) >= s - protect
        keep[layer][:, seen & recent] = True
        free = np.flatnonzero(seen & ~recent)
        for g in range(sc.shape[0]):
            ranked.append((layer, g, free, np.asarray(sc[g], np.float64)[free]))
            spare.append(spec.per_head(s, w) - int((seen & recent).sum()))
    if spec.allocated == "uniform":
        chosen = np.maximum(np.array(spare, np.int64), 0)
    else:  # the slots a class's heads left, to the highest scores of its heads
        chosen = np.zeros(len(ranked), np.int64)
        for members in _classes(spec, [windows[layer] for layer, _, _, _ in ranked]):
            values = np.concatenate([ranked[i][3] for i in members])
            owner = np.concatenate([np.full(len(ranked[i][3]), i) for i in members])
            order = np.argsort(-values, kind="stable")[: max(sum(spare[i] for i in members), 0)]
            chosen += np.bincount(owner[order], minlength=len(ranked))
    for (layer, g, free, values), n in zip(ranked, chosen):
        n = min(n, len(free))
        n += (len(free) - n) % spec.page_size  # whole pages' worth evicted
        keep[layer][g, free[np.argsort(-values, kind="stable")[:n]]] = True
    return keep


def _classes(spec: Eviction, windows) -> list[list[int]]:
    """The indices of ``windows`` that share one budget: all of them ("global"), or those of one window ("classed"),
    classes in order of first appearance."""
    if spec.allocated == "global":
        return [list(range(len(windows)))]
    return [[i for i, w in enumerate(windows) if w == c] for c in dict.fromkeys(windows)]


def ranks(cost):
    """Each entry's place in the stable ascending order of ``cost`` along its last axis (the inverse permutation of
    ``argsort``): ties keep their index order, as NumPy's stable sort in ``keep_masks`` does."""
    order = jnp.argsort(cost, axis=-1, stable=True)
    places = jnp.broadcast_to(jnp.arange(cost.shape[-1]), order.shape)
    return jnp.put_along_axis(jnp.zeros_like(order), order, places, axis=-1, inplace=False)


def compacted(values, keep, slots: int):
    """float32 [..., slots]: the ``values`` [..., S] that ``keep`` [..., S] marks, in order, in the first slots
    (0 after them): what a per-head value says of each stored token once the kept ones are compacted into a head's
    first slots (``head_paging.admit`` at a prompt's end, ``head_paging.compact`` at a cut). Kept entries past
    ``slots`` are dropped."""
    dest = jnp.where(keep, jnp.cumsum(keep, axis=-1, dtype=jnp.int32) - 1, slots)  # past the end: dropped
    out = jnp.zeros((*keep.shape[:-1], slots + 1), jnp.float32)
    out = jnp.put_along_axis(out, dest, jnp.asarray(values, jnp.float32), axis=-1, inplace=False)
    return out[..., :slots]


def device_keep(spec: Eviction, scores, prompt, per_head, protect, windows: tuple[int | None, ...]):
    """``keep_masks`` on the device, for a batch: bool [B, L, Hkv, S] from scores [B, L, Hkv, S] (float32, higher =
    keep) of prompts of ``prompt`` [B] tokens each (slots past a prompt are neither scored nor kept), each prompt's
    ``spec.per_head`` and ``spec.protected`` per layer [B, L] (or [B, 1] for every layer; ``spec.sizes``: the
    host knows its prompts' lengths) and the layers' sliding ``windows`` (static). The same selection as
    ``keep_masks``, ties included (tested); what the engine runs after prefill, where the host version cost 24-429
    ms an 8K sequence (bench/results/eviction.md "Per-head pages: host cost"). Traceable: ``spec`` and ``windows``
    static, the rest arrays."""
    b, n_layers, heads, s = scores.shape
    n, per_head = jnp.asarray(prompt, jnp.int32)[:, None, None], jnp.asarray(per_head, jnp.int32)  # [B, L]
    protect = jnp.asarray(protect, jnp.int32)[:, :, None]  # [B, L or 1, 1]
    slot = jnp.arange(s)[None, None, :]  # [1, 1, S] against [B, 1, 1] counts
    first = jnp.array([0 if w is None else w for w in windows])[None, :, None]
    seen = (slot < n) & ((first == 0) | (slot >= jnp.maximum(n - first, 0)))  # [B, L, S]
    guarded = (seen & (slot >= n - protect))[:, :, None, :]  # [B, L, 1, S]
    free = jnp.broadcast_to((seen & (slot < n - protect))[:, :, None, :], scores.shape)
    spare = per_head[:, :, None] - guarded.sum(-1, dtype=jnp.int32)  # [B, L, 1]
    spare = jnp.broadcast_to(spare, (b, n_layers, heads))
    cost = jnp.where(free, -scores.astype(jnp.float32), jnp.inf)  # candidates first, best first, then slot order
    if spec.allocated == "uniform":
        chosen = jnp.maximum(spare, 0)
    else:  # the slots a class's heads left, to the highest scores of its heads
        chosen = jnp.zeros((b, n_layers, heads), jnp.int32)
        for members in _classes(spec, windows):
            inside = jnp.asarray(np.isin(np.arange(n_layers), members))[None, :, None]  # [1, L, 1], static
            total = jnp.maximum(jnp.where(inside, spare, 0).sum((1, 2)), 0)[:, None]
            mine = free & inside[..., None]
            taken = (ranks(jnp.where(mine, cost, jnp.inf).reshape(b, -1)) < total) & mine.reshape(b, -1)
            chosen = chosen + taken.reshape(scores.shape).sum(-1, dtype=jnp.int32)
    candidates = free.sum(-1, dtype=jnp.int32)
    chosen = jnp.minimum(chosen, candidates)
    chosen = chosen + (candidates - chosen) % spec.page_size  # whole pages' worth evicted
    return guarded | (free & (ranks(cost) < chosen[..., None]))


def parse(text: str, **settings) -> Eviction:
    """An ``Eviction`` from its short form: "METHOD:BUDGET" (tokens per KV head) or "METHOD:RATIOx" (the prompt over
    RATIO), optionally ":global", ":classed" or ":uniform"; ``settings`` fill the other fields (``page_size``,
    ``window``...). "kvcompress:256", "snapkv:4x", "h2o:512:global"."""
    parts = text.strip().split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise ValueError(
            f"eviction must look like METHOD:BUDGET or METHOD:RATIOx[:global|classed|uniform], got {text!r}"
        )
    amount, allocation = parts[1].lower(), parts[2].lower() if len(parts) == 3 else None
    try:
        size = dict(ratio=float(amount[:-1])) if amount.endswith("x") else dict(budget=int(amount))
    except ValueError:
        raise ValueError(f"eviction {text!r}: {parts[1]!r} is neither a token budget nor a ratio such as 4x") from None
    return Eviction(parts[0].lower(), allocation=allocation, **size, **settings)
