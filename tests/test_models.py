"""Parity with transformers: tiny random checkpoints saved by tests/make_fixtures.py, float32, 1e-4 absolute."""

import os

import jax
import numpy as np
import pytest
from conftest import FIXTURES

import kvjax

CASES = ["llama", "llama3_rope", "mistral", "falcon_7b", "falcon_new"]


@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_transformers(case):
    ref = np.load(os.path.join(FIXTURES, case, "reference.npz"))
    model = kvjax.load(os.path.join(FIXTURES, case), dtype="float32", progress=False)
    logprobs = jax.nn.log_softmax(model.logits(ref["tokens"]), axis=-1)
    np.testing.assert_allclose(np.asarray(logprobs), ref["logprobs"], atol=1e-4, rtol=0)


def test_config_fields():
    model = kvjax.load(os.path.join(FIXTURES, "falcon_7b"), dtype="float32", progress=False)
    c = model.config
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("falcon", 2, 4, 1, 16)
    assert c.vocab_size == 128 and model.tokenizer is None
    mistral = kvjax.load(os.path.join(FIXTURES, "mistral"), dtype="float32", progress=False).config
    assert mistral.arch == "mistral" and mistral.sliding_window == 5 and mistral.num_kv_heads == 2
    llama3 = kvjax.load(os.path.join(FIXTURES, "llama3_rope"), dtype="float32", progress=False).config
    assert llama3.rope["rope_type"] == "llama3" and llama3.rope_theta == 5e5 and llama3.tie_word_embeddings


def test_old_style_rope_keys_are_accepted(tmp_path):
    """config.json written with the pre-v5 ``rope_theta``/``rope_scaling`` keys loads to the same model."""
    import json
    import shutil

    src = os.path.join(FIXTURES, "llama3_rope")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    ref = np.load(os.path.join(src, "reference.npz"))
    model = kvjax.load(str(tmp_path), dtype="float32", progress=False)
    logprobs = jax.nn.log_softmax(model.logits(ref["tokens"]), axis=-1)
    np.testing.assert_allclose(np.asarray(logprobs), ref["logprobs"], atol=1e-4, rtol=0)


def test_bfloat16_is_close_to_float32():
    ref = np.load(os.path.join(FIXTURES, "llama", "reference.npz"))
    model = kvjax.load(os.path.join(FIXTURES, "llama"), dtype="bfloat16", progress=False)
    assert model.dtype == np.dtype("bfloat16")
    logprobs = jax.nn.log_softmax(model.logits(ref["tokens"]), axis=-1)
    assert np.abs(np.asarray(logprobs) - ref["logprobs"]).max() < 0.15
