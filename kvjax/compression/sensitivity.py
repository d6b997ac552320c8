"""Ranks by measured effect: how far truncating each head moves the model's outputs, and the widths that spend a
target rate where that costs least: the alternative to ``F_p``'s shared removal rate (bench/results/accuracy.md "Ranks
by measured effect": on SmolLM2 it halves banded ZACK's KL at rate 0.3).

Post-RoPE spectra are flat, so one removal rate barely tells heads apart, and K's and V's singular values live on
scales that cannot be compared (``compression.split``). Here each (layer, KV head, Q/K or V) is probed on its own:
the model with only that head cut to ``probe_width`` directions, scored by mean KL(base || probe) on held-in
calibration rows. The cost of a width ``w`` is then modelled as that KL per unit of energy the probe dropped times
the energy ``w`` drops (``s**2`` past ``w``, over the head's total), additive over heads: first order in the
dropped components for K's scores and V's outputs, hence linear in their energy. One cost unit (KL) serves K and V
alike, so the greedy allocation also splits the columns between them. Probes keep every shape (columns past the
width are zeroed, not removed), so the model compiles once for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from tqdm.auto import tqdm

from kvjax.compression.folding import fold
from kvjax.compression.plan import ALIGN


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """Per (kind, layer, KV head) [2, L, Hkv]: ``kl``, the mean KL(base || model) on held-in calibration rows when
    only that head's ``kind`` keeps its first ``probe_width`` directions, and ``dropped``, the share of that head's
    energy (``s**2``) the probe removed. A head's modelled cost at width ``w`` is ``per_energy()`` times
    ``dropped_share(s, w)``."""

    kl: np.ndarray
    dropped: np.ndarray
    probe_width: int

    def per_energy(self) -> np.ndarray:
        """KL per unit of dropped energy [2, L, Hkv]; a head whose probe dropped nothing, or moved nothing (KL at or
        below zero from rounding), costs a tiny positive amount, so it is cut first but in a fixed order."""
        return np.maximum(self.kl, 1e-12) / np.maximum(self.dropped, 1e-12)


def dropped_share(s: np.ndarray, width: int) -> np.ndarray:
    """The share of each head's energy (``s**2``; ``s`` [..., d] descending) past its first ``width`` directions."""
    energy = np.asarray(s, np.float64) ** 2
    return energy[..., width:].sum(-1) / np.maximum(energy.sum(-1), 1e-300)


def probe_width(head_dim: int) -> int:
    """Where each head is probed: half its directions, on the plan's 16-column grid (at least 16)."""
    return max(ALIGN, head_dim // 2 // ALIGN * ALIGN)


def measure(
    model,
    plan,
    bases: dict,
    score: Callable,
    width: int | None = None,
    progress: bool = True,
) -> Sensitivity:
    """Probe every (kind, layer, KV head) of ``model`` (uncompressed) at ``width`` directions (default
    ``probe_width``): ``plan`` keeps every direction (``make_plan(removal_rate=0)``, heads in their calibrated
    order), ``bases`` its {"k", "v"} bases, ``score(model) -> float`` the KL to the uncompressed model
    (``split.kl_to``). 2·L·Hkv folds and forward passes, one compile."""
    d = plan.head_dim
    if np.any(plan.k_qk != d) or np.any(plan.k_v != d) or plan.head_order is not None:
        raise ValueError("measure probes a plan that keeps every direction of every head, in the calibrated order")
    layers, heads = plan.k_qk.shape
    if d <= ALIGN:  # heads of one 16-column block: nothing to cut, so nothing to probe (any p > 0 is out of reach)
        return Sensitivity(np.ones((2, layers, heads)), np.ones((2, layers, heads)), d)
    width = probe_width(d) if width is None else width
    if not ALIGN <= width < d or width % ALIGN:
        raise ValueError(f"probe width must be a multiple of {ALIGN} in [{ALIGN}, head_dim={d}), got {width}")
    kl = np.zeros((2, layers, heads))
    units = [(i, layer, head) for i in range(2) for layer in range(layers) for head in range(heads)]
    for i, layer, head in tqdm(units, desc="sensitivity probes", disable=not progress):
        key = ("k", "v")[i]  # Q/K's basis, then V's
        cut = dataclasses.replace(bases[key], down=bases[key].down.copy())
        cut.down[layer, head, :, width:] = 0.0
        kl[i, layer, head] = score(fold(model, plan, bases | {key: cut}))
    dropped = np.stack([dropped_share(bases[key].s, width) for key in ("k", "v")])  # the probed directions' energy
    return Sensitivity(kl, dropped, width)


def allocate(s_qk: np.ndarray, s_v: np.ndarray, sensitivity: Sensitivity, p: float) -> tuple[np.ndarray, np.ndarray]:
    """(k_qk, k_v) [L, Hkv]: the widths of least modelled cost whose overall rate is at least ``p``.

    Every head starts whole; 16-column chunks go cheapest first, a chunk's cost being the head's KL per unit of
    energy times the energy the chunk holds. Singular values descend, so each head's chunks get dearer as it
    narrows and taking the globally cheapest ones (ties: the outermost first) is the greedy optimum of this
    separable, convex cost. A ValueError if ``p`` would need a head below 16 columns."""
    d = s_qk.shape[-1]
    if sensitivity.kl.shape != (2, *s_qk.shape[:2]):
        raise ValueError(
            f"sensitivity of shape {sensitivity.kl.shape} does not match this model's (2, layers, KV heads) = "
            f"{(2, *s_qk.shape[:2])}: probe the model being planned"
        )
    steps = d // ALIGN
    energy = np.stack([s_qk, s_v]).astype(np.float64) ** 2  # [2, L, Hkv, d]
    blocks = energy.reshape(*energy.shape[:-1], steps, ALIGN).sum(-1)  # column blocks of 16
    blocks /= np.maximum(energy.sum(-1), 1e-300)[..., None]
    chunk = blocks[..., :0:-1] * sensitivity.per_energy()[..., None]  # removable blocks, outermost first
    chunk = np.maximum.accumulate(chunk, -1)  # dearer as a head narrows (rounding aside)
    total = energy[..., 0].size * d
    need = int(np.ceil(total * p / ALIGN - 1e-9))  # blocks to remove: the fewest that reach p
    if need > chunk.size:
        raise ValueError(
            f"target_rate {p} is out of reach: with every head at {ALIGN} columns the rate is {1 - ALIGN / d:.4f}"
        )
    depth = np.broadcast_to(np.arange(steps - 1), chunk.shape)
    removed = np.zeros(chunk.size, np.int64)
    removed[np.lexsort((depth.ravel(), chunk.ravel()))[:need]] = 1
    kept = d - ALIGN * removed.reshape(chunk.shape).sum(-1)
    return kept[0], kept[1]
