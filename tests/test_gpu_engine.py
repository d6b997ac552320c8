"""On a GPU: the engine's default path is the Pallas kernels, and its greedy tokens match the reference path."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import varied_plan_model

import kvjax
from kvjax.models.config import ModelConfig
from kvjax.ops import attention

GEMMA3_270M = pytest.importorskip("harness").GEMMA3_270M

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
        model = varied_plan_model(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (7, 130, 300, 33)]
    with jax.default_matmul_precision("highest"):  # XLA's float32 dots default to TF32 on the GPU; the kernels' don't
        ref = kvjax.generate(model, prompts, max_new_tokens=24, backend="reference")
        ker = kvjax.generate(model, prompts, max_new_tokens=24)
    assert [r.tokens for r in ker] == [r.tokens for r in ref]


GEMMA_SHAPE = dataclasses.replace(  # Gemma 3 270M's attention: 6 of its 18 layers, a smaller vocabulary
    GEMMA3_270M, num_layers=6, layer_types=GEMMA3_270M.layer_types[:6], vocab_size=512
)


@pytest.mark.parametrize("rate", [None, 0.5])
def test_gemma_shaped_heads_on_the_kernels(rate):
    """Heads of 256 columns, one KV head, five local layers (window 512) to one global: prompts past the window,
    whose local pages go back as it passes, give the reference path's greedy tokens on the Pallas kernels, whole
    and ZACK-compressed."""
    from test_gemma3 import varied_gemma

    model = varied_gemma(GEMMA_SHAPE)
    if rate:
        model = kvjax.compress(model, target_rate=rate, calibration="random", num_tokens=1024, seq_len=512)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, n).tolist() for n in (700, 1100, 40)]
    settings = dict(max_new_tokens=24, max_seq_len=1152, chunk_tokens=512)
    with jax.default_matmul_precision("highest"):
        ref = kvjax.generate(model, prompts, backend="reference", **settings)
        ker = kvjax.generate(model, prompts, backend="pallas", **settings)
    assert [r.tokens for r in ker] == [r.tokens for r in ref]
    assert all(len(set(r.tokens)) > 3 for r in ref)  # not a degenerate model
