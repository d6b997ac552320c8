"""Per-layer attention layout: how wide each KV head's K and V rows are.

Today every width equals ``head_dim``; the compression step shrinks them per head. Models, the cache and the
attention kernels all read widths from here, so a compressed model's cache shrinks without any of them changing.
Tensors use a *packed* layout: a layer's K rows are the KV heads' K rows side by side (``sum(k_widths)`` columns),
and likewise V; Q packs every query head at the K width of its group, the attention output at the V width.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Static (hashable) description of one layer's attention heads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # original head dim; the softmax scale stays 1/sqrt(head_dim) after compression
    k_widths: tuple[int, ...]
    v_widths: tuple[int, ...]
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("k_widths", "v_widths"):
            widths = getattr(self, name)
            if len(widths) != self.num_kv_heads:
                raise ValueError(f"{name} has {len(widths)} entries for {self.num_kv_heads} KV heads")
            if any(not 0 < w <= self.head_dim for w in widths):
                raise ValueError(f"{name}={widths}: every width must be in [1, head_dim={self.head_dim}]")

    @classmethod
    def uniform(cls, num_heads, num_kv_heads, head_dim, sliding_window=None) -> HeadLayout:
        return cls(
            num_heads, num_kv_heads, head_dim, (head_dim,) * num_kv_heads, (head_dim,) * num_kv_heads, sliding_window
        )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def k_cols(self) -> int:
        return sum(self.k_widths)

    @property
    def v_cols(self) -> int:
        return sum(self.v_widths)

    @property
    def q_cols(self) -> int:
        return self.group_size * self.k_cols

    @property
    def out_cols(self) -> int:
        return self.group_size * self.v_cols

    @staticmethod
    def offsets(widths, repeat=1) -> list[int]:
        """Start column of each KV head's block when every block is ``repeat`` rows of its width."""
        starts, total = [], 0
        for w in widths:
            starts.append(total)
            total += repeat * w
        return starts

    def packed_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """For each packed q column, (its query head, its K column): head g's queries side by side, each on the
        group's ``k_widths[g]`` columns."""
        return _packed_columns(self)


@functools.cache
def _packed_columns(layout: HeadLayout) -> tuple[np.ndarray, np.ndarray]:
    g, starts = layout.group_size, HeadLayout.offsets(layout.k_widths)
    heads = [(h * g + j, s, w) for h, (s, w) in enumerate(zip(starts, layout.k_widths)) for j in range(g)]
    rows = np.concatenate([np.full(w, row) for row, _, w in heads])
    cols = np.concatenate([np.arange(s, s + w) for _, s, w in heads])
    return rows, cols
