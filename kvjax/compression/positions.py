"""Post-RoPE Gram matrices for any range of served positions, derived exactly from pre-RoPE ones.

RoPE rotates pair ``i`` (coordinates ``i`` and ``i + d/2``, the rotate-half convention) by ``pos * inv_freq[i]``,
so a post-RoPE row is ``R(pos) x`` with ``x`` its pre-RoPE row. If pre-RoPE rows do not depend on their position,
the post-RoPE Gram over positions ``0..N-1`` is ``mean_pos R(pos) G R(pos)^T``: a basis taken from it fits every
position a plan serves, not only those calibration rows happened to cover.
"""

from __future__ import annotations

import numpy as np

from kvjax import validate


def post_rope_gram(pre_gram, inv_freq, max_context: int) -> np.ndarray:
    """``mean over pos in 0..max_context-1 of R(pos) G R(pos)^T`` for pre-RoPE Grams ``G`` [..., d, d], exactly,
    in closed form (float64, O(d^2) per matrix): symmetric PSD for symmetric PSD ``G``, its trace unchanged."""
    max_context = validate.positive("max_context", max_context)
    gram = np.asarray(pre_gram, np.float64)
    inv_freq = np.asarray(inv_freq, np.float64)
    if gram.ndim < 2 or gram.shape[-1] != gram.shape[-2] or gram.shape[-1] % 2:
        raise ValueError(f"pre_gram must have shape [..., d, d] with d even, got {gram.shape}")
    h = gram.shape[-1] // 2
    if inv_freq.shape != (h,):
        raise ValueError(f"inv_freq must have shape ({h},) for head dim {2 * h}, got {inv_freq.shape}")
    if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(inv_freq))):
        raise ValueError("pre_gram and inv_freq must be finite")
    # Pair block (i, j) of G, M = [[a, b], [c, e]], splits into a part commuting with rotations (complex
    # multiplication by p + iq) and one anti-commuting (z -> (r + is) conj(z)); R(x) M R(y)^T rotates the first by
    # x - y and the second by x + y, so averaging over positions multiplies them by mean_phase(theta_i -+ theta_j).
    a, b = gram[..., :h, :h], gram[..., :h, h:]
    c, e = gram[..., h:, :h], gram[..., h:, h:]
    rotating = ((a + e) + 1j * (c - b)) / 2 * mean_phase(inv_freq[:, None] - inv_freq[None, :], max_context)
    reflecting = ((a - e) + 1j * (b + c)) / 2 * mean_phase(inv_freq[:, None] + inv_freq[None, :], max_context)
    out = np.block(
        [
            [rotating.real + reflecting.real, reflecting.imag - rotating.imag],
            [rotating.imag + reflecting.imag, rotating.real - reflecting.real],
        ]
    )
    return (out + np.swapaxes(out, -1, -2)) / 2


def mean_phase(omega, n: int) -> np.ndarray:
    """``mean over pos in 0..n-1 of exp(i pos omega)`` (complex128), by the Dirichlet kernel: accurate for every
    ``omega``, including at and near multiples of 2 pi."""
    omega = np.asarray(omega, np.float64)
    half = (omega - 2 * np.pi * np.round(omega / (2 * np.pi))) / 2  # in [-pi/2, pi/2]: sin(half) = 0 iff half = 0
    s = np.sin(half)
    safe = np.where(s == 0, 1.0, s)
    ratio = np.where(s == 0, 1.0, np.sin(n * half) / (n * safe))
    return np.exp(1j * (n - 1) * half) * ratio
