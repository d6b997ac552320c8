"""``kvjax.Model``: a loaded model (config, Flax module, tokenizer, rank plan) and its full causal forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import validate
from kvjax.models.transformer import Transformer
from kvjax.ops.prefill.reference import causal_attention, quantized_causal_attention


def _full_hidden(module, tokens, kv=None):
    """Final-norm hidden states of a full causal forward; ``kv`` (a ``kv_schemes`` scheme): every query reads K/V as
    a cache of quantized pages would serve it when its token was decoded (``quantized_causal_attention``)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def attend(i, q, k, v, rebuild=None, rotation=None):
        if rotation is not None:
            q, k = rotation.packed(q, k)
        if kv is not None:
            if rebuild is not None:
                raise ValueError("kv_bits: quantized pages are not supported on Palu or banded ZACK models yet")
            return quantized_causal_attention(q, k, v, module.layouts[i], kv)
        return causal_attention(q, k, v, module.layouts[i], rebuild)

    return module.hidden(tokens, positions, attend)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens):
    module = nnx.merge(graphdef, state)
    return module.logits(_full_hidden(module, tokens))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _hidden(graphdef, state, tokens, kv=None):
    return _full_hidden(nnx.merge(graphdef, state), tokens, kv)


def release_forwards() -> None:
    """Drop every compiled full forward (``Model.logits``, ``Model.hidden``). On the CPU each keeps its buffers
    between calls, about 1.7 GB for Gemma 3 270M over two 4,096-token rows, so a caller scoring many models of
    distinct widths once each (``compression.split.kl_to(release=True)``) frees them as it goes; the next call of
    any model compiles again."""
    for forward in (_full_logits, _hidden):
        forward.clear_cache()  # type: ignore[attr-defined]  # jit's wrapper has it; its stub does not say so


@functools.partial(jax.jit, static_argnums=0)
def _project(graphdef, state, hidden):
    return nnx.merge(graphdef, state).logits(hidden)


class Model:
    """What ``kvjax.load`` returns and every other entry point takes."""

    def __init__(
        self,
        module: Transformer,
        tokenizer=None,
        plan=None,
        source: str | None = None,
        *,
        kv_bits: int | str | None = None,
    ):
        """``plan`` is the ``RankPlan`` a compressed module was built with (None: uncompressed); ``source`` the
        checkpoint it was read from (``save`` never writes over, into or around it). ``module``'s projections are
        joined in place (``Transformer.join``).

        ``kv_bits`` is how the model asks to be served: its KV cache in 4- or 2-bit quantized or GEAR pages
        (``kv_schemes.served``), or None (pages of the cache's dtype). Plain metadata, saved with the checkpoint
        (``kvjax-convert --kv-bits``) and read back by ``kvjax.load``; ``kvjax.generate``, ``kvjax-infer`` and
        ``kvjax-serve`` use it when their caller gives no ``kv_bits``. It is checked where it is used: by ``save``
        and by the engine's configuration."""
        module.join()
        self.module, self.tokenizer, self.plan, self.source = module, tokenizer, plan, source
        self.kv_bits = kv_bits
        self.tensor_parallel = 1  # devices the engine splits it over by default (kvjax.load(..., tensor_parallel=N))
        self.graphdef, self.state = nnx.split(module)
        self._engines: dict = {}

    def release_cache(self) -> None:
        """Drop the engine ``kvjax.generate`` keeps for this model, and with it its KV cache's device memory."""
        self._engines.clear()

    @classmethod
    def random(cls, config, dtype="float32", seed: int = 0, scale: float = 1.0) -> Model:
        """A model with random weights (tests, benchmarks of realistic shapes); ``scale`` multiplies them."""
        module = Transformer(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
        if scale != 1.0:
            for _, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
                var.set_value(var.get_value() * scale)
        return cls(module)

    @property
    def config(self):
        return self.module.config

    @property
    def layouts(self):
        return self.module.layouts

    @property
    def dtype(self):
        return self.module.embed.get_value().dtype  # an array's, or a shapes-only module's ShapeDtypeStruct's

    @property
    def has_weights(self) -> bool:
        """False for a model of shapes only: loaded for tensor parallelism (``kvjax.load(..., tensor_parallel=N)``,
        its engine's devices read their shares) or built under ``nnx.eval_shape``."""
        return not isinstance(self.module.embed.get_value(), jax.ShapeDtypeStruct)

    def need_weights(self, what: str) -> None:
        """A one-line ValueError for ``what`` on a model without weights (``has_weights``)."""
        if not self.has_weights:
            raise ValueError(
                f"{what} needs the model's weights, which were not read here (loaded with tensor_parallel="
                f"{self.tensor_parallel}: its engine's devices read them); load it without tensor_parallel to {what}"
            )

    def logits(self, tokens) -> jax.Array:
        """One full causal forward, no cache: int32 [B, T] -> float32 [B, T, vocab]."""
        self.need_weights("model.logits")
        return _full_logits(self.graphdef, self.state, self._tokens(tokens))

    def hidden(self, tokens, kv=None) -> jax.Array:
        """``logits`` before the vocabulary projection: final-norm hidden states [B, T, E], for callers that project
        a few rows at a time (``project``) because [T, vocab] would not fit. ``kv`` (an ``ops.kv_schemes`` scheme,
        e.g. ``Kivi(4)``): each position attends as if decoded over a cache that serves K and V so (teacher-forced
        scoring of quantization: ``ops.prefill.reference.quantized_causal_attention``)."""
        if kv is not None and not (hasattr(kv, "round_trip") and hasattr(kv, "page_size")):
            raise TypeError(f"kv must be a kvjax.ops.kv_schemes scheme (Kivi, Gear, Zip), got {type(kv).__name__}")
        self.need_weights("model.hidden")
        return _hidden(self.graphdef, self.state, self._tokens(tokens), kv)

    def project(self, hidden) -> jax.Array:
        """float32 logits [..., vocab] of final-norm hidden states [..., E] (``hidden``)."""
        hidden = jnp.asarray(hidden)
        if (
            hidden.ndim == 0
            or hidden.shape[-1] != self.config.hidden_size
            or not jnp.issubdtype(hidden.dtype, jnp.floating)
        ):
            raise ValueError(
                f"hidden must be floating [..., {self.config.hidden_size}], got {hidden.dtype} {hidden.shape}"
            )
        self.need_weights("model.project")
        return _project(self.graphdef, self.state, hidden)

    def _tokens(self, tokens) -> jax.Array:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [batch, time], got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        return jnp.asarray(tokens, jnp.int32)

    def astype(self, dtype) -> Model:
        """The same model with its parameters cast to ``dtype`` (one of ``kvjax.validate.DTYPES``)."""
        dtype = jnp.dtype(validate.dtype(dtype))
        self.need_weights("model.astype")
        module = nnx.merge(self.graphdef, jax.tree.map(lambda x: x.astype(dtype), self.state))
        return Model(module, self.tokenizer, self.plan, self.source, kv_bits=self.kv_bits)

    def save(self, directory: str, *, overwrite: bool = False, hint: str = "overwrite=True") -> str:
        """Write orbax params + ``kvjax.json`` (+ ``plan.json``, tokenizer) atomically; ``kvjax.load`` reads it,
        ``kv_bits`` included (a value the engine would refuse, or any on a Palu model, is a ValueError first).

        ``overwrite`` replaces only an empty directory or a kvjax checkpoint, never the one this model was read
        from; the old one is deleted only once the new one is in place (``kvjax.io.atomic``)."""
        from kvjax.io.saved import save

        self.need_weights("model.save")
        return save(self, directory, overwrite=overwrite, hint=hint)

    def __repr__(self):
        c = self.config
        plan = "" if self.plan is None else f", {self.plan.method} rate {self.plan.rate:.3f}"
        kv = f"int{self.kv_bits}" if isinstance(self.kv_bits, int) else self.kv_bits  # a GEAR name as it is
        pages = "" if self.kv_bits is None else f", {kv} KV pages"
        return (
            f"kvjax.Model({c.arch}, {c.num_layers} layers, {c.num_heads} heads / {c.num_kv_heads} KV heads "
            f"of {c.head_dim}, vocab {c.vocab_size}, {self.dtype}{plan}{pages})"
        )
