"""ZACK's post-RoPE Q/K rotation (DESIGN.md section 1, "Zero-overhead application": q' = RoPE(E W_q) R_qk,k): each
KV group's queries and key are projected on the group's first ``k_widths[g]`` basis directions, so scores are
computed on the packed K columns the cache holds.

The matrix holds every group's directions side by side, in the packed K column order. The product comes in two
forms, for the attention ops to pick: ``packed`` (each query head on its own group's columns: the cache's and the
references' layout) and ``wide`` (every head on every packed column in one GEMM, of which the decode kernel reads
each head's own columns: no per-group matmuls, transposes or gathers of q in the step, bench/results/engine.md "Engine:
the Q/K rotation as one GEMM").

A plan with a score-aware pair (``RankPlan.qk_basis == "pair"``) projects queries on a matrix of their own
(``query``, A) and keys on ``matrix`` (B), with ``A B^T = I`` at full width (``CalibrationStats.basis``); every form
below then takes q by ``query`` and k by ``matrix``, and a banded plan turns ``query``'s directions by the band's
angle. One orthogonal rotation is the case ``query = matrix``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.layout import HeadLayout
from kvjax.models.latent import LatentK


def packed_rotation(bases: jax.Array, k_widths) -> jax.Array:
    """The rotation matrix [d, k_cols] from per-group bases [Hkv, d, >= max(k_widths)]: group g's first
    ``k_widths[g]`` columns, groups side by side."""
    return jnp.concatenate([bases[g, :, :w] for g, w in enumerate(k_widths)], axis=-1)


def identity_rotation(layout: HeadLayout, dtype) -> jax.Array:
    """The rotation that keeps each group's first ``k_widths[g]`` coordinates (a freshly built compressed model)."""
    eye = jnp.eye(layout.head_dim, dtype=dtype)
    return packed_rotation(jnp.broadcast_to(eye, (layout.num_kv_heads, *eye.shape)), layout.k_widths)


@dataclasses.dataclass(frozen=True)
class QKRotation:
    """A ZACK layer's rotation as the model hands it to ``attend``, with post-RoPE q [..., H*d] and k [..., Hkv*d]."""

    matrix: jax.Array  # [d, k_cols]: group g's directions in columns k_offsets[g] .. k_offsets[g] + k_widths[g]
    layout: HeadLayout
    query: jax.Array | None = None  # [d, k_cols]: the queries' directions where they differ from the keys' (a pair)

    def _columns(self):
        lay = self.layout
        return zip(HeadLayout.offsets(lay.k_widths), lay.k_widths)

    @property
    def for_queries(self) -> jax.Array:
        """[d, k_cols]: the directions queries are projected on (``matrix`` unless a pair gives them their own)."""
        return self.matrix if self.query is None else self.query

    def packed(self, q, k):
        """(q [..., q_cols], k [..., k_cols]) packed as the cache is: per group, its query heads and its key times
        its own directions."""
        lay = self.layout
        lead = q.shape[:-1]
        qh = q.reshape(*lead, lay.num_kv_heads, lay.group_size, lay.head_dim)
        qm = self.for_queries
        qs = [
            (qh[..., g, :, :] @ qm[:, start : start + width]).reshape(*lead, lay.group_size * width)
            for g, (start, width) in enumerate(self._columns())
        ]
        return jnp.concatenate(qs, axis=-1), self.keys(k)

    def keys(self, k):
        """k [..., Hkv*d] packed as the cache holds it: each group's key times its own directions. Up to
        ``ONE_GEMM_ROWS`` tokens (a decode step's), as one GEMM of every key head on every column, each column kept
        from its own head's row (``own_columns``): a small GEMM and its slices a group cost a banded rate-0.5 8B
        step 0.56 ms and 0.4 ms (bench/results/kernels.md "Banded decode kernel")."""
        lay = self.layout
        kh = k.reshape(*k.shape[:-1], lay.num_kv_heads, lay.head_dim)
        if math.prod(k.shape[:-1]) <= ONE_GEMM_ROWS:
            return jnp.where(own_columns(lay), kh @ self.matrix, 0).sum(axis=-2, dtype=k.dtype)
        return jnp.concatenate(
            [kh[..., g, :] @ self.matrix[:, start : start + width] for g, (start, width) in enumerate(self._columns())],
            axis=-1,
        )

    def packed_rows(self, q, k):
        """``packed`` for one token a row (q [B, H*d], k [B, Hkv*d]) as one GEMM (``wide``) and a gather of each
        query head's own columns (``packed_query``), where ``packed`` runs a small GEMM a group: 1 ms of a rate-0.5
        8B-shaped decode step at B32 (bench/results/eviction.md "Eviction: the engine's decode step")."""
        wide, k = self.wide(q, k)
        return packed_query(wide, self.layout), k

    def banded(self, inv_freq, band: int):
        """The K rebuild of a banded plan (``latent.LatentK`` with ``band``): each group's query directions
        transposed, turned by the band's start angle as keys are read; its ``basis`` is the query matrix itself.
        Scores on the rebuilt keys are those on the packed columns: ``q . RoPE(bW) A c = (A^T RoPE(-bW) q) . c``."""
        qm = self.for_queries
        ups = tuple(qm[:, start : start + width].T for start, width in self._columns())
        return LatentK(ups, inv_freq, self.layout, band, matrix=qm)

    def wide(self, q, k):
        """For one token a row (q [B, H*d], k [B, Hkv*d]): (q [B, H + Hkv, k_cols], k [B, k_cols]). Row ``h`` of
        the wide q is query head h on every packed column, of which only its group's are meaningful (rows past H
        are the key heads); k is packed. One GEMM and one small fusion (a pair: a GEMM for q and one for k)."""
        lay = self.layout
        b = q.shape[0]
        qh, kh = q.reshape(b, lay.num_heads, lay.head_dim), k.reshape(b, lay.num_kv_heads, lay.head_dim)
        if self.query is None:
            wide = jnp.concatenate([qh, kh], axis=1) @ self.matrix
        else:
            wide = jnp.concatenate([qh @ self.query, kh @ self.matrix], axis=1)
        # each packed key column from its own head's row: a select and a sum over the Hkv key rows, which XLA fuses
        # into one small kernel (as a gather, XLA first transposed the whole wide block: 5 us a layer)
        k = jnp.where(own_columns(lay), wide[:, lay.num_heads :], 0).sum(axis=1, dtype=wide.dtype)
        return wide, k


ONE_GEMM_ROWS = 512  # tokens up to which ``QKRotation.keys`` projects every key head on every column in one GEMM


def own_columns(layout: HeadLayout) -> np.ndarray:
    """bool [Hkv, k_cols]: packed K column c belongs to key head h."""
    return (
        np.repeat(np.arange(layout.num_kv_heads), layout.k_widths)[None, :] == np.arange(layout.num_kv_heads)[:, None]
    )


def packed_query(q_wide, layout: HeadLayout):
    """A wide q [B, >= H, k_cols] (``QKRotation.wide``) packed: each query head on its own group's columns."""
    rows, cols = layout.packed_columns()
    return q_wide[:, rows, cols]
