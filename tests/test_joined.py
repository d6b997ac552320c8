"""A model's q/k/v and gate/up projections held joined (``Transformer.join``): the same function, the same
parameters back by their separate names, the same checkpoints."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed
from flax import nnx

import kvjax
from kvjax.models.model import _full_logits
from kvjax.models.transformer import Joined, Transformer, separate_params


def separate_and_joined(cfg, seed):
    """The same random module twice: as built (separate projections) and inside a ``kvjax.Model`` (joined)."""
    separate = Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    model = kvjax.Model(Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed)))
    return separate, model


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_joined_projections_give_the_separate_ones_logits_and_parameters(arch):
    seed = fresh_seed()
    cfg = dataclasses.replace(TINY_CONFIGS[arch], attention_bias=bool(seed % 2))
    separate, model = separate_and_joined(cfg, seed % 1000)
    attn, mlp = model.module.layers[0].attn, model.module.layers[0].mlp
    assert isinstance(attn.qkv, Joined) and attn.q is None and attn.k is None and attn.v is None
    assert (mlp.gate_up is None) == (cfg.activation == "gelu"), f"{arch}: only a gated MLP joins gate and up"
    want = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(separate, nnx.Param))}
    got = separate_params(model.module)
    assert set(got) == set(want), f"seed {seed}"
    for path, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(value), err_msg=f"seed {seed}: {path}")
    tokens = np.random.default_rng(seed).integers(1, cfg.vocab_size, (2, 11))
    graphdef, state = nnx.split(separate)
    np.testing.assert_allclose(
        np.asarray(model.logits(tokens)),
        np.asarray(_full_logits(graphdef, state, jnp.asarray(tokens, jnp.int32))),
        rtol=1e-5,
        atol=1e-5,
        err_msg=f"seed {seed}",
    )
    again = kvjax.Model(model.module)  # joining twice changes nothing
    assert again.module.layers[0].attn.qkv is attn.qkv


def test_a_joined_model_saves_separate_names_and_loads_the_same(tmp_path):
    seed = fresh_seed()
    model = kvjax.Model.random(TINY_CONFIGS["mistral"], seed=seed % 1000, scale=3.0)
    path = model.save(str(tmp_path / "ckpt"))
    back = kvjax.load(path, dtype="float32")
    assert isinstance(back.module.layers[1].attn.qkv, Joined)
    tokens = np.random.default_rng(seed).integers(1, model.config.vocab_size, (1, 9))
    np.testing.assert_array_equal(np.asarray(back.logits(tokens)), np.asarray(model.logits(tokens)), f"seed {seed}")
