"""One config object for every supported architecture, built from a checkpoint's Hugging Face config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "falcon", "gemma3")
# Hugging Face model_type -> arch; Gemma 3 is read from its text-only checkpoints (Gemma3ForCausalLM)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "falcon": "falcon", "gemma3_text": "gemma3"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
LAYER_TYPES = ("sliding_attention", "full_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model kvjax does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "falcon" | "gemma3"
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
    sliding_window: int | None = None  # every layer's window, or only the sliding layers' with layer_types
    attention_bias: bool = False  # bias on q/k/v/o projections
    mlp_bias: bool = False
    # Falcon: LayerNorm + GELU MLP; "parallel" adds attention and MLP to one residual; two norms when new-decoder.
    parallel_block: bool = False
    parallel_norms: int = 1
    new_decoder_architecture: bool = False  # Falcon's fused qkv interleaves [group q heads, k, v] per KV head
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3: local layers ("sliding_attention": sliding_window, RoPE base rope_local_theta, no scaling) between
    # global ones ("full_attention": rope_theta and rope_scaling).
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # Gemma 3's scores are q.k * query_pre_attn_scalar ** -0.5; the loaders fold sqrt(head_dim / it) into the q
    # norm's weight, so attention keeps 1/sqrt(head_dim) (None: head_dim, nothing to fold).
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_layers} layers, "
                f"got {self.layer_types!r}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def norm(self) -> str:
        """The norm: LayerNorm ("layer"), weight times the RMS-normalised x ("rms"), or Gemma's ("gemma")."""
        return {"falcon": "layer", "gemma3": "gemma"}.get(self.arch, "rms")

    @property
    def activation(self) -> str:
        """The MLP's nonlinearity: "gelu" (exact, ungated: Falcon), "gelu_tanh" (gated: Gemma) or "silu" (gated)."""
        return {"falcon": "gelu", "gemma3": "gelu_tanh"}.get(self.arch, "silu")

    @property
    def gemma_norms(self) -> bool:
        """Gemma's block: q/k norms before RoPE and a norm after attention and after the MLP as well as before."""
        return self.arch == "gemma3"

    @property
    def embed_scale(self) -> float | None:
        """The factor embeddings are multiplied by before the first layer (Gemma: sqrt(hidden_size))."""
        return math.sqrt(self.hidden_size) if self.arch == "gemma3" else None

    @property
    def rope(self) -> dict:
        return {"rope_type": "default", **dict(self.rope_scaling or ())}

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, dict]:
        """(base, scaling) of layer ``layer``'s RoPE."""
        local = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        if local and self.rope_local_theta is not None:
            return self.rope_local_theta, {"rope_type": "default"}
        return self.rope_theta, self.rope

    def param_count(self) -> int:
        """About how many parameters the model has (its projections, MLPs and embeddings; norms and biases, a
        fraction of a percent, left out): enough to size memory before loading it."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (2 if self.activation == "gelu" else 3) * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"])
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


def _rope_from(params: dict, theta: float) -> tuple[float, tuple | None]:
    """(theta, scaling) from one set of rope parameters; ``theta`` where they name none."""
    params = dict(params)
    theta = float(params.pop("rope_theta", theta) or theta)
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if rope_type == "default":
        return theta, None
    keep = {k: v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return theta, tuple(sorted({"rope_type": rope_type, **keep}.items()))


def _rope_settings(hf) -> tuple[float, tuple | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = getattr(hf, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    return _rope_from(params, getattr(hf, "rope_theta", 10000.0) or 10000.0)


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def config_from_hf(hf) -> ModelConfig:
    """Map a ``transformers`` PretrainedConfig onto a ModelConfig, or raise UnsupportedModelError."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; kvjax supports {', '.join(MODEL_TYPES)}"
        )
    arch = MODEL_TYPES[model_type]
    common = dict(
        arch=arch,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        hidden_size=hf.hidden_size,
        vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
    )
    if arch == "gemma3":
        return _gemma3_config(hf, common)
    theta, scaling = _rope_settings(hf)
    common.update(rope_theta=theta, rope_scaling=scaling)
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
    return _falcon_config(hf, common)


def _falcon_config(hf, common: dict) -> ModelConfig:
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


def _gemma3_config(hf, common: dict) -> ModelConfig:
    """Gemma 3's text model (``Gemma3TextConfig``); what kvjax does not implement is refused by name."""
    refused = {
        "final_logit_softcapping": getattr(hf, "final_logit_softcapping", None),
        "attn_logit_softcapping": getattr(hf, "attn_logit_softcapping", None),
    }
    for name, value in refused.items():
        if value is not None:
            raise UnsupportedModelError(f"Gemma 3 with {name}={value} is not supported (kvjax applies no softcapping)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is not supported (causal only)")
    act = getattr(hf, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    theta, scaling = _rope_from(rope.get("full_attention") or {}, 1_000_000.0)
    local_theta, local_scaling = _rope_from(rope.get("sliding_attention") or {}, 10_000.0)
    if local_scaling is not None:
        raise UnsupportedModelError(f"Gemma 3 local layers with rope scaling {dict(local_scaling)} are not supported")
    return ModelConfig(
        **common,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        intermediate_size=hf.intermediate_size,
        norm_eps=hf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        sliding_window=hf.sliding_window,
        layer_types=tuple(hf.layer_types),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
    )
