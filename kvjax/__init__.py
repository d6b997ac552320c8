"""kvjax: LLM inference in JAX with a KV cache compressed along its hidden dimension."""

import os

# Before anything imports transformers: without it, every kvjax command's first import of transformers prints
# "PyTorch was not found..."; kvjax never needs torch. A value the user set is kept.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from kvjax.compression import RankPlan, compress
from kvjax.errors import CheckpointError
from kvjax.io.load import load
from kvjax.models.config import ModelConfig, UnsupportedModelError
from kvjax.models.model import Model
from kvjax.runtime.config import EngineConfig
from kvjax.runtime.generate import Generation, generate, generate_iter
from kvjax.runtime.pages import CacheFullError

__all__ = [
    "CacheFullError",
    "CheckpointError",
    "EngineConfig",
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
