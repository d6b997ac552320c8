"""Automatic prefix caching on the engine (``EngineConfig.prefix_caching``, ``kvjax.runtime.prefix``): requests
over shared documents read the first request's cached pages and give exactly the tokens of a cold run (greedy,
float32), plain and ZACK-compressed, on the jnp reference and on the kernels interpreted; owners' counts return to
zero; the caches that cannot share refuse it in one line, and by default it is on only where they can. The
scheduler's fuzz with sharing: tests/test_request_scheduler.py."""

import dataclasses

import numpy as np
import pytest
from conftest import TINY_CONFIGS, fresh_seed, varied_plan_model

import kvjax
from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request

LLAMA = dataclasses.replace(TINY_CONFIGS["llama"], num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=128)


def served(model, prompts, new, **settings):
    """Every prompt's greedy tokens, run one after another on one engine (so later ones can hit), and its pages."""
    engine = Engine(model, max_batch=2, max_seq_len=128, page_size=8, chunk_tokens=32, **settings)
    runner = Runner(engine)
    requests = [runner.add(Request(p, new)) for p in prompts]
    for _ in runner.run():
        runner.scheduler.check()
    return [r.tokens for r in requests], runner.scheduler.pages


@pytest.mark.parametrize("which, backend", [("plain", "reference"), ("zack", "reference"), ("zack", "interpret")])
def test_hits_give_the_tokens_of_a_cold_run(which, backend):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = kvjax.Model.random(LLAMA, seed=seed % 1000, scale=2.0)
    if which == "zack":
        model = varied_plan_model(model)
    documents = [rng.integers(0, LLAMA.vocab_size, 45).tolist() for _ in range(2)]
    prompts = [documents[i % 2] + rng.integers(0, LLAMA.vocab_size, 3 + i).tolist() for i in range(5)]
    prompts.append(list(documents[0]))  # a prompt that is a document: its last page is computed, not read
    cold, off = served(model, prompts, 6, backend=backend, prefix_caching=False)
    warm, pages = served(model, prompts, 6, backend=backend)
    assert warm == cold, f"seed {seed}"
    stats = pages.stats()
    assert stats["prefix_hit_tokens"] >= 4 * 40, stats  # five pages of a document, after each document's first
    assert pages.prefix.idle_pages == stats["prefix_cached_pages"], "a cached page kept an owner"
    assert stats["free_pages"] == off.stats()["free_pages"], "pages leaked"
    assert "prefix_hit_tokens" not in off.stats()


@pytest.mark.parametrize(
    "settings, why",
    [
        (dict(kv_bits=4), "kv_bits=4"),
        (dict(batch_invariant=True), "batch_invariant"),
        (dict(eviction="snapkv:16"), "eviction"),
    ],
)
def test_caches_that_cannot_share_refuse_it_and_default_to_off(settings, why):
    model = kvjax.Model.random(LLAMA, seed=1)
    with pytest.raises(ValueError) as e:
        Engine(model, max_batch=2, max_seq_len=64, prefix_caching=True, **settings)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert not Engine(model, max_batch=2, max_seq_len=64, **settings).prefix_caching
    assert Engine(model, max_batch=2, max_seq_len=64).prefix_caching


def test_sliding_window_models_do_not_share():
    model = kvjax.Model.random(TINY_CONFIGS["mistral"], seed=1)
    assert not Engine(model, max_batch=2, max_seq_len=64).prefix_caching
    with pytest.raises(ValueError, match="sliding-window layers"):
        Engine(model, max_batch=2, max_seq_len=64, prefix_caching=True)
    with pytest.raises(TypeError, match="prefix_caching must be True or False"):
        Engine(model, max_batch=2, max_seq_len=64, prefix_caching="yes")
