"""The prefill op's tuned defaults, in one place: the work items and the kernel read them, and so do the benchmarks
(bench/RESULTS.md "Prefill: knob sweep")."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax import validate


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """How prefill cuts its work and runs it (hashable: a static argument of the jitted kernel)."""

    balanced: bool = True  # narrower heads get taller query blocks and items run longest first (False: ablation)
    block_q: int = 128  # query rows per item for a 128 + 128-column head
    block_k: int = 128  # keys per loop step (halved where the K/V tiles would not fit shared memory)
    max_block_q: int = 128  # 256-row blocks with 8 warps computed wrong results on the H100
    max_segments: int = 3  # power-of-two pieces a head's width may be read as (80 = 64 + 16)
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        if not isinstance(self.balanced, bool):
            raise ValueError(f"balanced must be a bool, got {self.balanced!r}")
        validate.int_fields(self, at_least_one=tuple(f.name for f in dataclasses.fields(self) if f.name != "balanced"))
        for name in ("block_q", "block_k", "max_block_q"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
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
