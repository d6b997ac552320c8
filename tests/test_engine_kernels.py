"""The engine on the Pallas kernels (interpreted on the CPU) gives the reference path's greedy tokens."""

import dataclasses

import numpy as np
import pytest
from conftest import TINY_CONFIGS, varied_plan_model

import kvjax
from kvjax.ops.decode.config import DECODE
from kvjax.runtime.engine import Engine, prefill_groups
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request


@pytest.mark.parametrize(
    "name,method", [("llama", None), ("mistral", "zack"), ("falcon_new", "zack"), ("llama", "palu")]
)
def test_kernel_backend_matches_reference_greedy(name, method):
    cfg = dataclasses.replace(TINY_CONFIGS[name], head_dim=64, hidden_size=128)
    model = kvjax.Model.random(cfg, seed=7, scale=5.0)
    if method:
        model = varied_plan_model(model, method)
    prompts = [np.random.default_rng(1).integers(0, 97, n).tolist() for n in (5, 19, 2)]
    ref = kvjax.generate(model, prompts, max_new_tokens=6, max_batch=4, page_size=16, backend="reference")
    ker = kvjax.generate(model, prompts, max_new_tokens=6, max_batch=4, page_size=16, backend="interpret")
    assert [r.tokens for r in ker] == [r.tokens for r in ref]


def test_an_engine_with_other_decode_knobs_gives_the_reference_tokens():
    """``Engine(decode_config=...)`` (bench/engine.py's ``--knob``) runs the kernels with those knobs: one piece a
    run and runs of at most 64 columns cut the varied-width layers otherwise, and the greedy tokens stay the same."""
    cfg = dataclasses.replace(TINY_CONFIGS["mistral"], head_dim=64, hidden_size=128)
    model = varied_plan_model(kvjax.Model.random(cfg, seed=3, scale=5.0))
    prompts = [np.random.default_rng().integers(0, 97, n).tolist() for n in (9, 30)]
    config = dataclasses.replace(DECODE, max_segments=1, pack_tile=64)
    tokens = {}
    for backend, knobs in (("reference", DECODE), ("interpret", config)):
        runner = Runner(Engine(model, max_batch=2, max_seq_len=64, backend=backend, decode_config=knobs))
        requests = [runner.add(Request(p, 6)) for p in prompts]
        list(runner.run())
        tokens[backend] = [r.tokens for r in requests]
    assert tokens["interpret"] == tokens["reference"]
    with pytest.raises(TypeError, match="decode_config must be a DecodeConfig"):
        Engine(model, max_batch=2, max_seq_len=64, decode_config={"max_segments": 1})


def test_unknown_backend_and_unaligned_widths_are_rejected():
    model = kvjax.Model.random(TINY_CONFIGS["llama"])
    with pytest.raises(ValueError, match="attention backend"):
        kvjax.generate(model, [[1, 2]], max_new_tokens=2, backend="cuda")
    odd = kvjax.Model.random(dataclasses.replace(TINY_CONFIGS["llama"], head_dim=24, hidden_size=96))
    with pytest.raises(ValueError, match="multiples of 16"):
        kvjax.generate(odd, [[1, 2]], max_new_tokens=2, backend="interpret")


def test_the_decode_step_compiles_once_as_requests_come_and_go():
    """Requests of random lengths join and leave the batch, so the decode schedules differ from step to step: every
    schedule comes in the shape the op was built for, and the jitted decode step compiles once."""
    cfg = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
    model = varied_plan_model(kvjax.Model.random(cfg, seed=2))
    rng = np.random.default_rng()
    engine = Engine(model, max_batch=4, max_seq_len=256, backend="interpret")
    runner = Runner(engine, chunk_tokens=64)
    for n, new in zip(rng.integers(1, 200, 7), rng.integers(1, 12, 7)):
        runner.add(Request(rng.integers(0, 97, n).tolist(), int(new)))
    done = list(runner.run())
    assert len(done) == 7 and all(r.finish_reason == "length" for r in done)
    assert engine.decode_op.schedules.rebuilds > 1 and engine.decode_op.schedules.reshaped == 0
    assert engine._steps["decode", True]._cache_size() == 1


def test_palu_on_its_kernels_with_chunked_prompts_and_a_window_gives_the_reference_tokens():
    """Palu's fused decode and its full-width prefill over rebuilt K (prompts longer than a chunk, so later chunks
    read a prefix; Mistral's sliding window) give the reference path's greedy tokens."""
    cfg = dataclasses.replace(TINY_CONFIGS["mistral"], head_dim=64, hidden_size=128, sliding_window=40)
    model = varied_plan_model(kvjax.Model.random(cfg, seed=11, scale=5.0), "palu")
    prompts = [np.random.default_rng().integers(0, 97, n).tolist() for n in (70, 33, 5)]
    settings = dict(max_new_tokens=8, max_batch=4, page_size=16, chunk_tokens=32)
    ref = kvjax.generate(model, prompts, backend="reference", **settings)
    ker = kvjax.generate(model, prompts, backend="interpret", **settings)
    assert [r.tokens for r in ker] == [r.tokens for r in ref]


@pytest.mark.parametrize("seed", range(3))
def test_prefill_shapes_cover_every_call_the_runner_makes(seed):
    """Whatever chunks a step holds, each prefill call's padded shape is one ``compile_ahead`` compiles."""
    rng = np.random.default_rng()
    cfg = dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128)
    model = kvjax.Model.random(cfg, seed=seed)
    for _ in range(20):
        max_batch, page_size = int(rng.integers(1, 70)), int(rng.choice([4, 8, 12, 16]))
        chunk, max_seq_len = int(rng.integers(1, 300)), int(rng.integers(8, 400))
        least, most = int(rng.integers(1, 300)), int(rng.integers(1, 70))
        settings = dict(max_seq_len=max_seq_len, page_size=page_size, chunk_tokens=chunk, num_pages=2)
        if rng.random() < 0.5:
            settings |= dict(prefill_min_tokens=least, prefill_max_rows=most)
        engine = Engine(model, max_batch=max_batch, **settings)
        shapes = set(engine.prefill_shapes())
        lengths = rng.integers(1, min(chunk, engine.max_seq_len) + 1, int(rng.integers(1, max_batch + 1))).tolist()
        for call in prefill_groups(lengths, engine.prefill_limit, engine.prefill_min, engine.prefill_rows):
            assert len(call) <= engine.prefill_rows
            shape = engine.call_shape(len(call), max(lengths[i] for i in call))
            assert shape in shapes and shape[0] * shape[1] <= engine.prefill_limit, (settings, lengths, call)


def test_after_compile_ahead_no_step_compiles_and_the_tokens_stay():
    cfg = dataclasses.replace(TINY_CONFIGS["mistral"], head_dim=64, hidden_size=128)
    model = kvjax.Model.random(cfg, seed=5)
    rng = np.random.default_rng()
    requests = [
        (rng.integers(0, 97, n).tolist(), int(m)) for n, m in zip(rng.integers(1, 60, 6), rng.integers(1, 9, 6))
    ]
    settings = dict(max_batch=4, max_seq_len=96, page_size=8, chunk_tokens=16, backend="reference")
    tokens = []
    for ahead in (False, True):  # ahead: fewer prefill shapes too (at least 16 tokens, at most 2 rows a call)
        engine = Engine(model, **settings, **(dict(prefill_min_tokens=16, prefill_max_rows=2) if ahead else {}))
        if ahead:
            assert engine.compile_ahead(greedy=(True,), threads=2) == 1 + 2 * len(engine.prefill_shapes())
        runner = Runner(engine)
        for ids, new in requests:
            runner.add(Request(ids, new))
        tokens.append(sorted((r.prompt, r.tokens) for r in runner.run()))
        if ahead:
            assert all(step._cache_size() == 0 for step in engine._steps.values())
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("field", ["prefill_min_tokens", "prefill_max_rows"])
@pytest.mark.parametrize("value", [0, -3, 2.5, "8"])
def test_bad_prefill_shape_limits_are_refused(field, value):
    model = kvjax.Model.random(dataclasses.replace(TINY_CONFIGS["llama"], head_dim=64, hidden_size=128), seed=0)
    with pytest.raises((ValueError, TypeError), match=field):
        Engine(model, num_pages=4, **{field: value})
