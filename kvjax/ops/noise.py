"""Counter-based Gumbel noise: a standard Gumbel draw that is a pure function of integer coordinates, with the same
bits in jnp and inside a Pallas kernel (Keyformer's regularizer, Adnan et al., 2024, section 3.3: the draw for a
(query, key) pair must not depend on how a prompt is cut into chunks or blocks, ``eviction.metrics.gumbel_noise``).

The hash is Wellons's 32-bit "lowbias32" mixer applied once per coordinate. It runs on int32 with logical shifts and
wrapping products (the same bits as uint32 arithmetic), since int32 is what every backend and Triton's lowering take
without conversions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def _i32(c: int):
    """The int32 holding the bits of the 32-bit constant ``c``."""
    return np.array(c & 0xFFFFFFFF, np.uint32).view(np.int32)


GOLDEN, M1, M2 = _i32(0x9E3779B9), _i32(0x7FEB352D), _i32(0x846CA68B)


def mix(x):
    """One round of the avalanche mixer over int32 ``x`` (any shape; products wrap)."""
    x = x ^ lax.shift_right_logical(x, jnp.int32(16))
    x = x * M1
    x = x ^ lax.shift_right_logical(x, jnp.int32(15))
    x = x * M2
    return x ^ lax.shift_right_logical(x, jnp.int32(16))


def base(seed: int, layer):
    """int32 scalar: the hash of (seed, layer), where every draw of one layer starts."""
    return mix(mix(jnp.int32(_i32(seed)) ^ GOLDEN) ^ jnp.asarray(layer, jnp.int32))


def gumbel(h):
    """Standard Gumbel draws, float32, from int32 hashes ``h``: the top 23 bits as a uniform u = (n + 1/2) / 2^23 in
    (0, 1), then -log(-log(u)). Every u is exact in float32, so none is 0 or 1 and no draw is infinite (with 24 bits,
    n = 2^24 - 1 rounded to u = 1 and an infinite draw, one in 2^24)."""
    u = (lax.shift_right_logical(h, jnp.int32(9)).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))
