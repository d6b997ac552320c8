"""Hugging Face checkpoint -> Transformer parameters: one name table per architecture, read tensor by tensor.

Each parameter is read, transformed and cast on its own, so peak host memory stays near one tensor rather than
the whole checkpoint.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.errors import CheckpointError
from kvjax.io.messages import one_line, read_json, some
from kvjax.models.config import ModelConfig
from kvjax.models.transformer import Transformer

Path = tuple  # a parameter's nnx path, e.g. ("layers", 0, "attn", "q", "kernel")
Source = tuple[str, Callable[[np.ndarray], np.ndarray]]  # (checkpoint tensor name, transform)


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")  # model.layers.N., transformer.h.N., blk.N.


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the config needs is not in the checkpoint; a ``KeyError`` too, as a failed lookup by name."""

    __str__ = Exception.__str__


def as_is(x):
    return x


def transposed(x):
    return x.T


def _falcon_qkv_part(cfg: ModelConfig, part: int, transpose: bool):
    """Pick q (0), k (1) or v (2) rows out of Falcon's fused ``query_key_value`` tensor."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def pick(x):
        rest = x.shape[1:]
        if cfg.new_decoder_architecture:  # new decoder: [kv, group q heads + k + v, d]
            g = h // kv
            x = x.reshape(kv, g + 2, d, *rest)
            x = (x[:, :g], x[:, g : g + 1], x[:, g + 1 :])[part]
        elif kv == 1:  # multi-query (Falcon-7B): [h q heads, k, v]
            x = x.reshape(h + 2, d, *rest)
            x = (x[:h], x[h : h + 1], x[h + 1 :])[part]
        else:  # one k and v per head: [h, (q, k, v), d]
            x = x.reshape(h, 3, d, *rest)[:, part]
        x = x.reshape(-1, *rest)
        return x.T if transpose else x

    return pick


def hf_sources(cfg: ModelConfig) -> dict[Path, Source]:
    """Where every parameter of ``Transformer(cfg)`` comes from in a Hugging Face checkpoint."""
    if cfg.arch == "gemma3":
        src = _gemma3_sources(cfg)
    elif cfg.arch in ("llama", "mistral"):
        src = _llama_sources(cfg)
    else:
        src = _falcon_sources(cfg)
    if not cfg.tie_word_embeddings:
        src[("lm_head", "kernel")] = ("lm_head.weight", transposed)
    return src


def _linear(bias: bool) -> list[tuple[str, str, Callable]]:
    """(our leaf, HF suffix, transform) of a linear layer's weight, and of its bias if it has one."""
    return [("kernel", "weight", transposed)] + ([("bias", "bias", as_is)] if bias else [])


def _llama_sources(cfg: ModelConfig) -> dict[Path, Source]:
    """``hf_sources`` of the Llama family (Llama, Mistral)."""
    lin, mlp_lin = _linear(cfg.attention_bias), _linear(cfg.mlp_bias)
    src: dict[Path, Source] = {
        ("embed",): ("model.embed_tokens.weight", as_is),
        ("final_norm", "scale"): ("model.norm.weight", as_is),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        src[("layers", i, "attn_norm", "scale")] = (f"{p}.input_layernorm.weight", as_is)
        src[("layers", i, "mlp_norm", "scale")] = (f"{p}.post_attention_layernorm.weight", as_is)
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            for leaf, suffix, fn in lin:
                src[("layers", i, "attn", ours, leaf)] = (f"{p}.self_attn.{theirs}.{suffix}", fn)
        for ours in ("gate", "up", "down"):
            for leaf, suffix, fn in mlp_lin:
                src[("layers", i, "mlp", ours, leaf)] = (f"{p}.mlp.{ours}_proj.{suffix}", fn)
    return src


def q_norm_weight(cfg: ModelConfig, offset: float = 0.0) -> Callable[[np.ndarray], np.ndarray]:
    """Gemma's q norm weight ``w`` (stored as ``w + offset``) with the attention scale folded in: ``1 + w`` times
    ``sqrt(head_dim / query_pre_attn_scalar)``, so attention's ``1/sqrt(head_dim)`` gives the model's scale."""
    c = math.sqrt(cfg.head_dim / (cfg.query_pre_attn_scalar or cfg.head_dim))

    def fold(x):
        return c * (x - offset) + (c - 1)  # = c * (1 + w) - 1, and exactly w when c == 1

    return fold


def _gemma3_sources(cfg: ModelConfig) -> dict[Path, Source]:
    """``hf_sources`` of Gemma 3's text model (``Gemma3ForCausalLM``)."""
    lin = _linear(cfg.attention_bias)
    src: dict[Path, Source] = {
        ("embed",): ("model.embed_tokens.weight", as_is),
        ("final_norm", "scale"): ("model.norm.weight", as_is),
    }
    norms = {
        "attn_norm": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for ours, theirs in norms.items():
            src[("layers", i, ours, "scale")] = (f"{p}.{theirs}.weight", as_is)
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            for leaf, suffix, fn in lin:
                src[("layers", i, "attn", ours, leaf)] = (f"{p}.self_attn.{theirs}.{suffix}", fn)
        src[("layers", i, "attn", "q_norm", "scale")] = (f"{p}.self_attn.q_norm.weight", q_norm_weight(cfg))
        src[("layers", i, "attn", "k_norm", "scale")] = (f"{p}.self_attn.k_norm.weight", as_is)
        for ours in ("gate", "up", "down"):
            src[("layers", i, "mlp", ours, "kernel")] = (f"{p}.mlp.{ours}_proj.weight", transposed)
    return src


def _falcon_sources(cfg: ModelConfig) -> dict[Path, Source]:
    """``hf_sources`` of Falcon (7B-style and the new decoder architecture)."""
    lin, mlp_lin = _linear(cfg.attention_bias), _linear(cfg.mlp_bias)
    src: dict[Path, Source] = {
        ("embed",): ("transformer.word_embeddings.weight", as_is),
        ("final_norm", "scale"): ("transformer.ln_f.weight", as_is),
        ("final_norm", "bias"): ("transformer.ln_f.bias", as_is),
    }
    if not cfg.parallel_block:
        norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    elif cfg.parallel_norms == 2:
        norms = {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"}
    else:
        norms = {"attn_norm": "input_layernorm"}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}"
        for ours, theirs in norms.items():
            src[("layers", i, ours, "scale")] = (f"{p}.{theirs}.weight", as_is)
            src[("layers", i, ours, "bias")] = (f"{p}.{theirs}.bias", as_is)
        for part, ours in enumerate("qkv"):
            for leaf, suffix, fn in lin:
                pick = _falcon_qkv_part(cfg, part, transpose=fn is transposed)
                src[("layers", i, "attn", ours, leaf)] = (f"{p}.self_attention.query_key_value.{suffix}", pick)
        for leaf, suffix, fn in lin:
            src[("layers", i, "attn", "o", leaf)] = (f"{p}.self_attention.dense.{suffix}", fn)
        for ours, theirs in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
            for leaf, suffix, fn in mlp_lin:
                src[("layers", i, "mlp", ours, leaf)] = (f"{p}.mlp.{theirs}.{suffix}", fn)
    return src


class SafetensorsReader:
    """Reads single tensors, as float32, from the ``*.safetensors`` files of a Hugging Face directory.

    Every file's header is checked when the reader is made: a corrupt or truncated file fails here, named."""

    layers_key = "config.json's num_hidden_layers"

    def __init__(self, directory: str):
        self.path = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: has no weight_map object")
            for fname in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(directory, fname)):
                    raise CheckpointError(f"{index}: names the file {fname!r}, which is not in {directory}")
                held = set(self._keys(fname))
                absent = sorted(k for k, v in weight_map.items() if v == fname and k not in held)
                if absent:
                    raise MissingTensorError(
                        f"{os.path.join(directory, fname)}: has no tensor {some(absent)}, which {index} places in it"
                    )
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {directory}")
            weight_map = {k: fname for fname in files for k in self._keys(fname)}
        self.weight_map = weight_map

    def _keys(self, fname: str) -> list[str]:
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self.path, fname)
        try:
            with safe_open(path, framework="numpy") as f:
                return list(f.keys())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file: {one_line(e)}") from None

    def file_of(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map[name]) if name in self.weight_map else self.path

    def __iter__(self):
        return iter(self.weight_map)

    def __contains__(self, name):
        return name in self.weight_map

    def __call__(self, name: str) -> np.ndarray:
        from safetensors import SafetensorError, safe_open

        if name not in self.weight_map:
            raise MissingTensorError(f"{self.path}: checkpoint has no tensor {name!r}")
        try:
            with safe_open(self.file_of(name), framework="flax") as f:
                x = f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{self.file_of(name)}: cannot read tensor {name!r}: {one_line(e)}") from None
        return np.asarray(x.astype(jnp.float32))


def _check_layers(read, num_layers: int) -> None:
    """No tensor of the checkpoint may belong to a layer past the config's ``num_layers``."""
    layer_of = {n: int(m.group(1)) for n in read if (m := _LAYER.search(n))}
    extra = sorted((n for n, layer in layer_of.items() if layer >= num_layers), key=lambda n: (layer_of[n], n))
    if extra:
        raise CheckpointError(
            f"{read.file_of(extra[0])}: {read.layers_key} is {num_layers}, but the checkpoint "
            f"holds tensors of more layers: {some(extra)}"
        )


def _source_shape(transform, want: tuple) -> str:
    """The checkpoint tensor shape the config implies, where the transform's inverse is known."""
    if transform is as_is:
        return str(want)
    if transform is transposed:
        return str(want[::-1])
    return f"{want} after conversion"


def fill_params(model: Transformer, sources: dict[Path, Source], read, dtype, progress=None) -> None:
    """Set every parameter of an abstract (``nnx.eval_shape``) model from the checkpoint, one tensor at a time.

    ``read(name)`` gives a tensor as float32; ``read`` also has ``path``, ``layers_key``, ``file_of(name)`` and
    iterates over its tensor names. Missing tensors, tensors of extra layers, shapes that do not fit the config and
    NaN/inf values are a ``CheckpointError`` naming the file and the tensor."""
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    missing = set(params) - set(sources)
    if missing:
        raise ValueError(f"no checkpoint source for parameters {sorted(map(str, missing))[:5]}")
    absent = sorted({name for name, _ in sources.values() if name not in read})
    if absent:
        raise MissingTensorError(f"{read.path}: checkpoint lacks tensors the config needs: {some(absent)}")
    _check_layers(read, model.config.num_layers)
    dtype = jnp.dtype(dtype)
    limit = float(jnp.finfo(dtype).max)
    for path in sorted(params, key=str):
        name, transform = sources[path]
        raw = read(name)
        where = f"{read.file_of(name)}: tensor {name!r}"
        finite = np.isfinite(raw)
        if not finite.all():
            raise CheckpointError(f"{where} holds {raw.size - int(finite.sum())} NaN or infinite values")
        want = tuple(params[path].get_value().shape)
        try:
            value = transform(raw)
        except ValueError:
            value = None
        if value is None or tuple(value.shape) != want:
            raise CheckpointError(
                f"{where} has shape {tuple(raw.shape)}, the config needs {_source_shape(transform, want)}"
            )
        if raw.size and limit < np.finfo(np.float32).max and np.abs(raw).max() > limit:
            raise CheckpointError(
                f"{where} has values up to {np.abs(raw).max():.4g}, beyond {dtype.name}'s range; "
                "load it as bfloat16 or float32"
            )
        params[path].set_value(jnp.asarray(value, dtype))
        if progress is not None:
            progress.update(1)
