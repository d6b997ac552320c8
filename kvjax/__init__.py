"""kvjax: LLM inference in JAX with a KV cache compressed along its hidden dimension."""

from kvjax.compression import RankPlan, compress
from kvjax.errors import CheckpointError
from kvjax.io.load import load
from kvjax.models.config import ModelConfig, UnsupportedModelError
from kvjax.models.model import Model
from kvjax.runtime.cache import CacheFullError
from kvjax.runtime.generate import Generation, generate, generate_iter

__all__ = [
    "CacheFullError",
    "CheckpointError",
    "Generation",
    "Model",
    "ModelConfig",
    "RankPlan",
    "UnsupportedModelError",
    "compress",
    "generate",
    "generate_iter",
    "load",
]
