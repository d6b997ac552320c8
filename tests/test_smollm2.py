"""The embedded SmolLM2 GGUF model against transformers' own GGUF loading (tests/fixtures/smollm2_reference.npz)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

import kvjax

REF = np.load(os.path.join(FIXTURES, "smollm2_reference.npz"))


@pytest.fixture(scope="module")
def smollm2():
    return kvjax.load("smollm2", dtype="float32", progress=False)


def test_config(smollm2):
    c = smollm2.config
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        "llama",
        30,
        9,
        3,
        64,
        49152,
    )
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_logits_match_transformers_gguf(smollm2):
    logits = np.asarray(smollm2.logits(REF["tokens"]))[0]
    np.testing.assert_allclose(logits[:, REF["logits_ids"]], REF["logits"], atol=1e-3, rtol=0)
    lse = np.asarray(jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1))) + logits.max(-1)
    np.testing.assert_allclose(lse, REF["logsumexp"], atol=1e-3, rtol=0)
    np.testing.assert_array_equal(logits.argmax(-1), REF["argmax"])


def test_tokenizer_matches_transformers_gguf(smollm2):
    for i, text in enumerate(REF["texts"]):
        ids = smollm2.tokenizer(str(text), add_special_tokens=False)["input_ids"]
        assert ids == REF[f"text_ids_{i}"].tolist(), text
        assert smollm2.tokenizer.decode(ids) == str(text)


def test_greedy_generation_is_fluent_and_matches_transformers(smollm2):
    prompt = REF["greedy_prompt_ids"].tolist()
    (result,) = kvjax.generate(smollm2, [prompt], max_new_tokens=24)
    assert result.finish_reason == "stop"  # <|im_end|>
    assert result.tokens == REF["greedy_ids"].tolist()[: len(result.tokens)]
    assert result.text == "The capital of France is Paris."


def test_kernels_give_the_reference_greedy_tokens(smollm2):
    """The Pallas kernels (interpreted on the CPU) decode SmolLM2 exactly like the jnp reference, compressed too."""
    small = kvjax.compress(smollm2, target_rate=0.25, calibration="text", num_tokens=1024, seq_len=256, progress=False)
    prompts = ["What is the capital of France?", "Name a prime number."]
    for model in (smollm2, small):
        ref = kvjax.generate(model, prompts, max_new_tokens=8, chat=True, backend="reference")
        ker = kvjax.generate(model, prompts, max_new_tokens=8, chat=True, backend="interpret")
        assert [r.tokens for r in ker] == [r.tokens for r in ref]
