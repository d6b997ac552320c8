"""Jitted prefill and decode steps over a paged cache, and the host bookkeeping around them.

The engine joins the model (which only calls ``attend``), the cache (pages, block tables, allocator) and the
attention entry point. Shapes are bucketed to powers of two (batch, prompt length) and the block table has a fixed
width, so a new prompt length or batch size rarely compiles a new step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.ops import attention
from kvjax.ops.decode.op import DecodeOp
from kvjax.ops.decode.plan import bucket as pow2_bucket
from kvjax.ops.prefill.op import PrefillOp
from kvjax.runtime.cache import PageAllocator, PagedKVCache, block_table


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two >= max(n, minimum), capped at ``maximum``."""
    size = max(minimum, pow2_bucket(n))
    return size if maximum is None else min(size, maximum)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, greedy: bool) -> jax.Array:
    """Next token ids [B] from float32 logits [B, V]: argmax, or temperature + nucleus (top-p) sampling with row
    i drawn from ``keys[i]`` alone."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # always keeps the most likely token
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    draw = jax.vmap(jax.random.categorical)
    return draw(keys, jnp.where(logits >= threshold, logits, -jnp.inf)).astype(jnp.int32)


def _row_keys(key, rows: int, shared: bool):
    """One key per row: the same for every row (batch-invariant: a row's draws depend on no other row), or split."""
    return jnp.broadcast_to(key, (rows,)) if shared else jax.random.split(key, rows)


def _prefill_step(graphdef, state, cache, tokens, lengths, table, key, temperature, top_p, *, greedy, op, shared_key):
    module = nnx.merge(graphdef, state)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ks, vs = list(cache.k), list(cache.v)

    def attend(i, q, k, v, rebuild=None):
        out, ks[i], vs[i] = attention.prefill(
            q, k, v, module.layouts[i], ks[i], vs[i], table, lengths, op=op, rebuild=rebuild
        )
        return out

    hidden = module.hidden(tokens, positions, attend)
    logits = module.logits(hidden[jnp.arange(b), lengths - 1])
    keys = _row_keys(key, b, shared_key)
    return sample(logits, keys, temperature, top_p, greedy), PagedKVCache(tuple(ks), tuple(vs))


def _decode_step(
    graphdef, state, cache, tokens, positions, table, schedule, key, temperature, top_p, *, greedy, op, shared_key
):
    module = nnx.merge(graphdef, state)
    ks, vs = list(cache.k), list(cache.v)

    def attend(i, q, k, v, rebuild=None):
        out, ks[i], vs[i] = attention.decode(
            q[:, 0],
            k[:, 0],
            v[:, 0],
            module.layouts[i],
            ks[i],
            vs[i],
            table,
            positions + 1,
            op=op,
            rebuild=rebuild,
            schedule=None if schedule is None else schedule.layer(i),
        )
        return out[:, None]

    hidden = module.hidden(tokens[:, None], positions[:, None], attend)
    logits = module.logits(hidden[:, 0])
    keys = _row_keys(key, tokens.shape[0], shared_key)
    return sample(logits, keys, temperature, top_p, greedy), PagedKVCache(tuple(ks), tuple(vs))


class Engine:
    """One paged cache sized for ``max_batch`` sequences of up to ``max_seq_len`` tokens, the decode and prefill ops,
    and the jitted steps that run the model over them."""

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        max_seq_len: int = 512,
        page_size: int = 16,
        num_pages: int | None = None,
        cache_dtype=None,
        backend: str | None = None,
        batch_invariant: bool = False,
    ):
        """``backend``: "reference" (jnp), "pallas" (GPU kernels) or "interpret" (the kernels on the CPU);
        default: the kernels on a GPU, the reference elsewhere. ``batch_invariant``: decode plans split each
        sequence by its own length alone; the caller then prefills one sequence at a time and decodes
        ``max_batch`` rows every step (``kvjax.generate``)."""
        self.model, self.max_batch, self.page_size = model, max_batch, page_size
        self.batch_invariant = batch_invariant
        self.backend = attention.check_backend(backend or attention.default_backend())
        kernel_ready = all(w % 16 == 0 for lay in model.layouts for w in lay.k_widths + lay.v_widths)
        if self.backend != "reference" and not kernel_ready:
            if backend is not None:
                raise ValueError("the attention kernels need head widths that are multiples of 16")
            self.backend = "reference"
        self.pages_per_seq = -(-max_seq_len // page_size)
        self.max_seq_len = self.pages_per_seq * page_size
        self.decode_op = self.prefill_op = None
        if self.backend != "reference":
            interpret = self.backend == "interpret"
            self.prefill_op = PrefillOp(interpret=interpret)
            if model.module.method != "palu":  # Palu layers take the reference path
                self.decode_op = DecodeOp(
                    model.layouts, page_size, self.pages_per_seq, batch_invariant=batch_invariant, interpret=interpret
                )
        num_pages = num_pages or max_batch * self.pages_per_seq + 1
        self.cache = PagedKVCache.create(model.layouts, num_pages, page_size, cache_dtype or model.dtype)
        self.allocator = PageAllocator(num_pages)
        donate = (1,) if jax.default_backend() != "cpu" else ()
        self._steps = {}
        for name, fn, op in (("prefill", _prefill_step, self.prefill_op), ("decode", _decode_step, self.decode_op)):
            for greedy in (True, False):
                step = functools.partial(fn, model.graphdef, greedy=greedy, op=op, shared_key=batch_invariant)
                self._steps[name, greedy] = jax.jit(step, donate_argnums=donate)

    def prefill(self, prompts: list[list[int]], page_lists: list[list[int]], key, temperature: float, top_p: float):
        """Write the prompts' K/V into their pages; return the first sampled token per prompt (padded batch)."""
        b = bucket(len(prompts), maximum=self.max_batch)
        t = bucket(max(map(len, prompts)), minimum=self.page_size, maximum=self.max_seq_len)
        tokens = np.zeros((b, t), np.int32)
        lengths = np.ones((b,), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
            lengths[row] = len(prompt)
        table = block_table(page_lists + [[]] * (b - len(prompts)), self.pages_per_seq)
        step = self._steps["prefill", temperature == 0.0]
        first, self.cache = step(
            self.model.state,
            self.cache,
            tokens,
            lengths,
            table,
            key,
            jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p),
        )
        return first, table

    def decode(self, tokens, positions: np.ndarray, table: np.ndarray, key, temperature: float, top_p: float):
        """Append one token per sequence at ``positions``; return the next sampled token per sequence."""
        step = self._steps["decode", temperature == 0.0]
        nxt, self.cache = step(
            self.model.state,
            self.cache,
            tokens,
            jnp.array(positions, jnp.int32),
            table,
            self.schedule(positions + 1),
            key,
            jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p),
        )
        return nxt

    def schedule(self, lengths: np.ndarray):
        """The decode op's device schedule for these lengths (None on the reference path)."""
        return None if self.decode_op is None else self.decode_op.plan(lengths)
