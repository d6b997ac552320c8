"""Hugging Face checkpoint -> Transformer parameters: one name table per architecture, read tensor by tensor.

Each parameter is read, transformed and cast on its own, so peak host memory stays near one tensor rather than
the whole checkpoint.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.models.config import ModelConfig

Path = tuple  # a parameter's nnx path, e.g. ("layers", 0, "attn", "q", "kernel")
Source = tuple[str, Callable[[np.ndarray], np.ndarray]]  # (checkpoint tensor name, transform)


def _same(x):
    return x


def _transpose(x):
    return x.T


def _falcon_qkv_part(cfg: ModelConfig, part: int, transpose: bool):
    """Pick q (0), k (1) or v (2) rows out of Falcon's fused ``query_key_value`` tensor."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def pick(x):
        rest = x.shape[1:]
        if cfg.new_decoder_architecture:  # new decoder: [kv, group q heads + k + v, d]
            g = h // kv
            x = x.reshape(kv, g + 2, d, *rest)
            x = (x[:, :g], x[:, g:g + 1], x[:, g + 1:])[part]
        elif kv == 1:  # multi-query (Falcon-7B): [h q heads, k, v]
            x = x.reshape(h + 2, d, *rest)
            x = (x[:h], x[h:h + 1], x[h + 1:])[part]
        else:  # one k and v per head: [h, (q, k, v), d]
            x = x.reshape(h, 3, d, *rest)[:, part]
        x = x.reshape(-1, *rest)
        return x.T if transpose else x

    return pick


def hf_sources(cfg: ModelConfig) -> dict[Path, Source]:
    """Where every parameter of ``Transformer(cfg)`` comes from in a Hugging Face checkpoint."""
    src: dict[Path, Source] = {}
    lin = [("kernel", "weight", _transpose)] + ([("bias", "bias", _same)] if cfg.attention_bias else [])
    mlp_lin = [("kernel", "weight", _transpose)] + ([("bias", "bias", _same)] if cfg.mlp_bias else [])
    if cfg.arch in ("llama", "mistral"):
        src[("embed",)] = ("model.embed_tokens.weight", _same)
        src[("final_norm", "scale")] = ("model.norm.weight", _same)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            src[("layers", i, "attn_norm", "scale")] = (f"{p}.input_layernorm.weight", _same)
            src[("layers", i, "mlp_norm", "scale")] = (f"{p}.post_attention_layernorm.weight", _same)
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
                for leaf, suffix, fn in lin:
                    src[("layers", i, "attn", ours, leaf)] = (f"{p}.self_attn.{theirs}.{suffix}", fn)
            for ours in ("gate", "up", "down"):
                for leaf, suffix, fn in mlp_lin:
                    src[("layers", i, "mlp", ours, leaf)] = (f"{p}.mlp.{ours}_proj.{suffix}", fn)
    else:  # falcon
        src[("embed",)] = ("transformer.word_embeddings.weight", _same)
        src[("final_norm", "scale")] = ("transformer.ln_f.weight", _same)
        src[("final_norm", "bias")] = ("transformer.ln_f.bias", _same)
        if not cfg.parallel_block:
            norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
        elif cfg.parallel_norms == 2:
            norms = {"attn_norm": "ln_attn", "mlp_norm": "ln_mlp"}
        else:
            norms = {"attn_norm": "input_layernorm"}
        for i in range(cfg.num_layers):
            p = f"transformer.h.{i}"
            for ours, theirs in norms.items():
                src[("layers", i, ours, "scale")] = (f"{p}.{theirs}.weight", _same)
                src[("layers", i, ours, "bias")] = (f"{p}.{theirs}.bias", _same)
            for part, ours in enumerate("qkv"):
                for leaf, suffix, fn in lin:
                    pick = _falcon_qkv_part(cfg, part, transpose=fn is _transpose)
                    src[("layers", i, "attn", ours, leaf)] = (f"{p}.self_attention.query_key_value.{suffix}", pick)
            for leaf, suffix, fn in lin:
                src[("layers", i, "attn", "o", leaf)] = (f"{p}.self_attention.dense.{suffix}", fn)
            for ours, theirs in (("up", "dense_h_to_4h"), ("down", "dense_4h_to_h")):
                for leaf, suffix, fn in mlp_lin:
                    src[("layers", i, "mlp", ours, leaf)] = (f"{p}.mlp.{theirs}.{suffix}", fn)
    if not cfg.tie_word_embeddings:
        src[("lm_head", "kernel")] = ("lm_head.weight", _transpose)
    return src


class SafetensorsReader:
    """Reads single tensors from one or many ``*.safetensors`` files of a Hugging Face directory."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {directory}")
            weight_map = {}
            for fname in files:
                with safe_open(os.path.join(directory, fname), framework="numpy") as f:
                    weight_map.update({k: fname for k in f.keys()})
        self._open = lambda fname: safe_open(os.path.join(directory, fname), framework="flax")
        self.weight_map = weight_map

    def __contains__(self, name):
        return name in self.weight_map

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        with self._open(self.weight_map[name]) as f:
            x = f.get_tensor(name)
        return np.asarray(x.astype(jnp.float32))


def fill_params(model: nnx.Module, sources: dict[Path, Source], read: Callable[[str], np.ndarray],
                dtype, progress=None) -> None:
    """Set every parameter of an abstract (``nnx.eval_shape``) model from the checkpoint, one tensor at a time."""
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    missing = set(params) - set(sources)
    if missing:
        raise ValueError(f"no checkpoint source for parameters {sorted(map(str, missing))[:5]}")
    for path in sorted(params, key=str):
        name, transform = sources[path]
        value = transform(read(name))
        want = params[path].get_value().shape
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {value.shape} after conversion, expected {want}")
        params[path].set_value(jnp.asarray(value, dtype))
        if progress is not None:
            progress.update(1)
