"""The cache sized from a memory budget, and prefill calls bounded by the chunk budget rather than the batch."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_CONFIGS
from flax import nnx

import kvjax
from kvjax.compression import RankPlan
from kvjax.models.transformer import Transformer
from kvjax.runtime import memory
from kvjax.runtime.cache import bytes_per_token
from kvjax.runtime.engine import Engine, bucket, prefill_groups


def halved(config) -> kvjax.Model:
    """A rate-0.5 model of ``config``'s shape: every head keeps half its K and V columns (random weights)."""
    shape = (config.num_layers, config.num_kv_heads)
    k = v = np.full(shape, config.head_dim // 2)
    ones = np.ones((*shape, config.head_dim))
    plan = RankPlan("zack", config.head_dim, k, v, ones, ones)
    return kvjax.Model(Transformer(config, plan=plan, dtype=jnp.float32, rngs=nnx.Rngs(1)), plan=plan)


@pytest.mark.parametrize("seed", range(20))
def test_prefill_calls_hold_every_chunk_once_within_the_limit(seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 4, 16]))
    chunk_tokens = int(rng.integers(1, 300))
    limit = 2 * bucket(max(chunk_tokens, page_size))
    lengths = []
    budget = chunk_tokens
    while budget > 0 and len(lengths) < 40:  # a step's chunks share its budget
        lengths.append(int(rng.integers(1, budget + 1)))
        budget -= lengths[-1]
    calls = prefill_groups(lengths, limit, page_size)
    assert sorted(i for call in calls for i in call) == list(range(len(lengths)))
    for call in calls:
        assert bucket(len(call)) * bucket(max(lengths[i] for i in call), page_size) <= limit
    assert len(calls[0]) >= min(2, len(lengths))  # the longest chunk never runs alone when another fits beside it


def test_a_budget_buys_pages_in_proportion_to_the_bytes_a_token_takes():
    config = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=32)  # plans keep multiples of 16 columns
    full, half = kvjax.Model.random(config, seed=2), halved(config)
    settings = dict(max_batch=64, max_seq_len=256, page_size=16, backend="reference")
    reserve = Engine(full, num_pages=2, **settings).activation_bytes()  # the step's shape, not the plan, sets it
    budget = reserve + 50 * 16 * bytes_per_token(full.layouts, full.dtype) + 1000
    engines = [Engine(m, cache_memory=budget, **settings) for m in (full, half)]
    for engine, model in zip(engines, (full, half)):
        page = 16 * bytes_per_token(model.layouts, model.dtype)
        assert engine.num_pages == (budget - engine.activation_bytes()) // page
        assert engine.num_pages * page + engine.activation_bytes() <= budget
    assert bytes_per_token(half.layouts, half.dtype) * 2 == bytes_per_token(full.layouts, full.dtype)
    assert [e.num_pages for e in engines] == [50, 100]
    roomy = Engine(full, max_batch=2, max_seq_len=64, page_size=16, cache_memory=2**30, backend="reference")
    assert roomy.num_pages == 2 * 4 + 1  # never more than max_batch full sequences can use


@pytest.mark.parametrize("kind", ["gemma-like", "mistral"])
def test_window_pools_fit_the_budget_beside_the_whole_context_pool(kind):
    """Global layers beside local ones (window 24), or only windowed layers: pool 0 gets what the budget leaves
    after the window pool, which never outgrows it nor what max_batch windows use; with no global layer pool 0
    costs nothing and holds every sequence's positions."""
    config = dataclasses.replace(TINY_CONFIGS["mistral"], sliding_window=24)
    if kind == "gemma-like":
        config = dataclasses.replace(config, layer_types=("sliding_attention", "full_attention"))
    model = kvjax.Model.random(config, seed=2)
    settings = dict(max_batch=4, max_seq_len=256, page_size=8, chunk_tokens=16, backend="reference")
    span = -(-(24 - 1 + 16) // 8) + 1  # a chunk's pages and the window behind its first query
    for pages in (6, 40, 200):
        probe = Engine(model, num_pages=2, **settings)
        local = [lay for lay in model.layouts if lay.sliding_window]
        whole = [lay for lay in model.layouts if not lay.sliding_window]
        local_page, whole_page = (8 * bytes_per_token(tuple(ls), model.dtype) for ls in (local, whole))
        budget = probe.activation_bytes() + pages * (local_page + whole_page) + 100
        if whole and (pages - 1) * 8 < 256:  # a cache that cannot hold one max_seq_len sequence is refused
            with pytest.raises(memory.CacheTooSmall, match=f"holds {(pages - 1) * 8} tokens"):
                Engine(model, cache_memory=budget, **settings)
            continue
        engine = Engine(model, cache_memory=budget, **settings)
        (held,) = engine.window_pages.values()
        assert engine.windows == (None, 24) and held <= 4 * span + 1
        if whole:
            assert held <= engine.num_pages <= 4 * 32 + 1
            assert engine.num_pages * whole_page + held * local_page + engine.activation_bytes() <= budget
            assert (engine.num_pages + 1) * whole_page + held * local_page + engine.activation_bytes() > budget or (
                engine.num_pages == 4 * 32 + 1
            )
        else:
            assert engine.num_pages == 4 * 32 + 1 and held * local_page + engine.activation_bytes() <= budget
        assert engine.cache.nbytes == engine.num_pages * whole_page + held * local_page


def test_the_window_pools_bench_prints_and_writes_its_rows(tmp_path, capsys):
    """bench/window_pools.py on Gemma 3 270M's shape: at 4 GiB and 16 x 32K the window pools hold every sequence
    where one pool held 6; bad flags are usage errors."""
    from bench import window_pools

    out = tmp_path / "rows.json"
    assert window_pools.main(["--budgets", "4GiB", "--shapes", "16x32768", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["sequences"] == 16 and row["sequences_before"] == 6 and row["tokens"] > 2 * row["tokens_before"]
    assert "| 4.0 GiB | 16 x 32768 |" in capsys.readouterr().out
    bad_args = (["--budgets", "0.5"], ["--budgets", "0GiB"], ["--shapes", "16by8"], ["--chunk-tokens", "0"])
    for bad in (*bad_args, ["--dtype", "foo"], ["--json", "/proc/no/such/dir/x.json"]):
        with pytest.raises(SystemExit):
            window_pools.main(bad)


def test_bad_budgets_are_refused_with_clear_errors():
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=2)
    with pytest.raises(ValueError, match="at least 2"):
        Engine(model, max_batch=2, max_seq_len=64, cache_memory=1000, backend="reference")
    with pytest.raises(ValueError, match="not both"):
        Engine(model, max_batch=2, max_seq_len=64, cache_memory=2**20, num_pages=9, backend="reference")
    # a fraction is of the memory free now, on a CPU too: the host's (kvjax.machine)
    engine = Engine(model, max_batch=2, max_seq_len=64, cache_memory=0.5, backend="reference")
    assert "0.5 of the" in engine.budget_note and engine.num_pages == 2 * 4 + 1
    for bad in (0, -5, 1.5, 0.0, True, "1GiB", float("nan")):
        with pytest.raises((TypeError, ValueError), match="cache_memory"):
            kvjax.generate(model, [[1, 2]], max_new_tokens=1, cache_memory=bad)


def test_a_budget_smaller_than_the_batch_preempts_and_keeps_every_greedy_token():
    """Room for about two of six sequences: requests wait or are preempted and recomputed, and every prompt still
    gets exactly the tokens it gets with room for all."""
    model = kvjax.Model.random(TINY_CONFIGS["llama"], seed=4, scale=10.0)  # no window: every page stays held
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in rng.integers(5, 40, 6)]
    want = [g.tokens for g in kvjax.generate(model, prompts, max_new_tokens=12, max_batch=6)]
    engine = Engine(model, max_batch=6, max_seq_len=64, page_size=4, backend="reference")
    page = 4 * bytes_per_token(model.layouts, model.dtype)
    budget = engine.activation_bytes() + 33 * page  # 32 usable pages: two 64-token sequences
    stats: dict = {}
    got = kvjax.generate(
        model, prompts, max_new_tokens=12, max_batch=6, max_seq_len=64, page_size=4, cache_memory=budget, stats=stats
    )
    assert [g.tokens for g in got] == want
    assert stats["preemptions"] > 0
    assert model._engines and next(iter(model._engines.values())).num_pages == 33
