"""The prefill op's tuned defaults, in one place: the work items and the kernel read them, and so do the benchmarks
(bench/results/kernels.md "Prefill: knob sweep")."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import validate
from kvjax.ops.tiles import is_pow2


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """How prefill cuts its work and runs it (hashable: a static argument of the jitted kernel)."""

    balanced: bool = True  # narrower heads get taller query blocks and items run longest first (False: ablation)
    block_q: int = 128  # query rows per item for a 128 + 128-column head
    block_k: int = 128  # keys per loop step (halved where the K/V tiles would not fit shared memory)
    max_block_q: int = 128  # 256-row blocks with 8 warps computed wrong results on the H100
    # Tile widths a head's K and V may be read through (its narrowest that fits): few, so few classes and one short
    # compile for every layer (bench/results/startup.md "Engine: compile times"); masked columns are fetched from no
    # memory.
    tile_widths: tuple[int, ...] = (64, 128)
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        validate.int_fields(self, at_least_one=tuple(f.name for f in dataclasses.fields(self) if f.name != "balanced"))
        tiles = self.tile_widths
        if not isinstance(tiles, tuple) or not tiles or any(not is_pow2(t, 16) for t in tiles):
            raise ValueError(f"tile_widths must be a non-empty tuple of powers of two of at least 16, got {tiles!r}")
        for name in ("block_q", "block_k", "max_block_q"):
            value = getattr(self, name)
            if not is_pow2(value, 16):
                raise ValueError(f"{name} must be a power of two of at least 16, got {value}")

    def for_dtype(self, dtype) -> PrefillConfig:
        """This config with tiles that fit shared memory for ``dtype`` (float32 tiles are halved, fewer stages)."""
        if jnp.dtype(dtype).itemsize < 4:
            return self
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, 64),
            max_block_q=min(self.max_block_q, 64),
            block_k=min(self.block_k, 32),
            num_stages=min(self.num_stages, 2),
        )


PREFILL = PrefillConfig()
