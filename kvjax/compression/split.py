"""How a rate's kept columns are split between Q/K and V, chosen by measured effect: the share whose compressed
model's next-token distributions on held-in calibration rows stay closest (mean KL) to the uncompressed model's.

Singular values of K and V live on different scales (a Gram of keys against one of values weighted by W_o), so no
rule that compares them can split a budget between the two; one removal rate for both only happens to land near the
best share on some models (bench/results/accuracy.md "Compression: K and V budgets")."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

SHARES = (0.3, 0.4, 0.5, 0.6, 0.7)  # the coarse pass; then the best one's neighbours at half the step


def kl_to(base, tokens: np.ndarray, rows: int) -> Callable:
    """A score for compressed models: mean per-token KL(base || model) over the last ``rows`` calibration rows of
    ``tokens`` [B, T] that are whole (the last row may end in -1 padding)."""
    tokens = np.asarray(tokens)
    tokens = tokens[(tokens >= 0).all(axis=1)][-rows:]
    base_logp = jax.nn.log_softmax(base.logits(tokens).astype(np.float32), axis=-1)

    def score(model) -> float:
        logp = jax.nn.log_softmax(model.logits(tokens).astype(np.float32), axis=-1)
        return float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())

    return score


def best_share(score: Callable[[float], float], shares=SHARES) -> tuple[float, list[tuple[float, float]]]:
    """(share, [(share, score) tried]): the lowest-scoring share of ``shares``, then of its two neighbours half a
    step away (within (0, 1)); each share is scored once."""
    tried: dict[float, float] = {}

    def at(share: float) -> float:
        share = round(share, 6)
        if share not in tried:
            tried[share] = score(share)
        return tried[share]

    best = min(shares, key=at)
    half = (shares[1] - shares[0]) / 2 if len(shares) > 1 else 0.05
    for share in (best - half, best + half):
        if 0 < share < 1:
            at(share)
    share = min(tried, key=tried.__getitem__)
    return share, sorted(tried.items())
