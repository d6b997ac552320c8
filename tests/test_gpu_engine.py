"""On a GPU: the engine's default path is the Pallas kernels, and its greedy tokens match the reference path."""

import dataclasses

import jax
import numpy as np
import pytest
from test_engine_kernels import _varied_plan_model

import kvjax
from kvjax.models.config import ModelConfig
from kvjax.ops import attention

pytestmark = pytest.mark.gpu

SHAPE = ModelConfig(
    arch="llama",
    num_layers=2,
    num_heads=16,
    num_kv_heads=2,
    head_dim=64,
    hidden_size=512,
    intermediate_size=1024,
    vocab_size=512,
    norm_eps=1e-5,
    max_position_embeddings=4096,
)


def test_default_backend_is_pallas_on_gpu():
    assert jax.default_backend() == "gpu" and attention.default_backend() == "pallas"


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("compressed", [False, True])
def test_pallas_engine_matches_reference(compressed, window):
    cfg = dataclasses.replace(SHAPE, arch="mistral" if window else "llama", sliding_window=window)
    model = kvjax.Model.random(cfg, dtype="float32", seed=3, scale=4.0)
    if compressed:
        model = _varied_plan_model(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (7, 130, 300, 33)]
    with jax.default_matmul_precision("highest"):  # XLA's float32 dots default to TF32 on the GPU; the kernels' don't
        ref = kvjax.generate(model, prompts, max_new_tokens=24, backend="reference")
        ker = kvjax.generate(model, prompts, max_new_tokens=24)
    assert [r.tokens for r in ker] == [r.tokens for r in ref]
