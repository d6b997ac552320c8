"""Palu's cached K: a pre-RoPE latent per KV head that attention rebuilds to full K (``up``) and rotates by RoPE at
every call (the Palu paper, section 3.3: the baseline kvjax compares ZACK against).

The model hands attention a ``LatentK`` with the latent; the ops pick the form they read: the references call it on
the gathered latent (full post-RoPE K), the decode kernel takes ``up`` and rebuilds inside its tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.models.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class LatentK:
    """A layer's K rebuild: head g's latent (``layout.k_widths[g]`` packed columns) times ``up[g]`` [w, d], then
    RoPE by ``inv_freq`` [d/2] at the token's position (Palu), or at the start of its band of ``band`` positions
    (banded ZACK: the latent is ``U^T RoPE(n mod band) k_pre``, ``up`` is ``U^T``, so the rebuilt key is the
    post-RoPE key projected on the band's frame ``RoPE(start) U``; DESIGN.md section 7, "Banded bases")."""

    up: tuple[jax.Array, ...]
    inv_freq: np.ndarray
    layout: HeadLayout
    band: int | None = None
    matrix: jax.Array | None = None  # ``basis`` where the caller holds it whole (banded ZACK's rotation matrix)

    def basis(self) -> jax.Array:
        """[d, k_cols]: every head's ``up`` transposed, side by side in the packed K columns (banded ZACK: its Q/K
        rotation matrix, ``rotation.QKRotation.matrix``, which the banded decode kernel projects queries on)."""
        if self.matrix is not None:
            return self.matrix
        return jnp.concatenate([up.T for up in self.up], axis=1)

    def __call__(self, latent, positions):
        """Packed latent [B, S, k_cols] at ``positions`` [B, S] -> full post-RoPE K [B, S, Hkv*d]."""
        starts = HeadLayout.offsets(self.layout.k_widths)
        full = jnp.stack(
            [latent[..., s : s + w] @ up for s, w, up in zip(starts, self.layout.k_widths, self.up)], axis=2
        )
        angles_at = positions if self.band is None else positions - positions % self.band
        return apply_rope(full, angles_at, self.inv_freq).reshape(*latent.shape[:2], -1)
