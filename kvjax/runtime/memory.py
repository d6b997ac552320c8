"""How many cache pages a memory budget buys.

A budget is a fraction of the memory free now (``kvjax.machine.available_bytes``: on a GPU XLA's pool less what is
live, the weights and anything else already allocated; on a CPU the host memory this process may still use) or a
byte count. The cache gets the budget less room for the largest step's activations, in
whole pages; a page costs the same bytes in every layer as its layout asks for, so a compressed model's narrower
pages buy proportionally more of them, and with them more tokens and concurrent sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import machine, validate
from kvjax.models.config import ModelConfig


class CacheTooSmall(ValueError):
    """A cache budget that cannot hold one sequence of ``max_seq_len`` tokens; ``tokens``: what it holds."""

    def __init__(self, message: str, tokens: int):
        super().__init__(message)
        self.tokens = tokens


def size(n: int) -> str:
    """Bytes for people: "12.0 GiB", "3.5 MiB", "800 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def free_bytes(device=None) -> int | None:
    """Bytes this process may still allocate on ``device`` (``kvjax.machine.available_bytes``), or None where
    nothing says."""
    return machine.available_bytes(device)


def activation_bytes(
    config: ModelConfig, tokens: int, rows: int, context: int, dtype, *, scores: bool, gathers: bool
) -> int:
    """An upper estimate of the live activations of one step over ``tokens`` padded tokens in ``rows`` rows: every
    per-token tensor of a layer (residual, norms in float32, Q/K/V, attention output, the MLP's gate, up and
    product) held at once, twice over for the compiler's copies, and each row's float32 logits; ``scores``:
    attention materializes float32 scores against ``context`` positions (the jnp reference path; the kernels
    stream them); ``gathers``: it gathers each row's ``context`` positions of full K and V
    (the reference, and Palu's prefill, which rebuilds K)."""
    item = jnp.dtype(dtype).itemsize
    h, mlp, heads = config.hidden_size, config.intermediate_size, config.num_heads
    qkv = (heads + 2 * config.num_kv_heads) * config.head_dim
    per_token = item * (4 * h + qkv + heads * config.head_dim + 3 * mlp) + 4 * 2 * h
    total = 2 * tokens * per_token + 4 * rows * config.vocab_size
    if scores:
        total += 4 * tokens * heads * context
    if gathers:
        total += item * rows * context * 2 * config.num_kv_heads * config.head_dim
    return total


def budget_bytes(memory: float | int, name: str = "cache_memory") -> int:
    """The budget in bytes: an int is bytes; a float in (0, 1] a fraction of the device memory free now."""
    memory = validate.memory_budget(name, memory)
    if isinstance(memory, int):
        return memory
    free = free_bytes()
    if free is None:
        raise ValueError(
            f"{name}={memory} is a fraction of free memory, and neither the {jax.devices()[0].platform} device nor "
            "the host reports its memory; give the budget in bytes instead"
        )
    return int(memory * free)


def pool_pages(budget: int, reserve: int, page_bytes, needs, *, what: str = "memory") -> tuple[int, ...]:
    """Pages per pool within ``budget`` bytes after ``reserve``: pool 0 holds every position of its sequences, a
    window pool only some, so no pool gets more pages than pool 0, nor more than its ``needs``; pool 0 gets the
    most that fit (``needs[0]`` if its layers take no bytes). A clear error when pool 0 gets fewer than two."""
    room = budget - reserve

    def cost(g: int) -> int:
        return sum(b * min(n, g) for b, n in zip(page_bytes, needs))

    lo, hi = 1, max(needs)  # the largest g with cost(g) <= room, by bisection: cost grows with g
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= room else (lo, mid - 1)
    if lo < 2 or cost(lo) > room:
        page = sum(page_bytes)
        raise ValueError(
            f"the {what} budget of {size(budget)}, less {size(reserve)} for a step's activations, holds "
            f"{max(room // page, 0)} pages of {size(page)}; a cache needs at least 2 "
            "(give a larger budget, or a smaller max_batch, chunk_tokens or max_seq_len)"
        )
    return tuple(needs[0] if i == 0 and not page_bytes[0] else min(n, lo) for i, n in enumerate(needs))
