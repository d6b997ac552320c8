"""One config object for every supported architecture, built from a checkpoint's Hugging Face config."""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "falcon")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model kvjax does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "falcon"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted (key, value) pairs, hashable
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False  # bias on q/k/v/o projections
    mlp_bias: bool = False
    # Falcon: LayerNorm + GELU MLP; "parallel" adds attention and MLP to one residual; two norms when new-decoder.
    parallel_block: bool = False
    parallel_norms: int = 1
    new_decoder_architecture: bool = False  # Falcon's fused qkv interleaves [group q heads, k, v] per KV head
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def norm(self) -> str:
        return "layer" if self.arch == "falcon" else "rms"

    @property
    def rope(self) -> dict:
        return {"rope_type": "default", **dict(self.rope_scaling or ())}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


def _rope_settings(hf) -> tuple[float, tuple | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0) or 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if rope_type == "default":
        return theta, None
    keep = {k: v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return theta, tuple(sorted({"rope_type": rope_type, **keep}.items()))


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf) -> ModelConfig:
    """Map a ``transformers`` PretrainedConfig onto a ModelConfig, or raise UnsupportedModelError."""
    arch = getattr(hf, "model_type", None)
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"model_type {arch!r} is not supported; kvjax supports {', '.join(SUPPORTED_ARCHS)}"
        )
    theta, scaling = _rope_settings(hf)
    common = dict(
        arch=arch,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
    )
    if arch in ("llama", "mistral"):
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            **common,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            norm_eps=hf.rms_norm_eps,
            sliding_window=getattr(hf, "sliding_window", None) if arch == "mistral" else None,
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        )
    # Falcon
    if hf.alibi:
        raise UnsupportedModelError("Falcon with ALiBi positions is not supported; only rotary Falcon models are")
    if getattr(hf, "activation", "gelu") != "gelu":
        raise UnsupportedModelError(f"Falcon activation {hf.activation!r} is not supported (only gelu)")
    if hf.new_decoder_architecture:
        if not hf.parallel_attn:
            raise UnsupportedModelError("Falcon new_decoder_architecture without parallel_attn is not supported")
        num_kv, norms = hf.num_kv_heads, hf.num_ln_in_parallel_attn or 2
    else:
        num_kv, norms = (1 if hf.multi_query else hf.num_attention_heads), 1
    return ModelConfig(
        **common,
        num_kv_heads=num_kv,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        intermediate_size=getattr(hf, "ffn_hidden_size", None) or 4 * hf.hidden_size,
        norm_eps=hf.layer_norm_epsilon,
        attention_bias=bool(hf.bias),
        mlp_bias=bool(hf.bias),
        parallel_block=bool(hf.parallel_attn or hf.new_decoder_architecture),
        parallel_norms=norms,
        new_decoder_architecture=bool(hf.new_decoder_architecture),
    )
