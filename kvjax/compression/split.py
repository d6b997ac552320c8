"""How a rate's kept columns are split between Q/K and V, chosen by measured effect: the share whose compressed
model's next-token distributions on held-in calibration rows stay closest (mean KL) to the uncompressed model's.

Singular values of K and V live on different scales (a Gram of keys against one of values weighted by W_o), so no
rule that compares them can split a budget between the two; one removal rate for both only happens to land near the
best share on some models (bench/results/accuracy.md "Compression: K and V budgets")."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import validate
from kvjax.models.model import release_forwards

SHARES = (0.3, 0.4, 0.5, 0.6, 0.7)  # the coarse pass; then the best one's neighbours at half the step


KL_POSITIONS = 128  # positions projected onto the vocabulary at a time by ``kl_to``'s scores
KEEP_BYTES = 3 << 30  # base log-probs ``kl_to`` keeps between scores; past this it forms them again for each score


def kl_to(base, tokens: np.ndarray, rows: int, positions: int = KL_POSITIONS, release: bool = False) -> Callable:
    """A score for compressed models: mean per-token KL(base || model) over the last ``rows`` calibration rows of
    ``tokens`` [B, T] that are whole (the last row may end in -1 padding).

    Memory: models run a row at a time, and log-probs are formed ``positions`` at a time from final-norm hidden
    states, never as a whole [rows, T, vocab] array (Gemma 3's 262K vocabulary makes that 2 GB for two 1,024-token
    rows, and the direct formula held several such arrays). ``base``'s are kept between scores while they take at
    most ``KEEP_BYTES``, and formed again for each score past that (one more vocabulary projection a score).
    ``release``: drop each scored model's compiled forward once scored (``models.model.release_forwards``), for
    callers scoring models of distinct widths once each (candidate plans); sensitivity probes share one shape and
    keep theirs."""
    positions = validate.positive("positions", positions)
    tokens = np.asarray(tokens)
    tokens = tokens[(tokens >= 0).all(axis=1)][-rows:]
    t = tokens.shape[1]
    starts = range(0, t, positions)
    base_hidden = _hidden_rows(base, tokens)

    def formed(s):
        return _log_probs(base.project(base_hidden[:, s : s + positions]))

    fits = tokens.size * int(base.config.vocab_size) * 4 <= KEEP_BYTES
    kept = {s: formed(s) for s in starts} if fits else None

    def score(model) -> float:
        hidden = _hidden_rows(model, tokens)
        if release:
            release_forwards()
        base_logp = [kept[s] if kept is not None else formed(s) for s in starts]
        kl = [_kl(b, model.project(hidden[:, s : s + positions])) for s, b in zip(starts, base_logp, strict=True)]
        return float(np.concatenate([np.asarray(x, np.float64) for x in kl], axis=1).mean())

    return score


def _hidden_rows(model, tokens: np.ndarray) -> jax.Array:
    """``model.hidden`` of ``tokens`` [B, T] a row at a time (one row's activations at a time): [B, T, E]."""
    return jnp.concatenate([model.hidden(row[None]) for row in tokens])


@jax.jit
def _log_probs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


@jax.jit
def _kl(base_logp, logits):
    """KL(base || softmax(logits)) at each position [..., vocab] -> [...], float32."""
    logp = _log_probs(logits)
    return jnp.sum(jnp.exp(base_logp) * (base_logp - logp), axis=-1)


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
