"""kvjax: LLM inference in JAX with a KV cache compressed along its hidden dimension."""
from kvjax.cache import CacheFullError
from kvjax.compression import RankPlan, compress
from kvjax.errors import CheckpointError
from kvjax.generate import Generation, generate
from kvjax.load import load
from kvjax.model import Model
from kvjax.models.config import ModelConfig, UnsupportedModelError

__all__ = ["CacheFullError", "CheckpointError", "Generation", "Model", "ModelConfig", "RankPlan",
           "UnsupportedModelError", "compress", "generate", "load"]
